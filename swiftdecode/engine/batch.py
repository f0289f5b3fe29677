"""Continuous batching: requests join and leave between rounds; each round, every active request's tree goes
through the full model in one forward over all their rows, each request attending only to its own cache.

A request alone runs the engine's own rounds (skip-model drafts, search). With company, each proposes as much
of its n-gram continuation as measured to pay (`rowcost`), or only its last token, and the batch shares one
pass over the weights: on a CPU a
forward of 8 rows costs well under twice a forward of one, so decoding requests together multiplies
throughput. A joining prompt is prefilled in chunks inside those rounds, so the others keep decoding. Every
row's result depends only on its own sequence (batch-invariant kernels, per-request attention; a chunked
prefill writes the same cache entries as a whole one), and acceptance is `verify`'s, so each request's
output is exactly what it would be alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from swiftdecode.decoding.request import Request, StreamEvent
from swiftdecode.drafters.rowcost import CostLine
from swiftdecode.engine import pacing
from swiftdecode.engine.generator import Generator
from swiftdecode.engine.round import account, forward_trees, settle
from swiftdecode.runtime.model import Part, SwiftModel
from swiftdecode.runtime.tree import Tree

# Rows of one batched forward at most, roots included, when n-gram nodes are given out (how many of them pay is
# measured: rowcost.tokens_that_pay); beyond ~16 rows the quantized kernel is compute-bound and rows cost about
# proportionally (swiftdecode doctor prints the curve).
BATCH_ROWS = 16
PREFILL_CHUNK = pacing.CHUNK  # a prompt's rows per round at most (pacing: fewer while others decode)
NOT_YET = object()  # a joining request's round that prefilled a chunk of its prompt: nothing to report


class Batch:
    """The requests decoding together on one Generator (its model, search state and method)."""

    def __init__(self, gen: Generator):
        self.gen = gen
        self.active: list[Request] = []  # decoding
        self.joining: list[Request] = []  # prompts being prefilled in chunks, in arrival order
        self.prefilled: dict[Request, int] = {}  # prompt tokens of each joining request already in its cache
        self.rows = 0  # rows of the last batched forward (0 when the last round ran alone)
        self.line = CostLine()  # seconds of a batched forward by its rows: how many copied tokens pay
        self.pacer = pacing.ChunkPacer()  # a joining prompt's rows per round beside decoding requests
        self.scorer = None  # a prompt scored for its log-probabilities (logprobs.PromptScorer), a chunk a round
        self.last_work: str | None = None  # the kind of prompt work the last round did: kinds take turns

    def __len__(self) -> int:
        return len(self.active) + len(self.joining)

    def add(self, req: Request) -> StreamEvent | None:
        """A new request (or an evicted one, whose context is prefilled again): prefilled now if it is one chunk
        and nothing else runs (or the engine must see its whole prefill), else in chunks over the next rounds.
        Returns its first event if it has one yet."""
        prompt = len(req.ctx) - 1 if req.resumed else len(req.ids)
        if (not len(self) and prompt <= PREFILL_CHUNK) or not self.gen.plain_prefill():
            event = refill(self.gen.sm, req) if req.resumed else self.gen.begin(req)
            if not req.done:
                self.active.append(req)
            return event
        self.joining.append(req)
        self.prefilled[req] = self.gen.take_prompt(req)
        return None

    def remove(self, req: Request) -> None:
        if req in self.active:
            self.active.remove(req)
        if req in self.joining:
            self.joining.remove(req)
            del self.prefilled[req]

    def step(self, hold: set[Request] = frozenset()) -> list[tuple[Request, StreamEvent | Exception | None]]:
        """One round for every active request not in `hold` (and a prompt chunk of the first joining one);
        requests that finish leave the batch, and so does a request whose own part of the round raised (its
        sampler, grammar or stop rules): its exception is its event, and the others' rounds are unaffected."""
        reqs, scoring = [r for r in self.active if r not in hold], self.scorer is not None and not self.scorer.done
        if not reqs and not self.joining and not scoring:
            return []
        if len(reqs) == 1 and not self.joining and not scoring:
            req, self.rows, t0 = reqs[0], 0, time.perf_counter()
            out = [(req, self._settled(req, self.gen.step, req))]
            self.pacer.decoded(time.perf_counter() - t0)
        else:
            out = self._batched_round(reqs)
        self.active = [r for r in self.active if not r.done]
        return out

    def _batched_round(self, reqs: list[Request]) -> list[tuple[Request, StreamEvent | Exception | None]]:
        """One round (`round`) for `reqs` together: each proposes the copy that pays in a forward of this many
        rows (or only its last token), and the first joining request's prompt rides along as a chunk."""
        gen = self.gen
        speculate = any(d.copies for d in gen.proposer.drafters.values())
        cap = max(BATCH_ROWS - len(reqs), 0) // max(len(reqs), 1) if speculate else 0
        trees, kinds = [], []
        for req in reqs:
            tree = Tree(req.ctx[-1])
            length = min(cap, req.room - 1)
            pays, kind = gen.proposer.copy(req, len(reqs), length, self.line)[1:]
            for chain in pays:
                tree.add_chain(chain, length, kind)
            trees.append(tree)
            kinds.append(kind if pays else "plain")
        work, chunk, ends = self._prompt_chunk(bool(reqs))
        joiner = self.joining[0] if work == "prefill" else None
        picks = joiner is not None and ends and not joiner.resumed  # its last row's logits choose its first token
        starts = [req.cache.length for req in reqs]
        self.rows = sum(len(t) + 1 for t in trees) + (len(chunk[0]) if chunk else 0)
        t0 = time.perf_counter()
        wanted = len(chunk[0]) if work == "score" else int(picks)  # the chunk's rows whose logits are needed
        logits, last = forward_trees(gen.sm, reqs, trees, chunk, wanted)
        if work == "score":  # its rows' entries: part of what the chunk adds to the round
            self.scorer.took(last)
        elapsed = time.perf_counter() - t0
        if work is None:  # prompt chunks cost more per row than decoding rows: left out of the fit
            self.line.record(self.rows, elapsed)
            self.pacer.decoded(elapsed)
        elif reqs:
            self.pacer.read(work, len(chunk[0]), elapsed - (self.pacer.decode_s or 0.0))
        seconds = elapsed / (len(reqs) + (work is not None))  # the shared forward, split evenly
        out = []
        for req, tree, kind, start, scores in zip(reqs, trees, kinds, starts, logits, strict=True):
            out.append((req, self._settled(req, self._verified, req, tree, kind, start, scores, seconds)))
        if joiner is not None:
            out.append((joiner, self._settled(joiner, self._prefilled, joiner, ends, seconds, last)))
        return [(req, event) for req, event in out if event is not NOT_YET]

    def _prompt_chunk(self, decoding: bool) -> tuple[str | None, Part | None, bool]:
        """This round's prompt rows, one kind a round, paced beside `decoding` requests: (kind, rows, whether
        they end the prompt). A chunk of the first joining request's prompt ("prefill") or of the prompt being
        scored ("score"), taking turns when both wait (joining requests arriving all the time starved a prompt
        being scored), else (None, None, False)."""
        if decoding and self.pacer.decode_s is None:  # a round of the decoding requests alone is measured first
            return None, None, False
        scoring = self.scorer is not None and not self.scorer.done
        if self.joining and not (scoring and self.last_work == "prefill"):
            self.last_work = "prefill"
            joiner = self.joining[0]
            done, goal = self.prefilled[joiner], len(joiner.ctx) - 1 if joiner.resumed else len(joiner.ids)
            end = min(done + self.pacer.rows("prefill", decoding), goal)
            causal = torch.ones(end - done, end - done, dtype=torch.bool).tril_()
            return "prefill", (joiner.ctx[done:end], torch.arange(done, end), causal, joiner.cache), end == goal
        if scoring:
            self.last_work = "score"
            return "score", self.scorer.part(self.pacer.rows("score", decoding)), False
        return None, None, False

    def _settled(self, req: Request, part: Callable, *args) -> StreamEvent | Exception | None:
        """part(*args): one request's own part of a round. If it raises, the request leaves the batch and the
        exception is returned as its event: every row of the round is its own request's alone (batch-invariant
        kernels), so the others go on exactly as they would have."""
        try:
            return part(*args)
        except Exception as e:
            self.remove(req)
            return e

    def _verified(
        self, req: Request, tree: Tree, kind: str, start: int, scores: torch.Tensor, seconds: float
    ) -> StreamEvent | None:
        """Verify a request's tree against its logits rows [len(tree) + 1, V], keep the accepted path's cache
        entries, count the round and take its tokens."""
        tokens, rows, path = settle(req, tree, start, scores)
        account(req, kind, tree, path, seconds, seconds, batched=True)
        return self.gen.advance(req, tokens, rows)

    def _prefilled(self, req: Request, last: bool, seconds: float, logits) -> StreamEvent | None | object:
        """Record a prefilled chunk; after the `last` one the request takes its first token (from `logits`; an
        evicted request takes none) and starts decoding (NOT_YET before: a chunk has no event)."""
        req.stats.time_split["prefill"] += seconds
        self.prefilled[req] = req.cache.length
        if not last:
            return NOT_YET
        self.remove(req)
        first = [] if logits is None else [req.sampler.pick(logits[0], len(req.ids))]
        event = self.gen.advance(req, first, logits[:1]) if first else None
        if not req.done:
            self.active.append(req)
        return event


def refill(sm: SwiftModel, req: Request) -> None:
    """Recompute an evicted request's cache (`Request.evict`): a prefill of its context but the last token."""
    t = time.perf_counter()
    sm.prefill(req.ctx[:-1], req.cache)
    req.stats.time_split["prefill"] += time.perf_counter() - t
