"""One generation's state and its output rules: tokens are taken until EOS, the token budget or a stop string;
text is streamed in pieces that never end inside a possible stop string or a multi-byte character."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch

from swiftdecode.base.config import MODES, SOURCES
from swiftdecode.base.text import TextSoFar
from swiftdecode.decoding.logprobs import TokenLogprob, token_logprobs
from swiftdecode.decoding.sampling import Sampler
from swiftdecode.runtime.cache import SwiftCache
from swiftdecode.runtime.tree import Tree

# KV entries a round may write beyond the accepted tokens before rolling back: a draft tree (at most 64 nodes,
# swift-paper's) and its root, or a 32-token search window; the cache may grow this far past the request's end.
ROUND_SLACK = 128


@dataclass
class GenerationStats:
    new_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose cache entries were copied from an earlier sequence
    wall_s: float = 0.0
    draft_steps: int = 0
    drafted_depth: int = 0
    accepted_draft_tokens: int = 0
    round_tokens: int = 0
    time_split: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("prefill", "draft", "verify", "optimize"), 0.0)
    )
    # rounds of each kind and their seconds; accepted draft tokens by the drafter that proposed them ("both":
    # several did). The built-in kinds and sources are always listed; another drafter's once it counts.
    round_kinds: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MODES, 0))
    round_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(MODES, 0.0))
    accepted_by_source: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    skip: dict[str, list[int] | int] = field(default_factory=lambda: {"attn": [], "mlp": [], "sparsity": 0})
    search: str = "off"
    batched_rounds: int = 0  # rounds decoded together with other requests (server batching)

    def count_tree(self, tree: Tree, path: list[int]) -> None:
        """Count a verified tree round: drafted depth, accepted nodes (`path`) by the drafter that proposed them."""
        self.drafted_depth += max(tree.depths, default=0)
        self.accepted_draft_tokens += len(path)
        self.round_tokens += len(path) + 1
        for i in path:
            self.accepted_by_source[tree.sources[i]] = self.accepted_by_source.get(tree.sources[i], 0) + 1

    @property
    def tree_rounds(self) -> int:
        """Rounds that verified a draft tree (every kind but "plain")."""
        return sum(n for kind, n in self.round_kinds.items() if kind != "plain")

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens emitted per tree round, bonus token included."""
        return self.round_tokens / self.tree_rounds if self.tree_rounds else 1.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per drafted tree depth (the most a round could accept)."""
        return self.accepted_draft_tokens / self.drafted_depth if self.drafted_depth else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            tree_rounds=self.tree_rounds,
            tokens_per_s=self.tokens_per_s,
            mean_accepted_tokens=self.mean_accepted_tokens,
            acceptance_rate=self.acceptance_rate,
            optimize_share=self.time_split["optimize"] / self.wall_s if self.wall_s > 0 else 0.0,
        )
        return d


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when asked for


@dataclass
class StreamEvent:
    text: str
    token_ids: list[int]
    result: GenerationResult | None = None
    # entries of tokens whose text has now all been streamed (with `logprobs`), in order: the events' entries
    # together are the result's
    logprobs: list[TokenLogprob] = field(default_factory=list)


class Request:
    """A generation in progress: prompt ids, sampler, stop rules, its own KV cache and stats.

    `ctx` is the prompt plus the tokens taken so far; its last token is not yet in the cache. Its cache never
    grows past `capacity` entries per layer (prompt, budget and a round's slack). With `top_logprobs` (None: off)
    each token taken gets its log-probability and that many alternatives.
    """

    def __init__(
        self,
        ids: list[int],
        budget: int,
        sampler: Sampler,
        stop: list[str] | None,
        eos: set[int],
        decode,
        windows: list[int | None],
        top_logprobs: int | None = None,
        salt: str | None = None,
    ):
        self.ids, self.budget, self.sampler, self.eos, self.decode = ids, budget, sampler, eos, decode
        self.stop = stop or []
        self.top_logprobs, self.logprobs, self.logprobs_sent = top_logprobs, [], 0
        self.capacity, self.windows = len(ids) + budget + ROUND_SLACK, windows  # the cache's (KVLayout.windows)
        self.cache = SwiftCache(windows, self.capacity)
        self.ctx, self.new, self.emitted, self.finish = list(ids), [], "", None
        self.so_far = TextSoFar(decode)  # the text of `new`, decoded a few tokens a round
        self.searched = 0  # characters of so_far's text already searched for a stop string (none was there)
        self.drafts: dict[str, object] = {}  # each drafter's state for this request, under its source name
        self.stats = GenerationStats(prompt_tokens=len(ids))  # output only: nothing reads it back to decide
        self.decode_s = 0.0  # seconds of its rounds, drafting and verifying, alone or batched (`round.account`)
        self.since_copy = math.inf  # its rounds alone since the last that verified a copy (`Proposer.propose`)
        self.salt = salt  # the prefix cache's tenant: its entries serve only requests of the same salt
        self.start = time.perf_counter()

    @property
    def room(self) -> int:
        """Tokens this request may still take."""
        return self.budget - len(self.new)

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def resumed(self) -> bool:
        """Whether the request has taken tokens: a prefill of it recomputes ctx[:-1] (`batch.refill`), no pick."""
        return bool(self.new)

    def evict(self) -> None:
        """Drop the KV cache (memory ran short): a prefill of ctx[:-1] writes it again, the same bits (on the
        batch-invariant kernels a token's entries depend only on the tokens before it), and decoding goes on."""
        self.cache = SwiftCache(self.windows, self.capacity)

    def take(self, tokens: list[int], rows: torch.Tensor | None = None) -> StreamEvent | None:
        """Take a round's tokens (up to EOS, the budget or a stop string); returns the text to stream, if any.
        rows[i]: the logits that chose tokens[i] (needed with top_logprobs). Once done, the event carries the
        GenerationResult (stats.skip/search are the caller's to fill in)."""
        taken = []
        for tok in tokens:
            if tok in self.eos:
                self.finish = "stop"
                break
            self.new.append(tok)
            self.ctx.append(tok)
            taken.append(tok)
            if len(self.new) >= self.budget:
                break
        self.sampler.count(taken)
        if self.top_logprobs is not None and taken:
            self.logprobs += token_logprobs(rows, taken, self.top_logprobs)
        text = self.so_far.update(self.new)
        hit, self.searched = find_stop(text, self.stop, self.searched), len(text)
        if self.finish is not None or len(self.new) >= self.budget or hit is not None:
            text = self.decode(self.new)  # the end is decided on the whole text, decoded once
            cut = find_stop(text, self.stop)
            if cut is not None:
                text, self.finish = text[:cut], "stop"
                self.new = tokens_for(self.decode, self.new, cut)
                del self.logprobs[len(self.new) :]
            elif self.finish is None:  # the budget is reached
                self.finish = "length"
        if self.done:
            self.stats.new_tokens, self.stats.wall_s = len(self.new), time.perf_counter() - self.start
            lps = list(self.logprobs) if self.top_logprobs is not None else None
            result = GenerationResult(text, list(self.new), len(self.ids), self.finish, self.stats, lps)
            return StreamEvent(text[len(self.emitted) :], [], result, self.logprobs[self.logprobs_sent :])
        safe = text[: len(text) - stop_overlap(text, self.stop)]  # may be the start of a stop string
        if safe.startswith(self.emitted) and len(safe) > len(self.emitted) and not safe.endswith("\ufffd"):
            event = StreamEvent(safe[len(self.emitted) :], taken)
            self.emitted = safe
            if safe == text:  # every token's text is out: their entries can go too (a stop string may yet cut)
                event.logprobs, self.logprobs_sent = self.logprobs[self.logprobs_sent :], len(self.logprobs)
            return event
        return None


def find_stop(text: str, stop: list[str], searched: int = 0) -> int | None:
    """Where the first stop string in `text` begins, if any; text[:searched] is known to hold none, so only what
    ends after it is searched (a round's text, not the whole answer's)."""
    hits = [i for i in (text.find(s, max(searched - len(s) + 1, 0)) for s in stop) if i >= 0]
    return min(hits) if hits else None


def stop_overlap(text: str, stop: list[str]) -> int:
    """Length of the longest end of `text` that begins some stop string (held back while streaming): at most
    len(s) - 1 tests per stop string s, longest first (params.MAX_STOP_CHARS bounds them)."""
    best = 0
    for s in stop:
        best = next((n for n in range(min(len(s) - 1, len(text)), best, -1) if text.endswith(s[:n])), best)
    return best


def tokens_for(decode, ids: list[int], chars: int) -> list[int]:
    """Shortest prefix of ids whose text reaches past `chars` characters (the stop string's first character), by
    bisection: O(log n) decodes. A prefix's text grows with it (a cut multi-byte character aside, which may move
    the cut by a token; the rule is the same for every method, so they stay identical)."""
    lo, hi = 1, len(ids)  # the answer lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(decode(ids[:mid])) > chars else (mid + 1, hi)
    return ids[:lo]
