"""Continuous batching: requests join and leave between rounds; each round, every active request's tree goes
through the full model in one forward over all their rows, each request attending only to its own cache.

A request alone runs the engine's own rounds (skip-model drafts, search). With company, each proposes its
n-gram continuation (or only its last token) and the batch shares one pass over the weights: on a CPU a
forward of 8 rows costs well under twice a forward of one, so decoding requests together multiplies
throughput. Every row's result depends only on its own sequence (batch-invariant kernels, per-request
attention), and acceptance is `verify`'s, so each request's output is exactly what it would be alone.
"""

from __future__ import annotations

import time

import torch

from swiftdecode.drafting import add_chain, ngram_continuation
from swiftdecode.engine import Generator
from swiftdecode.request import Request, StreamEvent
from swiftdecode.tree import SOURCE_NAMES, Tree
from swiftdecode.verification import verify

# Rows of one batched forward, roots included, before n-gram nodes are given out: beyond ~16 rows the quantized
# kernel is compute-bound and more rows cost about proportionally (swiftdecode doctor prints the curve).
BATCH_ROWS = 16


class Batch:
    """The requests decoding together on one Generator (its model, search state and method)."""

    def __init__(self, gen: Generator):
        self.gen = gen
        self.active: list[Request] = []

    def add(self, req: Request) -> StreamEvent | None:
        """Prefill a new request (its own forward) and take its first token; it joins the next round."""
        event = self.gen.begin(req)
        if not req.done:
            self.active.append(req)
        return event

    def remove(self, req: Request) -> None:
        if req in self.active:
            self.active.remove(req)

    def step(self) -> list[tuple[Request, StreamEvent | None]]:
        """One round for every active request; finished requests leave the batch."""
        if len(self.active) == 1:
            req = self.active[0]
            out = [(req, self.gen.step(req))]
        else:
            out = self._batched_round()
        self.active = [r for r in self.active if not r.done]
        return out

    def _batched_round(self) -> list[tuple[Request, StreamEvent | None]]:
        gen, sm, reqs = self.gen, self.gen.sm, self.active
        speculate = gen.cfg is not None and "ngram" in gen.cfg.modes
        nodes = max(BATCH_ROWS - len(reqs), 0) // len(reqs) if speculate else 0
        trees, parts = [], []
        for req in reqs:
            tree = Tree(req.ctx[-1])
            add_chain(tree, ngram_continuation(req.ctx, min(nodes, req.room - 1)), nodes)
            trees.append(tree)
            parts.append((tree.input_ids(), tree.positions(req.cache.length), tree.ancestry(), req.cache))
        t0 = time.perf_counter()
        starts = [req.cache.length for req in reqs]
        hidden = sm.forward_batch(parts)
        logits = sm.logits(torch.cat(hidden)).split([len(h) for h in hidden])
        seconds = (time.perf_counter() - t0) / len(reqs)  # the shared forward, split evenly
        out = []
        for req, tree, start, rows in zip(reqs, trees, starts, logits, strict=True):
            path, bonus = verify(tree, rows, req.sampler, start)
            req.cache.keep(start, torch.tensor([0] + [i + 1 for i in path]))
            _account(req, tree, path, seconds)
            out.append((req, gen.advance(req, [tree.tokens[i] for i in path] + [bonus])))
        return out


def _account(req: Request, tree: Tree, path: list[int], seconds: float) -> None:
    """Count a batched round in the request's stats: its kind, time share and accepted tokens by source."""
    s, kind = req.stats, "ngram" if len(tree) else "plain"
    s.batched_rounds += 1
    s.round_kinds[kind] += 1
    s.round_seconds[kind] += seconds
    s.time_split["verify"] += seconds
    if len(tree):
        s.drafted_depth += max(tree.depths)
        s.accepted_draft_tokens += len(path)
        s.round_tokens += len(path) + 1
        for i in path:
            s.accepted_by_source[SOURCE_NAMES[tree.sources[i]]] += 1
