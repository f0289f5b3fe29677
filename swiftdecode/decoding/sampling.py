"""The model's token choice at each position: greedy argmax, or a seeded sample of the processed distribution.

Sampling uses an exponential race: token = argmax_i p_i / E_i with E_i ~ Exp(1), which is distributed exactly
as p. The noise E_i is a pure function of (seed, position, token id), so the token chosen at a position depends
only on the model's distribution there and the seed — not on how many draft candidates were checked, nor on
which tokens anyone asked noise for. Speculative verification is then "follow the children that equal the
chosen token", lossless like greedy, and a seed gives the same text with any method. A hash of the triple
(splitmix64) gives each E_i, so a pick draws noise only for the tokens p keeps (the top-p/top-k set).
"""

from __future__ import annotations

import numpy as np
import torch

from swiftdecode.base.params import SamplingParams
from swiftdecode.decoding.grammar import Constraint


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [V] of logits [V] after temperature, then top-k, then top-p (the smallest set with mass ≥
    top_p) and min-p (tokens at least min_p times as likely as the likeliest), renormalised."""
    probs = _softmax(logits, params)
    if params.top_p == 1.0 and params.min_p == 0.0:
        return probs
    only = _placed(probs, *_support(probs, params))
    return only / only.sum()


def kept(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens `probabilities` gives a nonzero probability, ascending ids [n], and those probabilities [n],
    the same bits without the division over the vocabulary: the set's values are summed where they lie, as
    `probabilities` sums them."""
    probs = _softmax(logits, params)
    if params.top_p == 1.0 and params.min_p == 0.0:
        ids = torch.nonzero(probs).flatten()
        return ids, probs[ids]
    ids, top = _support(probs, params)
    total = _placed(probs, ids, top).sum()
    nonzero = top > 0  # a kept probability may have underflowed to 0
    return ids[nonzero], top[nonzero] / total


def _support(probs: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-p set of probs [V] (all of it at top_p = 1) less the tokens below min_p times the largest
    probability: ascending ids and their probabilities, not renormalised."""
    if params.top_p < 1.0:
        ids, top = _nucleus(probs, params.top_p)
    else:
        ids = torch.nonzero(probs).flatten()
        top = probs[ids]
    if params.min_p > 0.0:
        keep = top >= params.min_p * probs.max()
        ids, top = ids[keep], top[keep]
    return ids, top


def _placed(probs: torch.Tensor, ids: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """A vector like probs [V] holding `top` at `ids` and 0 elsewhere: the top-p set where it lies, which both
    `probabilities` and `kept` sum (so their sums are the same bits)."""
    return torch.zeros_like(probs).index_put_((ids,), top)


def _softmax(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """softmax(logits / temperature) [V], with only the top_k largest logits kept (top_k > 0)."""
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.softmax(logits, dim=-1)


# The top-p set is looked for first among the tokens within 5.5, then 8.3 nats of the likeliest (probability
# above 2^-8, then 2^-12 of the largest), then in a top-k grown from 4096 until it holds the set. A top-k grown
# from 256, as before, took 0.41-0.72 ms a token on Qwen2.5's 152k vocabulary; this 0.18-0.42 (real logits,
# temperature 0.7-1.3, top-p 0.5-0.95).
NUCLEUS_TRIES = (2.0**-8, 2.0**-12)
NUCLEUS_TOPK = 4096
# Candidates whose mass reaches top_p by this much hold the set: the mass before the first token left out is
# theirs to within a few float32 rounding steps (~1e-7 each).
NUCLEUS_MARGIN = 1e-6


def _nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-p set of probs [V], ascending ids and their probabilities: the tokens of the descending order whose
    mass before them (`cumsum`) is below top_p, as a full sort gives them. Sorting only the candidates above a
    threshold gives the same masses before each of them, and when the candidates' mass reaches top_p (by the
    margin) no token below the threshold can be in the set; a top-k holds it once its last token is out."""
    values = probs.numpy()
    largest = float(values.max())
    for share in NUCLEUS_TRIES if top_p + NUCLEUS_MARGIN < 1.0 else ():  # else no candidates can show it
        cand = torch.from_numpy(np.flatnonzero(values > largest * share))
        top, order = torch.sort(probs[cand], descending=True)
        before = top.cumsum(-1) - top
        if len(top) and float(before[-1] + top[-1]) >= top_p + NUCLEUS_MARGIN:
            break
    else:
        k = min(NUCLEUS_TOPK, len(probs))
        while True:
            top, order = torch.topk(probs, k)
            before = top.cumsum(-1) - top
            if k == len(probs) or float(before[-1]) >= top_p:
                break
            k = min(2 * k, len(probs))
        cand = torch.arange(len(probs))
    keep = before < top_p
    ids, sort = torch.sort(cand[order[keep]])
    return ids, top[keep][sort]


def argmax(x: torch.Tensor) -> int:
    """Index of the first largest entry of a 1-D tensor (NaN counts as largest), as torch.argmax gives it; on a
    CPU by numpy's vectorised argmax: ~7 µs for a 152k-token row where torch.argmax takes ~90 µs, and every
    round picks one token per accepted node."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 1:
        return int(x.numpy().argmax())
    return int(x.argmax())


NOISE_KEPT = 64  # positions whose whole-vocabulary noise stays cached behind the newest one (a round's tree depth)
GOLDEN, MIX1, MIX2 = (np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _mix(seed: int, position: int) -> int:
    """A 63-bit key for (seed, position): splitmix64 of the pair, so neighbours are unrelated."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) >> 1


def exp_noise(key: int, ids: np.ndarray) -> torch.Tensor:
    """E ~ Exp(1) for each token id under `key` (`_mix(seed, position)`), float32: splitmix64 of key + id, its
    top 53 bits as u in (0, 1), E = −log u (~0.2 ms for 49k ids where torch's seeded generator took ~0.9)."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as splitmix64 wants
        z = np.uint64(key) + (ids.astype(np.uint64) + np.uint64(1)) * GOLDEN
        z = (z ^ (z >> np.uint64(30))) * MIX1
        z = (z ^ (z >> np.uint64(27))) * MIX2
        z ^= z >> np.uint64(31)
    u = ((z >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
    return torch.from_numpy(-np.log(u)).float()


class Sampler:
    """Chooses the token at absolute position t from that position's logits [V], after the logit bias, the
    penalties of the tokens before it (`seen`, `counts`, and a verified path's tokens not yet counted) and the
    grammar `constraint`. `prompt`: the prompt's ids, which the repetition penalty counts as seen; `eos`: the ids
    that end an answer, which min_tokens holds back until position len(prompt) + min_tokens."""

    def __init__(
        self,
        params: SamplingParams,
        seed: int,
        prompt: list[int] = (),
        constraint: Constraint | None = None,
        eos: set[int] = frozenset(),
    ):
        self.params, self.seed, self.constraint = params, seed, constraint
        self.eos_ids, self.eos_until = torch.tensor(sorted(eos), dtype=torch.long), len(prompt) + params.min_tokens
        self.noise: dict[int, torch.Tensor] = {}  # whole-vocabulary noise of recent positions
        self.counts: dict[int, int] = {}  # how often each token was generated so far (with penalties only)
        self.seen: set[int] = set(prompt) if params.repetition_penalty != 1.0 else set()  # prompt and generated
        self.seen_ids = torch.tensor(sorted(self.seen), dtype=torch.long)  # `seen` as a tensor, kept in step
        self.out = torch.empty(0)  # `adjusted`'s result, reused: a fresh [V] buffer each pick costs page faults
        bias = params.logit_bias
        self.bias = (torch.tensor([t for t, _ in bias]), torch.tensor([b for _, b in bias])) if bias else None
        self.adjusts = params.penalized or self.bias is not None or constraint is not None  # (or min_tokens' span)

    def count(self, tokens: list[int]) -> None:
        """Tokens the generation took: later picks penalize them (and the grammar has read them)."""
        if self.constraint is not None:
            self.constraint.commit(tokens)
        if self.params.penalized:
            for t in tokens:
                self.counts[t] = self.counts.get(t, 0) + 1
            if self.params.repetition_penalty != 1.0 and not self.seen.issuperset(tokens):
                self.seen.update(tokens)
                self.seen_ids = torch.tensor(sorted(self.seen), dtype=torch.long)

    def pick(self, logits: torch.Tensor, position: int, after: list[int] | tuple = ()) -> int:
        """The token at `position`; `after`: tokens generated since the last `count` (a tree path being verified)."""
        if self.adjusts or position < self.eos_until:
            logits = self.adjusted(logits, position, after)
        if self.params.greedy:
            return argmax(logits)
        if not self.params.truncated:  # every token may win
            return argmax(probabilities(logits, self.params) / self.noise_at(position, logits.shape[-1]))
        ids, p = kept(logits, self.params)  # ascending: ties go to the lowest id, as a whole-vector argmax
        return int(ids[argmax(p / self.noise_of(position, ids))])

    def adjusted(self, logits: torch.Tensor, position: int, after: list[int] | tuple = ()) -> torch.Tensor:
        """The logits [V] a pick chooses from, float32, in this order: + logit_bias; the repetition
        penalty r on every token seen (prompt, counts, `after`): x / r where x > 0, else x · r (transformers');
        OpenAI's penalties: − (frequency_penalty · c[v] + presence_penalty) for each token v generated c[v] > 0
        times (counts, then `after`); −inf where the grammar forbids the token, and for end-of-sequence tokens
        before min_tokens (unless the grammar allows nothing else). In a buffer the next call reuses."""
        if self.out.shape != logits.shape:
            self.out = torch.empty_like(logits, dtype=torch.float32)
        p, out = self.params, self.out.copy_(logits)
        if self.bias is not None:
            out[self.bias[0]] += self.bias[1]
        if p.repetition_penalty != 1.0:
            new = sorted(set(after) - self.seen)
            ids = torch.cat([self.seen_ids, torch.tensor(new, dtype=torch.long)]) if new else self.seen_ids
            x = out[ids]
            out[ids] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            counts = dict(self.counts)
            for t in after:
                counts[t] = counts.get(t, 0) + 1
            if counts:
                ids = torch.tensor(list(counts))
                c = torch.tensor(list(counts.values()), dtype=torch.float32)
                out[ids] -= c * p.frequency_penalty + p.presence_penalty
        allowed = self.constraint.allowed(after) if self.constraint is not None else None
        if allowed is not None:
            out.masked_fill_(~allowed, float("-inf"))
        if position < self.eos_until and (allowed is None or int(allowed.sum()) > int(allowed[self.eos_ids].sum())):
            out[self.eos_ids] = float("-inf")  # held back, unless the grammar allows nothing else
        return out

    def noise_of(self, position: int, ids: torch.Tensor) -> torch.Tensor:
        """E of tokens `ids` at `position` [len(ids)]: the entries noise_at would give them."""
        return exp_noise(_mix(self.seed, position), ids.numpy())

    def noise_at(self, position: int, vocab: int) -> torch.Tensor:
        """E ~ Exp(1)^V of `position`, a pure function of (seed, position), cached for recent positions; drawn
        only for positions asked for (never for the prompt's), so it costs the same whatever the prompt length."""
        if position not in self.noise:
            self.noise[position] = exp_noise(_mix(self.seed, position), np.arange(vocab))
            for old in [p for p in self.noise if p < position - NOISE_KEPT]:
                del self.noise[old]
        return self.noise[position]
