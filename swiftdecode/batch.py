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

import torch

from swiftdecode.drafting import add_chain
from swiftdecode.engine import Generator
from swiftdecode.request import Request, StreamEvent
from swiftdecode.rowcost import CostLine
from swiftdecode.tree import Tree
from swiftdecode.verification import verify

# Rows of one batched forward at most, roots included, when n-gram nodes are given out (how many of them pay is
# measured: rowcost.CopyPlanner); beyond ~16 rows the quantized kernel is compute-bound and rows cost about
# proportionally (swiftdecode doctor prints the curve).
BATCH_ROWS = 16
# Prompt rows prefilled per round while other requests decode: a round then costs a few decode steps, so
# their tokens keep flowing while a long prompt (thousands of tokens) is read.
PREFILL_CHUNK = 256


class Batch:
    """The requests decoding together on one Generator (its model, search state and method)."""

    def __init__(self, gen: Generator):
        self.gen = gen
        self.active: list[Request] = []  # decoding
        self.joining: list[Request] = []  # prompts being prefilled in chunks, in arrival order
        self.prefilled: dict[Request, int] = {}  # prompt tokens of each joining request already in its cache
        self.rows = 0  # rows of the last batched forward (0 when the last round ran alone)
        self.line = CostLine()  # seconds of a batched forward by its rows: how many copied tokens pay

    def __len__(self) -> int:
        return len(self.active) + len(self.joining)

    def add(self, req: Request) -> StreamEvent | None:
        """A new request: prefilled now if nothing else runs (or the engine must see its whole prefill), else in
        chunks over the next rounds. Returns its first event if it has one yet."""
        if not len(self) or not self.gen.plain_prefill():
            event = self.gen.begin(req)
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

    def step(self) -> list[tuple[Request, StreamEvent | None]]:
        """One round for every active request (and a prompt chunk of the first joining one); requests that
        finish leave the batch."""
        if not len(self):
            return []
        if len(self.active) == 1 and not self.joining:
            req, self.rows = self.active[0], 0
            out = [(req, self.gen.step(req))]
        else:
            out = self._batched_round()
        self.active = [r for r in self.active if not r.done]
        return out

    def _batched_round(self) -> list[tuple[Request, StreamEvent | None]]:
        gen, sm, reqs = self.gen, self.gen.sm, list(self.active)
        speculate = gen.cfg is not None and "ngram" in gen.cfg.modes
        cap = max(BATCH_ROWS - len(reqs), 0) // max(len(reqs), 1) if speculate else 0
        trees, parts = [], []
        for req in reqs:
            tree = Tree(req.ctx[-1])
            copied, pays = gen.copies.plan(req, len(reqs), min(cap, req.room - 1), self.line)
            add_chain(tree, copied[:pays], pays)
            trees.append(tree)
            parts.append((tree.input_ids(), tree.positions(req.cache.length), tree.ancestry(), req.cache))
        joiner = self.joining[0] if self.joining else None
        if joiner is not None:  # the whole rest of its prompt when nobody decodes, else one chunk
            done = self.prefilled[joiner]
            end = len(joiner.ids) if not reqs else min(done + PREFILL_CHUNK, len(joiner.ids))
            causal = torch.ones(end - done, end - done, dtype=torch.bool).tril_()
            parts.append((joiner.ids[done:end], torch.arange(done, end), causal, joiner.cache))
        starts = [req.cache.length for req in reqs]
        self.rows = sum(len(part[0]) for part in parts)
        t0 = time.perf_counter()
        hidden = sm.forward_batch(parts)
        rows = hidden[: len(reqs)] + ([hidden[-1][-1:]] if joiner is not None and end == len(joiner.ids) else [])
        logits = sm.logits(torch.cat(rows)).split([len(h) for h in rows]) if rows else []
        elapsed = time.perf_counter() - t0
        if joiner is None:  # prompt chunks cost more per row than decoding rows: left out of the fit
            self.line.record(self.rows, elapsed)
        seconds = elapsed / len(parts)  # the shared forward, split evenly
        out = []
        for req, tree, start, scores in zip(reqs, trees, starts, logits, strict=False):
            path, bonus = verify(tree, scores, req.sampler, start)
            kept = [0] + [i + 1 for i in path]  # rows that chose the round's tokens
            req.cache.keep(start, kept)
            _account(req, tree, path, seconds)
            rows = scores[kept] if req.top_logprobs is not None else None
            out.append((req, gen.advance(req, [tree.tokens[i] for i in path] + [bonus], rows)))
        if joiner is not None:
            out += self._prefilled(joiner, end, seconds, logits[-1] if end == len(joiner.ids) else None)
        return out

    def _prefilled(self, req: Request, end: int, seconds: float, logits) -> list[tuple[Request, StreamEvent | None]]:
        """Record a prefilled chunk; after the last one the request takes its first token and starts decoding."""
        req.stats.time_split["prefill"] += seconds
        self.prefilled[req] = end
        if logits is None:
            return []
        self.remove(req)
        event = self.gen.advance(req, [req.sampler.pick(logits[0], len(req.ids))], logits[:1])
        if not req.done:
            self.active.append(req)
        return [(req, event)]


def _account(req: Request, tree: Tree, path: list[int], seconds: float) -> None:
    """Count a batched round in the request's stats: its kind, time share and accepted tokens by source."""
    s, kind = req.stats, "ngram" if len(tree) else "plain"
    s.batched_rounds += 1
    s.round_kinds[kind] += 1
    s.round_seconds[kind] += seconds
    s.time_split["verify"] += seconds
    if len(tree):
        s.count_tree(tree, path)
