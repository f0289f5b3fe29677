"""One speculative round, the same for one request and for a batch: propose (each request's tree from the
drafters: `propose` alone, the copy that pays in a batch), verify (every tree through the full model in one
forward, `forward_trees`, each against its own logits rows, `settle`), keep (the accepted path's cache entries);
then the round is counted in the request's stats (`account`)."""

from __future__ import annotations

import time

import torch

from swiftdecode.base.config import EngineConfig
from swiftdecode.decoding.request import Request
from swiftdecode.decoding.verification import verify
from swiftdecode.drafters.base import Copy, Drafter
from swiftdecode.drafters.registry import build
from swiftdecode.drafters.rowcost import CostLine, nodes_that_pay
from swiftdecode.engine.scheduler import RoundScheduler
from swiftdecode.runtime.model import Part, SwiftModel
from swiftdecode.runtime.tree import Tree


class Proposer:
    """An engine's drafters (kind -> Drafter, none for `ar`) and the scheduler that picks among them: a round's
    tree for one request (`propose`) or a batch's copies (`copy`), and what both learn from each round
    (`observe`). `line`: the seconds of a one-request forward by its rows (how much of a copy pays)."""

    def __init__(self, sm: SwiftModel, cfg: EngineConfig | None):
        self.cfg, self.drafters, self.line = cfg, build(sm, cfg) if cfg else {}, CostLine()
        modes = [k for k in cfg.modes if k not in self.drafters or not self.drafters[k].copies] if cfg else []
        self.schedule = RoundScheduler(modes, cfg.adaptive) if cfg else None

    def prefill_reader(self) -> Drafter | None:
        """The drafter that must read the next prompt's whole prefill (`Drafter.reads_prefill`), if any."""
        return next((d for d in self.drafters.values() if d.reads_prefill()), None)

    def ready(self) -> set[str]:
        """The model drafters that can draft now."""
        return {kind for kind, d in self.drafters.items() if not d.copies and d.ready()}

    def copy(self, req: Request, rows: int, length: int, line: CostLine) -> tuple[Copy | None, list[list[int]], str]:
        """The first copying drafter's candidates, the chains of at most `length` nodes in all that pay in a forward
        of `rows` rows by `line` ([] if none), and that drafter's kind ((None, [], "plain") where none copies)."""
        for kind, drafter in self.drafters.items():
            if drafter.copies and (copy := drafter.copy(req, length)) is not None:
                return copy, nodes_that_pay(line, copy.branches, rows, length), kind
        return None, [], "plain"

    def propose(self, req: Request) -> tuple[str, Tree, int]:
        """A request's round alone: its kind, tree and draft forwards. A copy where it pays, plain steps just after
        one ran out (`EngineConfig.resync`), else the scheduler's pick (plain or a model drafter, the copy joining)."""
        tree, room, cfg = Tree(req.ctx[-1]), req.room, self.cfg
        if cfg is None or room <= 1:
            return "plain", tree, 0
        length = min(cfg.draft.copy, room - 1)
        copy, pays, copier = self.copy(req, 1, length, self.line)
        kind = copier if pays else "plain" if req.since_copy < cfg.resync else self.schedule.choose(self.ready())
        req.since_copy, whole = 0 if pays else req.since_copy + 1, kind != copier  # whole: the copy joins a draft
        if kind == "plain":
            return kind, tree, 0
        steps = self.drafters[kind].grow(req, tree, room - 1, self.schedule.rate["plain"]) if whole else 0
        for chain in [copy.tokens] if whole and copy is not None else pays:
            tree.add_chain(chain, cfg.draft.max_nodes if whole else length, copier)
        return kind, tree, steps

    def observe(self, req: Request, kind: str, tree: Tree, tokens: list[int], seconds: float, verify_s: float) -> None:
        """A round alone took `seconds` (`verify_s` its forward): the cost line, the scheduler's rates and the
        drafters learn from it."""
        self.line.record(len(tree) + 1, verify_s)
        if self.schedule is not None:
            self.schedule.record(kind, len(tokens), seconds, self.ready())
            for drafter in self.drafters.values():
                drafter.observe(req, tokens, kind, self.schedule.budget)


def round_alone(sm: SwiftModel, proposer: Proposer, req: Request) -> tuple[list[int], torch.Tensor | None]:
    """A request's round alone, from the last token of req.ctx (not yet cached): propose, verify, keep; the new
    tokens and the logits rows that chose them (with logprobs only)."""
    t0 = time.perf_counter()
    kind, tree, steps = proposer.propose(req)
    t1, start = time.perf_counter(), req.cache.length
    tokens, rows, path = settle(req, tree, start, forward_trees(sm, [req], [tree])[0][0])
    t2, plain = time.perf_counter(), kind == "plain"
    verify_s = t2 - (t0 if plain else t1)  # a plain round's planning counts as verifying
    account(req, kind, tree, path, t2 - t0, verify_s, 0.0 if plain else t1 - t0, steps)
    proposer.observe(req, kind, tree, tokens, t2 - t0, verify_s)
    return tokens, rows


def forward_trees(
    sm: SwiftModel, reqs: list[Request], trees: list[Tree], chunk: Part | None = None, chunk_logits: int = 0
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """One full forward over every request's tree (root: its ctx[-1], after its cache) and a prompt `chunk`:
    logits [len(tree) + 1, V] per tree, and those of the chunk's last `chunk_logits` rows (else None). Every
    row is its own sequence's alone (batch-invariant kernels, per-request attention)."""
    parts = [
        (t.input_ids(), t.positions(r.cache.length), t.ancestry(), r.cache) for r, t in zip(reqs, trees, strict=True)
    ]
    hidden = sm.forward_batch(parts + ([chunk] if chunk is not None else []))
    rows = hidden[: len(reqs)] + ([hidden[-1][-chunk_logits:]] if chunk_logits else [])
    logits = list(sm.logits(torch.cat(rows)).split([len(h) for h in rows])) if rows else []
    return logits[: len(reqs)], logits[-1] if chunk_logits else None


def settle(
    req: Request, tree: Tree, start: int, logits: torch.Tensor
) -> tuple[list[int], torch.Tensor | None, list[int]]:
    """Verify the request's tree (root at `start`) against its logits rows and keep the accepted path's cache
    entries: the round's tokens, the rows that chose them (with logprobs only, else None) and the path."""
    path, bonus = verify(tree, logits, req.sampler, start)
    kept = [0] + [i + 1 for i in path]  # rows of the root and the accepted nodes: each chose the next token
    req.cache.keep(start, kept)
    rows = logits[kept] if req.top_logprobs is not None else None
    return [tree.tokens[i] for i in path] + [bonus], rows, path


def account(
    req: Request,
    kind: str,
    tree: Tree,
    path: list[int],
    seconds: float,
    verify_s: float,
    draft_s: float = 0.0,
    steps: int = 0,
    batched: bool = False,
) -> None:
    """Count a round of `kind` in the request's stats: `seconds` in all, `verify_s` verifying, `draft_s` drafting
    (`steps` draft forwards), and the accepted nodes by the drafter that proposed them."""
    stats, req.decode_s = req.stats, req.decode_s + draft_s + verify_s
    stats.round_kinds[kind] = stats.round_kinds.get(kind, 0) + 1
    stats.round_seconds[kind] = stats.round_seconds.get(kind, 0.0) + seconds
    stats.time_split["verify"] += verify_s
    stats.time_split["draft"] += draft_s
    stats.draft_steps += steps
    stats.batched_rounds += batched
    if kind != "plain":
        stats.count_tree(tree, path)
