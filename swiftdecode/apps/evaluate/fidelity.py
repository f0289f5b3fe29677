"""Teacher-forced scores of a forward over corpus windows: perplexity and, against a reference run, the KL
divergence per token and top-token agreement (what `llama-perplexity --kl-divergence` reports).

A window of ctx tokens is read causally from an empty cache and its second half scored: the logits at positions
ctx/2 .. ctx-2 against the tokens after them (llama-perplexity's rule, so both tools score the same tokens with
the same context). Log-probabilities are the float64 log-softmax of the forward's logits, kept as float32; the
metrics are computed from those in float64, so a forward compared with its own stored run scores KL 0 exactly.
A reference run is stored on disk (a float32 .npy of [ctx/2 - 1, V] per window) and reused by later candidates.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from swiftdecode.runtime.cache import SwiftCache

PERCENTILE = 99.0  # llama-perplexity's upper KLD percentile


def scored_logprobs(sm, window: list[int]) -> torch.Tensor:
    """Log-probabilities [len(window) // 2 - 1, V] float32 at the scored positions (`sm`: a model.SwiftModel),
    on a cache of their own."""
    first, cache = len(window) // 2, SwiftCache(sm.kv_layout().windows)
    sm.prefill(window[:first], cache)
    logits = sm.logits(sm.prefill(window[first:-1], cache))
    return torch.log_softmax(logits.double(), dim=-1).float()


def targets(window: list[int]) -> torch.Tensor:
    """The tokens the scored positions predict [len(window) // 2 - 1]."""
    return torch.tensor(window[len(window) // 2 + 1 :])


@dataclass
class Scores:
    """Per-token results over all windows scored so far (float64 numpy arrays, concatenated at summary)."""

    nll: list[np.ndarray] = field(default_factory=list)
    ref_nll: list[np.ndarray] = field(default_factory=list)
    kld: list[np.ndarray] = field(default_factory=list)
    same_top: list[np.ndarray] = field(default_factory=list)

    def add(self, logp: torch.Tensor, tgt: torch.Tensor, ref: torch.Tensor | None) -> None:
        lp = logp.double()
        self.nll.append(-lp.gather(1, tgt[:, None])[:, 0].numpy())
        if ref is None:
            return
        rp = ref.double()
        self.ref_nll.append(-rp.gather(1, tgt[:, None])[:, 0].numpy())
        self.kld.append((rp.exp() * (rp - lp)).sum(-1).clamp_min(0.0).numpy())  # >= 0 up to rounding
        self.same_top.append((lp.argmax(-1) == rp.argmax(-1)).numpy())

    def summary(self) -> dict:
        nll = np.concatenate(self.nll)
        out = {"tokens": int(len(nll)), "ppl": float(np.exp(nll.mean()))}
        if self.kld:
            kld, ref_nll = np.concatenate(self.kld), np.concatenate(self.ref_nll)
            out |= {
                "ref_ppl": float(np.exp(ref_nll.mean())),
                "ppl_ratio": float(np.exp(nll.mean() - ref_nll.mean())),
                "kld_mean": float(kld.mean()),
                f"kld_p{PERCENTILE:g}": float(np.percentile(kld, PERCENTILE)),
                "same_top": float(np.concatenate(self.same_top).mean()),
            }
        return out


class ReferenceStore:
    """A reference run's scored log-probabilities: `root`/windowNNNN.npy (float32), written once, read by any
    candidate evaluated on the same windows (the folder's name carries a digest of them)."""

    def __init__(self, cache_dir: Path, label: str, wins: list[list[int]]):
        digest = hashlib.sha256(json.dumps([label, wins]).encode()).hexdigest()[:16]
        self.root = Path(cache_dir) / "eval" / f"{''.join(c if c.isalnum() else '-' for c in label)}-{digest}"

    def path(self, i: int) -> Path:
        return self.root / f"window{i:04d}.npy"

    def get(self, i: int) -> torch.Tensor | None:
        p = self.path(i)
        return torch.from_numpy(np.load(p)) if p.is_file() else None

    def put(self, i: int, logp: torch.Tensor) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".window{i:04d}.{os.getpid()}.npy"
        np.save(tmp, logp.numpy())
        os.replace(tmp, self.path(i))  # whole files only: an interrupted run leaves no partial window

    def missing(self, n: int) -> list[int]:
        return [i for i in range(n) if not self.path(i).is_file()]


def fill(sm, wins: list[list[int]], store: ReferenceStore, progress: bool = True) -> None:
    """Compute and store the windows `store` lacks with `sm`, the reference forward."""
    for i in tqdm(store.missing(len(wins)), desc="reference", unit="window", disable=not progress):
        store.put(i, scored_logprobs(sm, wins[i]))


def evaluate(sm, wins: list[list[int]], store: ReferenceStore | None, progress: bool = True) -> dict:
    """Scores of forward `sm` over `wins` (against `store`'s reference when given) -> Scores.summary()."""
    scores = Scores()
    for i, w in enumerate(tqdm(wins, desc="scoring", unit="window", disable=not progress)):
        scores.add(scored_logprobs(sm, w), targets(w), store.get(i) if store else None)
    return scores.summary()
