"""The engine's settings: the decoding methods, the kinds of round, the draft's, the search's and the engine's
configuration, and each method's preset. Torch-free, like `params`, so apps can name methods cheaply."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from swiftdecode.base.errors import UserError

# CPU paths of the fast kernels (fastpath.accelerate): "auto" picks the best this CPU runs (else torch), "skinny"
# insists on a kernel, "skinny-<isa>" runs that ISA's build of every kernel, the quantized ones included.
FAST_PATHS = ("auto", "torch", "skinny", "skinny-avx512", "skinny-amx", "skinny-avxvnni", "skinny-avx2")
FAST_PATH_HELP = (
    "CPU kernel path: auto (default), torch, skinny, skinny-avx512, skinny-amx (AVX-512 with AMX tiles), "
    "skinny-avxvnni or skinny-avx2 (that ISA's build)"
)
# Values per int8 scale of the activations the quantized products read (kernels/csrc/qgemm.cpp): 32, like
# llama.cpp's Q8_0, or 256, like its Q8_K (one multiply per row and 32-block fewer). 32 is the default by
# measurement: mean KL divergence from float32 4.0-4.9x lower (Qwen2.5-Coder-0.5B/1.5B, news and code; 256 is
# at llama.cpp's on K-quant weights), for products no measurably slower on AMD Zen 4 (docs/performance.md).
ACT_BLOCKS = (32, 256)
ACT_DEFAULT = 32
ACT_HELP = (
    "values per int8 activation scale on GGUF weights: 32 (default, like llama.cpp's Q8_0; closest to float32) "
    "or 256 (like its Q8_K)"
)


def check_act_block(act_block: int) -> None:
    """UserError unless `act_block` is one of ACT_BLOCKS."""
    if act_block not in ACT_BLOCKS:
        raise UserError(f"activations are quantized per {' or '.join(map(str, ACT_BLOCKS))} values, not {act_block}")


def isa_of(fast_path: str) -> str | None:
    """The kernel ISA a fast path names ("skinny-avx2" -> "avx2"), or None (the best this CPU runs)."""
    return fast_path.removeprefix("skinny-") if fast_path.startswith("skinny-") else None


# KV entries of finished sequences `serve` and `chat` keep for later prompts with the same beginning (a system
# prompt, earlier turns): ~45k tokens of SmolLM2-135M in fp16, ~85k of Qwen2.5-0.5B.
PREFIX_CACHE_GB = 1.0
# decoding methods of the engine (see `preset`); "suffix", "ngram" and "skip-only" are ablations of "swift"
METHODS = ("swift", "swift-paper", "uniform", "suffix", "ngram", "skip-only", "ar")
# Kinds of decoding round: a drafter's kind (drafters.registry) or "plain", in the order the engine asks them:
# "suffix" / "ngram" = a copying drafter's copy alone (no draft forward); "draft" = the layer-skip drafter's tree
# with the copy as one more branch, verified in one forward; "plain" = one token, as plain decoding.
MODES = ("suffix", "ngram", "draft", "plain")
# where accepted draft tokens came from (GenerationStats.accepted_by_source); "both": several drafters
SOURCES = ("skip", "suffix", "ngram", "both")
# The suffix drafter's pool of finished sequences, per tenant: 64k tokens (256 KB), searched in 0.1-0.3 ms a round.
COPY_POOL_TOKENS = 65536
# After a copy round, the next 2 rounds that copy nothing are plain steps: the copy ran out where the answer departs
# from the text it copies (an edit, a new name), and a token or two later it matches again, so a layer-skip draft
# there costs several plain steps for tokens copying soon gives. Measured (docs/performance.md): `swift` /
# `suffix` in decoding alone 0.93 -> 0.98 on code editing, 0.91 -> 0.98 restating, open-ended work unchanged.
RESYNC_ROUNDS = 2

# SWIFT's mapping from the draft's top-1 probability to the number of candidates at a depth:
# the more confident the draft, the fewer siblings it needs.
GREEDY_TOPK = ((0.95, 3), (0.8, 5), (0.5, 8), (0.0, 10))
SAMPLING_TOPK = ((0.95, 1), (0.8, 3), (0.5, 5), (0.0, 10))
# On a CPU every verified token costs: fewer siblings, and the cheapest ones are chosen by acceptance odds.
COMPACT_TOPK = ((0.95, 1), (0.8, 2), (0.5, 3), (0.0, 4))


@dataclass(frozen=True)
class DraftConfig:
    max_depth: int = 8  # draft forwards per round at most
    epsilon: float = 0.8  # stop drafting once the draft's top-1 probability falls below this
    max_nodes: int = 24  # tree nodes at most; skip-draft nodes are kept best first by estimated acceptance
    topk: tuple[tuple[float, int], ...] = GREEDY_TOPK  # candidates per depth, greedy decoding
    sampling_topk: tuple[tuple[float, int], ...] = SAMPLING_TOPK  # ... when sampling
    copy: int = 0  # longest chain a copying drafter proposes (the row-cost planner verifies what pays; 0 = off)


@dataclass(frozen=True)
class SearchConfig:
    beta: int = 25  # every beta-th candidate comes from a Bayesian-optimisation (GP-UCB) step
    target_matchness: float = 0.93  # stop once the best set matches this often
    patience: int = 60  # ... or after this many candidates without improvement
    max_evals: int = 400  # ... or after this many candidates
    fixed_ratio: float | None = None  # SWIFT's fixed skip ratio (0.45); None = free size, maximise speedup
    kappa: float = 2.0  # UCB exploration weight
    restart_drop: float = 0.7  # search again when acceptance falls below this fraction of its converged level
    verify_cost: float = 1.15  # cost of a verification forward relative to a 1-token full forward
    max_depth: int = 8
    max_overhead: float = 0.03  # search only while its time stays below this share of decoding time


@dataclass(frozen=True)
class EngineConfig:
    draft: DraftConfig = DraftConfig()
    search: SearchConfig | None = SearchConfig()  # None: keep the initial skip set
    init: str = "cosine"  # initial skip set: "cosine" (prefill collinearity) or "uniform"
    init_ratio: float = 0.3  # fraction of inner sublayers skipped initially
    window: int = 32  # matchness window (tokens)
    draft_vocab: int = 0  # score drafts over this many likely tokens only (0 = the whole vocabulary)
    sparsity: int = 0  # initial activation-sparsity level of the draft's MLPs (fastpath.SPARSITY_LEVELS)
    adaptive: bool = True  # choose each round's kind by measured speed; False: always draft with the skip model
    modes: tuple[str, ...] = ("suffix", "draft", "plain")  # round kinds the engine may use (ablations: fewer)
    copy_pool: int = COPY_POOL_TOKENS  # tokens of finished sequences the suffix drafter may copy from (0 = off)
    resync: int = RESYNC_ROUNDS  # after a copy round, rounds that copy nothing are plain steps this many times


# `swift`: compact trees, since on a CPU every verified token costs: stop drafting below 50% confidence, 8 tree
# nodes in all, fewer siblings per depth (COMPACT_TOPK), a copied branch of up to 8 tokens. Measured when
# adopted: 1.01-1.04x `ar` at one thread, against 0.76-0.93x with SWIFT's wider trees.
SWIFT_DRAFT = DraftConfig(epsilon=0.5, max_nodes=8, topk=COMPACT_TOPK, sampling_topk=COMPACT_TOPK, copy=8)
# A copy round's chain at most: long copies pay where they keep being accepted (an edited function, a quoted
# source), and the row-cost planner verifies only as much of a chain as its measured acceptance pays for.
SWIFT_COPY = 32
# The draft head scores only the 16384 tokens most seen so far (the registry models have 49k-262k): a fraction of
# a full head's cost, while verification still scores the whole vocabulary.
SWIFT_DRAFT_VOCAB = 16384
# Small models are far less redundant than SWIFT's 13B-70B ones: start from 10% of the inner sublayers skipped
# and let the search size the set.
SWIFT_INIT_RATIO = 0.1
# Level 3 (40% of gate-up / 60% of down inputs zeroed): on Qwen2.5-Coder-0.5B a draft at 0.58 of a full forward
# (dense: 0.81) that still matches 88% of next tokens; the search moves the level from there.
SWIFT_SPARSITY = 3

# SWIFT's released defaults (hemingkx/SWIFT): up to 1000 optimisation steps, stop after 300 without improvement,
# one step per decoding step (opt_interval=1) for as long as the optimisation phase lasts.
PAPER_SEARCH = {"max_evals": 1000, "patience": 300, "max_overhead": math.inf}
PAPER_RATIO = 0.45  # SWIFT's published skip ratio: 45% of the sublayers, fixed
PAPER_NODES = 64  # swift-paper's tree budget: SWIFT's wide trees (top-k siblings at every depth), capped at 64
UNIFORM_RATIO = 0.5  # the static baseline: attention and MLP of every other inner layer skipped, no search


def preset(method: str) -> EngineConfig:
    """Configuration of each method: ours, SWIFT's published one, a static uniform draft."""
    if method == "swift":
        draft = replace(SWIFT_DRAFT, copy=SWIFT_COPY)
        return EngineConfig(draft, draft_vocab=SWIFT_DRAFT_VOCAB, init_ratio=SWIFT_INIT_RATIO, sparsity=SWIFT_SPARSITY)
    if method in ("suffix", "ngram"):  # ablations: swift's copy rounds alone; "ngram": the 2-3 token copy of v0.x
        only = replace(preset("swift"), search=None, draft_vocab=0, sparsity=0, modes=(method, "plain"))
        return only if method == "suffix" else replace(only, draft=SWIFT_DRAFT)
    if method == "skip-only":  # ablation: swift without the copied branch
        swift = preset("swift")
        return replace(swift, draft=replace(swift.draft, copy=0), modes=("draft", "plain"))
    if method == "swift-paper":  # SWIFT's optimisation phase: a search step every round, no overhead cap
        paper = SearchConfig(fixed_ratio=PAPER_RATIO, restart_drop=0.0, **PAPER_SEARCH)  # the paper never restarts
        draft = DraftConfig(max_nodes=PAPER_NODES)
        return EngineConfig(draft, paper, init="uniform", init_ratio=PAPER_RATIO, adaptive=False)
    if method == "uniform":
        return EngineConfig(search=None, init="uniform", init_ratio=UNIFORM_RATIO, adaptive=False)
    raise UserError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
