"""Log-probabilities of the tokens a generation takes and of the likeliest alternatives (OpenAI's `logprobs`).

They are the model's own distribution at each position: log-softmax of the logits as the forward returns them,
before temperature, top-k or top-p (what vLLM reports by default). Each comes from the logits row that chose the
token, a verification row where speculation accepted it; on the batch-invariant kernels that row holds the bits
plain decoding computes, so every method and every batch report the same numbers for the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# OpenAI's floor for a log-probability too small to represent (JSON has no -Infinity)
FLOOR = -9999.0


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
        lp = torch.log_softmax(row.float(), dim=-1)
        top = torch.topk(lp, k) if k else None
        pairs = zip(top.indices.tolist(), top.values.tolist(), strict=True) if top is not None else ()
        out.append(TokenLogprob(token, max(float(lp[token]), FLOOR), tuple((t, max(v, FLOOR)) for t, v in pairs)))
    return out
