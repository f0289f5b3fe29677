"""Log-probabilities of the tokens a generation takes and of the likeliest alternatives (OpenAI's `logprobs`).

They are the model's own distribution at each position: log-softmax of the logits as the forward returns them,
before temperature, top-k or top-p (what vLLM reports by default). Each comes from the logits row that chose the
token, a verification row where speculation accepted it; on the batch-invariant kernels that row holds the bits
plain decoding computes, so every method and every batch report the same numbers for the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from swiftdecode.runtime.cache import SwiftCache

# OpenAI's floor for a log-probability too small to represent (JSON has no -Infinity)
FLOOR = -9999.0
# The k likeliest tokens are looked for among the logits within a margin of the largest, widened until at least k
# are there (SmolLM2's rows over 128 generated tokens: a median of 3 tokens within 4 of the largest, 16 within 8,
# at most 661 within 8); the whole row only where fewer than k are within 16. On those rows (a development script,
# Intel Xeon) an entry took ~65 µs without alternatives and ~135 µs with 5 (torch.topk alone: ~125 µs); the result
# is the k largest either way.
TOP_MARGINS = (4.0, 8.0, 16.0)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the row's k likeliest tokens and their log-probabilities, likeliest first


def token_logprobs(rows: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """An entry per token: tokens[i]'s log-probability under logits rows[i] ([≥ len(tokens), V]) and the row's k
    likeliest tokens. Row by row, so an entry never depends on the rows beside it."""
    out = []
    for row, token in zip(rows, tokens, strict=False):
        x = row.float()
        lse = np.float32(torch.logsumexp(x, dim=-1))  # log p = x - logsumexp(x), in float32: no [V] log-softmax
        x = x.numpy()
        top = ()
        if k:
            best = x.max()
            for margin in TOP_MARGINS:
                if len(near := np.flatnonzero(x >= best - margin)) >= k:
                    break
            else:
                near = np.arange(len(x))
            near = near[x[near] >= np.partition(x[near], len(near) - k)[len(near) - k]]  # the k largest, and ties
            ids = near[np.lexsort((near, -x[near]))[:k]]  # likeliest first, lower ids first on ties
            top = tuple((int(t), max(float(x[t] - lse), FLOOR)) for t in ids)
        out.append(TokenLogprob(token, max(float(x[token] - lse), FLOOR), top))
    return out


PROMPT_CHUNK = 256  # prompt rows per forward when scoring a prompt: bounds the [rows, V] logits held at once


class PromptScorer:
    """Entries for ids[1:] (entry i: ids[i + 1] under the logits after ids[: i + 1]) from a causal forward of `ids`
    on a cache of its own, one chunk per `step()`, so a server can score a long prompt between other requests'
    rounds (`sm`: a model.SwiftModel). On the batch-invariant kernels
    a row depends only on the tokens before it, so each entry is what generating that token reports."""

    def __init__(self, sm, ids: list[int], k: int):
        self.sm, self.ids, self.k = sm, ids, k
        self.cache = SwiftCache(sm.kv_layout().windows, len(ids))
        self.entries: list[TokenLogprob] = []
        self.scored = 0  # prompt tokens through the forward so far

    @property
    def done(self) -> bool:
        return self.scored >= len(self.ids)

    def step(self) -> None:
        """Score the next PROMPT_CHUNK tokens."""
        ids, positions, causal, cache = self.part(PROMPT_CHUNK)
        self.took(self.sm.logits(self.sm.forward(ids, positions, causal, cache)))

    def part(self, chunk: int) -> tuple[list[int], torch.Tensor, torch.Tensor, SwiftCache]:
        """The next `chunk` tokens' rows (at most PROMPT_CHUNK), as a forward takes them beside other sequences'
        (a model.Part); `took` then scores their logits."""
        s = self.scored
        ids = self.ids[s : s + min(chunk, PROMPT_CHUNK)]
        return ids, torch.arange(s, s + len(ids)), torch.ones(len(ids), len(ids), dtype=torch.bool).tril_(), self.cache

    def took(self, rows: torch.Tensor) -> None:
        """The entries of the rows `part` gave, from their logits [rows, V]."""
        s = self.scored
        self.entries += token_logprobs(rows, self.ids[s + 1 : s + 1 + len(rows)], self.k)
        self.scored = min(len(self.ids), s + len(rows))


def prompt_logprobs(sm, ids: list[int], k: int) -> tuple[list[TokenLogprob], SwiftCache]:
    """The PromptScorer's entries for ids[1:] and its cache, all chunks in one call."""
    scorer = PromptScorer(sm, ids, k)
    while not scorer.done:
        scorer.step()
    return scorer.entries, scorer.cache
