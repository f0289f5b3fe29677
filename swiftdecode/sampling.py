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

from swiftdecode.params import SamplingParams


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [..., V] after temperature, then top-k, then top-p (smallest set with mass ≥ top_p)."""
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order, before = _top_mass(probs, params.top_p)
        kept = sorted_p.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, kept)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


NUCLEUS_FIRST = 256  # tokens sorted first when looking for the top-p set; doubled until it holds the set


def _top_mass(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The k largest probabilities [..., k], descending, their ids and the mass before each, for the first k
    whose last entry is already outside the top-p set (mass before it ≥ top_p) in every row: so the set, the
    smallest prefix reaching top_p, lies within them, as a full sort would give it. topk instead of a sort: a
    full sort of a 152k vocabulary took ~12 ms a row."""
    k = min(NUCLEUS_FIRST, probs.shape[-1])
    while True:
        top, order = torch.topk(probs, k, dim=-1)
        before = top.cumsum(-1) - top
        if k == probs.shape[-1] or bool((before[..., -1] >= top_p).all()):
            return top, order, before
        k = min(2 * k, probs.shape[-1])


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
    """Chooses the token at absolute position t from that position's logits [V]."""

    def __init__(self, params: SamplingParams, seed: int):
        self.params = params
        self.seed = seed
        self.noise: dict[int, torch.Tensor] = {}  # whole-vocabulary noise of recent positions

    def pick(self, logits: torch.Tensor, position: int) -> int:
        if self.params.greedy:
            return argmax(logits)
        probs = probabilities(logits, self.params)
        if self.params.top_p == 1.0 and self.params.top_k == 0:  # every token may win
            return argmax(probs / self.noise_at(position, logits.shape[-1]))
        ids = torch.nonzero(probs).flatten()  # ascending: ties go to the lowest id, as a whole-vector argmax
        return int(ids[argmax(probs[ids] / self.noise_of(position, ids))])

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
