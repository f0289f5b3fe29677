"""The drafter interface: where a round's draft tokens come from, and what a drafter learns from the rounds.

A round (`engine.round`) asks the drafters for a tree below the request's last token, verifies it in one full
forward and keeps the accepted path (the models: llama.cpp's common/speculative, transformers' candidate
generators, vLLM's proposers). Two kinds of drafter share the interface:
- a copying drafter (`copies = True`) proposes candidate chains from text it has seen, without a forward
  (`copy`); their acceptance odds by depth let the row-cost planner (`rowcost.nodes_that_pay`) decide which of
  their tokens a forward should verify (a tree: shared beginnings once);
- a model drafter grows a tree with forwards (`grow`); the scheduler runs its rounds where their measured
  tokens per second beat the others'.
A new drafter is one module and one line in `registry.DRAFTERS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch

    from swiftdecode.base.config import EngineConfig
    from swiftdecode.decoding.request import Request
    from swiftdecode.drafters.budget import TimeBudget
    from swiftdecode.runtime.cache import SwiftCache
    from swiftdecode.runtime.model import SwiftModel
    from swiftdecode.runtime.tree import Tree


@dataclass
class Branch:
    """A candidate chain below the tree's root, and accept(d), the estimated chance that its first d tokens
    (d >= 1) are the ones the model generates."""

    tokens: list[int]
    accept: Callable[[int], float]


@dataclass
class Copy:
    """A copying drafter's proposal: candidate chains, best first (at least one)."""

    branches: list[Branch]

    @property
    def tokens(self) -> list[int]:
        """The best candidate's chain."""
        return self.branches[0].tokens


class Drafter:
    """One source of draft tokens, built once per engine (`__init__(sm, cfg)`); its state lives across requests.
    `kind`: the round kind it leads (GenerationStats.round_kinds); `source`: the name its accepted tokens are
    counted under (GenerationStats.accepted_by_source). Every method but the one of its kind has a default."""

    kind: ClassVar[str]
    source: ClassVar[str]
    copies: ClassVar[bool] = False

    def __init__(self, sm: SwiftModel, cfg: EngineConfig):
        self.sm, self.cfg = sm, cfg

    def ready(self) -> bool:
        """Whether it can draft now (a model drafter may need a first prompt to set itself up)."""
        return True

    def reads_prefill(self) -> bool:
        """Whether the next prompt's prefill must run through `prefill` (whole, not chunked beside others)."""
        return False

    def prefill(self, ids: list[int], cache: SwiftCache) -> torch.Tensor:
        """A prompt's full forward into `cache`, observed by the drafter; the last row's logits [V]."""
        raise NotImplementedError

    def begin(self, req: Request) -> None:
        """A new request's prompt, before its prefill."""

    def copy(self, req: Request, length: int) -> Copy | None:
        """A copying drafter's candidate chains of at most `length` tokens each after req.ctx, or None."""
        return None

    def grow(self, req: Request, tree: Tree, length: int, plain_s: float | None) -> int:
        """A model drafter grows `tree` (root: req.ctx[-1], at position req.cache.length) at most `length` deep,
        on the request's cache (rolled back before it returns); `plain_s`: a plain round's measured seconds (None
        before one). Returns the draft forwards run."""
        return 0

    def observe(self, req: Request, tokens: list[int], kind: str, budget: TimeBudget) -> None:
        """A round of `kind` gave `tokens` (not yet taken into req.ctx); `budget`: the time a search may spend."""

    def end(self, req: Request) -> None:
        """A request finished (its stats are filled in before its result is returned)."""

    def kept_bytes(self) -> int:
        """Memory it keeps across requests beyond its fixed tables (bytes; a copying drafter's pool)."""
        return 0
