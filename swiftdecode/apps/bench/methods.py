"""The benchmarked methods, what one timed generation returns (Outcome), and what every runner shares:
cutting at EOS and measuring peak memory."""

from __future__ import annotations

import resource
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from swiftdecode.apps.bench.llama_server import SPEC_TYPES

METHODS = {
    "hf": "HF model.generate, the baseline",
    "ar": "our autoregressive loop on our forward path",
    "swift": "our engine, best configuration",
    "swift-paper": "our engine in SWIFT's published configuration",
    "uniform": "static every-other-layer skip draft, no search",
    "suffix": "ablation: our engine, suffix copies only (context and pool; no layer-skip draft)",
    "ngram": "ablation: our engine, 2-3 token n-gram copies only (no layer-skip draft)",
    "skip-only": "ablation: our engine, layer-skip draft only (no copies)",
    "pld": "HF prompt lookup decoding (10 tokens)",
    "early-exit": "HF assisted generation, early exit at L/2",
    "draft-model": "HF assisted generation with --draft-model",
    "llama.cpp": "llama.cpp plain decoding on the same GGUF (peer; needs its binaries)",
    "llama.cpp-lookup": "llama.cpp n-gram lookup speculation on the same GGUF (peer; needs its binaries)",
    "llama-server": "llama.cpp's server, plain decoding, on the same GGUF (peer; needs its binaries)",
    **{
        f"llama-server-{t}": f"llama.cpp's server with --spec-type {t} (draft-free speculation; peer)"
        for t in SPEC_TYPES
    },
}
ENGINE_METHODS = ("ar", "swift", "swift-paper", "uniform", "suffix", "ngram", "skip-only")
PEER_METHODS = tuple(m for m in METHODS if m.startswith("llama"))
DEFAULT_METHODS = "hf,ar,swift,suffix,ngram,skip-only,swift-paper,uniform,pld,early-exit"


@dataclass
class Outcome:
    """One timed generation: `token_ids` are the new ids before the first EOS."""

    token_ids: list[int]
    wall_s: float
    prefill_s: float | None = None  # of wall_s, reading the prompt (to the first token); None: not measured
    rounds: int | None = None
    mean_accepted_tokens: float | None = None
    acceptance_rate: float | None = None
    optimize_s: float | None = None
    peak_rss_mb: float | None = None
    round_kinds: dict[str, int] | None = None  # our engine only: see GenerationStats
    round_seconds: dict[str, float] | None = None
    accepted_by_source: dict[str, int] | None = None
    cached_prompt_tokens: int = 0  # our engine: prompt tokens found in its prefix cache (not read)


Runner = Callable[[list[int], int], Outcome]  # (prompt ids, seed) -> outcome


def cut_at_eos(ids: list[int], eos: set[int]) -> list[int]:
    """`ids` up to, excluding, the first EOS."""
    return next((ids[:i] for i, t in enumerate(ids) if t in eos), ids)


def reset_peak_rss() -> None:
    """Restart the kernel's peak-RSS counter (Linux), so the next reading is the peak of one call."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_mb() -> float:
    """Peak resident set size since the last reset (process lifetime where reset is unsupported), MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
