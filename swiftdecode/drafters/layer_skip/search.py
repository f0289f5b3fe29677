"""On-the-fly layer-set optimisation: random local moves plus Bayesian optimisation over skip sets.

A skip set is scored by its matchness α (see `tuner.matchness`) on a window of the live context. SWIFT
maximises α at a fixed skip ratio; by default we maximise the expected speedup of drafting with it instead,
which lets the number of skipped sublayers float (small models are far less redundant than 13B-70B ones).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from swiftdecode.base.config import SearchConfig
from swiftdecode.drafters.budget import ema
from swiftdecode.runtime.skip import SkipSet

ADOPT_MARGIN = 1.005  # a candidate replaces the best set only if it scores 0.5% higher on the same window (noise)
ACCEPT_KEEP = 0.9  # EMA factor of accepted tokens per round: ~10 rounds of memory, so one bad round is no new task


@dataclass(frozen=True)
class DraftCost:
    """A draft forward's cost as shares of a full one-token forward: `fixed` (embeddings, draft head, first/last
    attention, per-forward overhead), `attn[i]` / `mlp[i]` for inner layers 1..L−2, `mlp_edge` (first/last MLP,
    never skipped), and per sparsity level the fraction of MLP weight bytes a sparse draft still reads
    (`read[0] == 1`). Calling it gives the cost of a SkipSet."""

    fixed: float
    attn: np.ndarray
    mlp: np.ndarray
    mlp_edge: float
    read: tuple[float, ...] = (1.0,)

    def __call__(self, skip: SkipSet) -> float:
        keep_attn = np.array([i + 1 not in skip.attn for i in range(len(self.attn))])
        keep_mlp = np.array([i + 1 not in skip.mlp for i in range(len(self.mlp))])
        mlp = self.mlp_edge + float(self.mlp @ keep_mlp)
        return float(self.fixed + self.attn @ keep_attn + self.read[skip.sparsity] * mlp)


def expected_speedup(alpha: float, cost: float, verify_cost: float, max_depth: int) -> float:
    """Best over chain depths γ of E[tokens per round] / (γ·draft cost + verify cost), in 1-token forwards."""
    alpha = min(alpha, 0.999)
    return max((1 - alpha ** (g + 1)) / (1 - alpha) / (g * cost + verify_cost) for g in range(1, max_depth + 1))


class LayerSearch:
    """Search state that lives across requests: candidates tried, the best set, and whether to keep searching."""

    def __init__(self, n_layers: int, cost: DraftCost, cfg: SearchConfig, init: SkipSet, seed: int = 0):
        self.n_layers, self.cost, self.cfg = n_layers, cost, cfg
        self.rng = np.random.default_rng(seed)
        self.best, self.best_score, self.best_alpha = init, -1.0, 0.0
        self.X: list[np.ndarray] = []
        self.y: list[float] = []
        self.evals = self.stale = 0
        self.searching = True
        self.accept_level: float | None = None
        self.accept_ema: float | None = None

    @property
    def state(self) -> str:
        return "searching" if self.searching else "converged"

    def score(self, skip: SkipSet, alpha: float) -> float:
        if self.cfg.fixed_ratio is not None:
            return alpha
        return expected_speedup(alpha, self.cost(skip), self.cfg.verify_cost, self.cfg.max_depth)

    def propose(self) -> SkipSet:
        """Next candidate: the initial set first, then a GP-UCB pick every beta-th time, else a local move."""
        if self.evals == 0:
            return self.best
        if self.evals % self.cfg.beta == 0 and len(self.y) >= 8:
            return SkipSet.from_vector(self._ucb_pick())
        return SkipSet.from_vector(self._local_move(self.best.to_vector(self.n_layers)))

    def challenges(self, skip: SkipSet, alpha: float) -> bool:
        """Whether candidate `skip`, with matchness `alpha` on some window, would replace the best set: then the
        best set must be scored on that same window before it is replaced (`record(..., incumbent=...)`)."""
        return skip != self.best and (self.best_score < 0 or self.score(skip, alpha) > self.best_score * ADOPT_MARGIN)

    def record(self, skip: SkipSet, alpha: float, incumbent: float | None = None) -> None:
        """Register candidate `skip` with matchness `alpha`; `incumbent`: the best set's matchness on the same
        window (needed whenever `challenges` says so). Updates the best set and the stopping state."""
        s = self.score(skip, alpha)
        self.X.append(skip.to_vector(self.n_layers))
        self.y.append(s)
        self.evals += 1
        if incumbent is not None and skip != self.best:
            self._remeasure(self.score(self.best, incumbent), incumbent)
            if s > self.score(self.best, incumbent) * ADOPT_MARGIN:  # better on the very same window
                self.best, self.best_score, self.best_alpha, self.stale = skip, s, alpha, 0
                return
        elif skip == self.best:  # (re-)measured on a new window: average out the noise
            self._remeasure(s, alpha)
        self.stale += 1
        done = self.best_alpha >= self.cfg.target_matchness or self.stale >= self.cfg.patience
        if done or self.evals >= self.cfg.max_evals:
            self.searching, self.accept_level, self.accept_ema = False, None, None

    def _remeasure(self, s: float, alpha: float) -> None:
        first = self.best_score < 0
        self.best_score = s if first else 0.5 * (self.best_score + s)
        self.best_alpha = alpha if first else 0.5 * (self.best_alpha + alpha)

    def observe_acceptance(self, accepted: float) -> None:
        """Track accepted tokens per round after convergence; a clear drop (a new task) restarts the search."""
        if self.searching:
            return
        self.accept_ema = ema(self.accept_ema, accepted, ACCEPT_KEEP)
        if self.accept_level is None or self.accept_ema > self.accept_level:
            self.accept_level = self.accept_ema
        elif self.accept_ema < self.cfg.restart_drop * self.accept_level:
            self.searching, self.stale, self.evals = True, 0, 1
            self.X, self.y, self.best_score = [], [], -1.0

    def _local_move(self, v: np.ndarray) -> np.ndarray:
        """Flip 1-3 skip bits, or (one time in three) step the sparsity level by one; SWIFT-style fixed ratio:
        swap a skipped and a kept sublayer instead."""
        v = v.copy()
        levels = len(self.cost.read)
        if self.cfg.fixed_ratio is None and levels > 1 and self.rng.random() < 1 / 3:
            v[-1] = np.clip(v[-1] + self.rng.choice((-1, 1)), 0, levels - 1)
            return v
        bits = v[:-1]  # a view: moves below edit v
        on, off = np.flatnonzero(bits > 0.5), np.flatnonzero(bits < 0.5)
        if self.cfg.fixed_ratio is not None:
            if self.evals < self.cfg.beta:  # explore: fresh random sets of the fixed size
                bits[:] = 0
                bits[self.rng.choice(len(bits), size=len(on), replace=False)] = 1
            elif len(on) and len(off):
                bits[self.rng.choice(on)], bits[self.rng.choice(off)] = 0, 1
            return v
        for i in self.rng.choice(len(bits), size=int(self.rng.integers(1, 4)), replace=False):
            bits[i] = 1 - bits[i]
        return v

    def _ucb_pick(self) -> np.ndarray:
        """Fit a GP to (set, score) pairs and return the pool candidate with the highest upper confidence bound."""
        from sklearn.exceptions import ConvergenceWarning
        from sklearn.gaussian_process import GaussianProcessRegressor
        from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

        X, y = np.array(self.X), np.array(self.y)
        with warnings.catch_warnings():  # hyperparameters at their bounds on tiny, noisy data: expected
            warnings.simplefilter("ignore", ConvergenceWarning)
            gp = GaussianProcessRegressor(
                ConstantKernel(1.0) * RBF(length_scale=4.0) + WhiteKernel(1e-3, noise_level_bounds=(1e-9, 1.0)),
                normalize_y=True,
                random_state=0,
            ).fit(X, y)
        seeds = X[np.argsort(y)[-5:]]
        pool = np.array([self._local_move(seeds[i % len(seeds)]) for i in range(256)])
        mean, std = gp.predict(pool, return_std=True)
        return pool[int(np.argmax(mean + self.cfg.kappa * std))]
