"""GGUF files of published model shapes with random weights: speed work on a model's real sizes without its download.

`SHAPES` holds the shapes (the published models' config.json numbers, and tiny test shapes, one per architecture).
`write` lays out a file as llama.cpp's tools would: the architecture's metadata keys and tensor names (as
convert_hf_to_gguf.py writes them), the block types of llama.cpp's quantization recipe (`tensor_plan`), and the
tokenizer of another GGUF file, padded to the shape's vocab. Each quantized block's fp16 scales are set so the
dequantized weights have an RMS of `WEIGHT_RMS`; every other byte is random. Files say what they are:
`general.name` ends in "(random weights)" and `swiftdecode.random_weights` is true.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGML_QUANT_VERSION,
    MODEL_ARCH_NAMES,
    MODEL_TENSOR,
    MODEL_TENSORS,
    TENSOR_NAMES,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
    LlamaFileType,
    RopeScalingType,
    TokenType,
)
from gguf import MODEL_TENSOR as T
from gguf import GGMLQuantizationType as Q
from tqdm import tqdm

from swiftdecode.base.errors import UserError


@dataclass(frozen=True)
class Shape:
    """A decoder's hyperparameters as its config.json gives them. `vocab` None: the tokenizer file's own size."""

    arch: str  # GGUF general.architecture
    n_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int | None
    context: int
    rope_theta: float
    rms_eps: float
    tied: bool  # the output projection is the token embedding
    llama3_rope: tuple[float, float, float, int] | None = None  # (factor, low_freq, high_freq, original context)
    sliding_window: int = 0  # gemma: local-attention window; phi3: its config's sliding_window (0: none)
    sliding_pattern: int = 0  # gemma: every Nth layer attends globally (llama.cpp fixes it: 2, gemma3 6; no key)
    rope_dims: int = 0  # phi3 partial rotary: dimensions rotated per head (0: all of head_dim)
    longrope_context: int = 0  # phi3 LongRoPE: original context length (0: no LongRoPE)
    rope_linear: float = 0  # gemma3 4B and up: the global layers' linear rotary scaling factor (0: none)


L32 = (32.0, 1.0, 4.0, 8192)  # Llama-3.2 rope_scaling: factor, low_freq_factor, high_freq_factor, original context
L31 = (8.0, 1.0, 4.0, 8192)  # Llama-3.1
# Positional fields: arch, layers, hidden, heads, kv heads, head_dim, intermediate, vocab, context, rope theta, rms eps,
# tied, llama3 rope, sliding window, sliding pattern, rope dims, LongRoPE context, linear rope factor.
SHAPES = {
    # huggingface.co/Qwen/Qwen3-{0.6B,1.7B,4B,8B}/config.json
    "qwen3-0.6b": Shape("qwen3", 28, 1024, 16, 8, 128, 3072, 151936, 40960, 1e6, 1e-6, True),
    "qwen3-1.7b": Shape("qwen3", 28, 2048, 16, 8, 128, 6144, 151936, 40960, 1e6, 1e-6, True),
    "qwen3-4b": Shape("qwen3", 36, 2560, 32, 8, 128, 9728, 151936, 40960, 1e6, 1e-6, True),
    "qwen3-8b": Shape("qwen3", 36, 4096, 32, 8, 128, 12288, 151936, 40960, 1e6, 1e-6, False),
    # meta-llama/Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B config.json
    "llama-3.2-1b": Shape("llama", 16, 2048, 32, 8, 64, 8192, 128256, 131072, 5e5, 1e-5, True, L32),
    "llama-3.2-3b": Shape("llama", 28, 3072, 24, 8, 128, 8192, 128256, 131072, 5e5, 1e-5, True, L32),
    "llama-3.1-8b": Shape("llama", 32, 4096, 32, 8, 128, 14336, 128256, 131072, 5e5, 1e-5, False, L31),
    # Qwen/Qwen2.5-7B-Instruct config.json (the base model's context is 131072)
    "qwen2.5-7b": Shape("qwen2", 28, 3584, 28, 4, 128, 18944, 152064, 32768, 1e6, 1e-6, False),
    # microsoft/Phi-4-mini-instruct config.json: partial_rotary_factor 0.75 (96 of 128 dims), LongRoPE from 4096
    "phi-4-mini": Shape("phi3", 32, 3072, 24, 8, 128, 8192, 200064, 131072, 1e4, 1e-5, True, None, 262144, 0, 96, 4096),
    # HuggingFaceTB/SmolLM3-3B config.json: Llama anatomy, every 4th layer without rotary (llama.cpp fixes the step)
    "smollm3-3b": Shape("smollm3", 36, 2048, 16, 4, 128, 11008, 128256, 65536, 5e6, 1e-6, True),
    # google/gemma-3-1b-it, google/gemma-3-4b-it (its text_config), google/gemma-2-2b-it config.json
    "gemma-3-1b": Shape("gemma3", 26, 1152, 4, 1, 256, 6912, 262144, 32768, 1e6, 1e-6, True, None, 512, 6),
    "gemma-3-4b": Shape(
        "gemma3", 34, 2560, 8, 4, 256, 10240, 262208, 131072, 1e6, 1e-6, True, None, 1024, 6, rope_linear=8
    ),
    "gemma-2-2b": Shape("gemma2", 26, 2304, 8, 4, 256, 9216, 256000, 8192, 1e4, 1e-6, True, None, 4096, 2),
    # Tiny test shapes: 6 layers (layer-skip drafts need some), widths multiples of 256 (every K-quant block fits),
    # grouped-query attention; tiny-phi3 as Phi-4-mini (partial rotary, LongRoPE, tied) with Phi-3-mini's sliding
    # window on every layer. tiny-qwen3 keeps head_dim 128 (as all dense Qwen3): transformers reads no head_dim
    # from a qwen3 GGUF and assumes 128. The windows are 16 tokens, so a test's 40-token context reaches past them;
    # tiny-gemma3's global layers scale their rotary linearly as Gemma 3 4B and up do.
    "tiny-qwen3": Shape("qwen3", 6, 256, 4, 2, 128, 512, None, 4096, 1e6, 1e-6, True),
    "tiny-llama3": Shape("llama", 6, 256, 4, 2, 64, 512, None, 4096, 5e5, 1e-5, True, L32),
    "tiny-qwen2": Shape("qwen2", 6, 256, 4, 2, 64, 512, None, 4096, 1e6, 1e-6, False),
    "tiny-phi3": Shape("phi3", 6, 256, 4, 2, 64, 512, None, 16384, 1e4, 1e-5, True, None, 16, 0, 48, 4096),
    "tiny-smollm3": Shape("smollm3", 6, 256, 4, 2, 64, 512, None, 4096, 5e6, 1e-6, True),
    "tiny-gemma3": Shape("gemma3", 6, 256, 4, 2, 64, 512, None, 4096, 1e6, 1e-6, True, None, 16, 6, rope_linear=8),
    "tiny-gemma2": Shape("gemma2", 6, 256, 4, 2, 64, 512, None, 4096, 1e4, 1e-6, True, None, 16, 2),
}
GEMMAS = ("gemma2", "gemma3")
ARCHES = {n: a for a, n in MODEL_ARCH_NAMES.items() if n in ("qwen3", "llama", "qwen2", "phi3", "smollm3", *GEMMAS)}
# every Nth layer attends globally: llama.cpp's loaders and transformers' configs fix it per architecture
GEMMA_PATTERNS = {"gemma2": 2, "gemma3": 6}
GEMMA2_SOFTCAPS = (50.0, 30.0)  # attention and final logit caps of every published Gemma 2 (config.json)

# --format -> (llama.cpp's default block type for it, general.file_type)
FORMATS = {
    "q4_k_m": (Q.Q4_K, LlamaFileType.MOSTLY_Q4_K_M),
    "q8_0": (Q.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (Q.Q4_0, LlamaFileType.MOSTLY_Q4_0),
}
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}  # llama.cpp's types for rows that 256-element blocks do not divide
WEIGHT_RMS = 0.02  # dequantized weights' RMS, as a trained model's init: a forward stays finite through 30+ layers
NORM_NOISE = 0.02  # norm weights are 1 + N(0, NORM_NOISE) (gemma's GGUF stores its norms with the +1 folded in)
BIAS_RMS = 0.02  # qwen2's attention biases: N(0, BIAS_RMS)
PAD_SCORE = -1000.0  # score llama.cpp's converter gives added tokens, for tokenizers that carry scores
# Size estimates: tokenizer metadata per vocab entry (token string, type, merge: 1.77 MB for smollm2's 49152), the rest
TOKENIZER_BYTES_PER_TOKEN = 36
METADATA_BYTES = 8192
DEFAULT_VOCAB = 49152  # smollm2-135m's tokenizer, the CLI's default --tokenizer-from: tiny shapes' vocab in estimates


@dataclass(frozen=True)
class Layout:
    """Where a block type keeps its fp16 scales; `unit_rms`: RMS of its dequantized weights for scale 1, the other
    bytes uniformly random. `ratios`: each scale relative to the first."""

    offsets: tuple[int, ...]
    ratios: tuple[float, ...]
    unit_rms: float


LAYOUTS = {
    Q.Q4_0: Layout((0,), (1.0,), math.sqrt(21.5)),  # d * (q - 8), q 4-bit: E[(q-8)^2] = 21.5
    Q.Q5_0: Layout((0,), (1.0,), math.sqrt(85.5)),  # d * (q - 16), q 5-bit
    Q.Q8_0: Layout((0,), (1.0,), math.sqrt(5461.5)),  # d * q, q int8
    # d * sc * q - dmin * m with 6-bit sc, m and 4-bit q; dmin = 7.5 d centres the weights on 0
    Q.Q4_K: Layout((0, 2), (1.0, 7.5), math.sqrt(66727.5)),
    Q.Q6_K: Layout((208,), (1.0,), math.sqrt(5461.5 * 341.5)),  # d * sc * (q - 32), sc int8, q 6-bit; d last
}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a file: `shape` in numpy order ((rows, columns) or (n,); GGUF lists it reversed)."""

    name: str
    kind: MODEL_TENSOR
    shape: tuple[int, ...]
    qtype: Q

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * size


def resolve(shape: str | Shape) -> tuple[str, Shape]:
    """(name, Shape) of a shape name in `SHAPES` or a Shape; UserError naming the known shapes otherwise."""
    if isinstance(shape, Shape):
        return f"{shape.arch}-custom", shape
    if shape not in SHAPES:
        raise UserError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    return shape, SHAPES[shape]


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's rule for the layers whose attn_v and ffn_down Q4_K_M stores as Q6_K (llama-quant.cpp)."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def block_type(s: Shape, kind: MODEL_TENSOR, shape: tuple[int, ...], fmt: str, layer: int) -> Q:
    """The block type llama.cpp's `llama_tensor_get_type` gives a tensor (norms and 1-D tensors stay F32)."""
    if len(shape) == 1:
        return Q.F32
    base, cols = FORMATS[fmt][0], shape[1]
    if kind == T.OUTPUT or (s.tied and kind == T.TOKEN_EMBD):  # the output projection: Q6_K unless Q8_0 anyway
        return Q.Q8_0 if cols % GGML_QUANT_SIZES[base][0] or base == Q.Q8_0 else Q.Q6_K
    qtype = base
    if fmt == "q4_k_m" and kind in (T.ATTN_V, T.ATTN_QKV, T.FFN_DOWN) and use_more_bits(layer, s.n_layers):
        qtype = Q.Q6_K
    return FALLBACK[qtype] if cols % GGML_QUANT_SIZES[qtype][0] else qtype


def _layer(s: Shape) -> list[tuple[MODEL_TENSOR, tuple[int, ...], str]]:
    """(kind, numpy shape, suffix) of one block's tensors, in llama.cpp's names for the architecture."""
    h, f, q, kv = s.hidden, s.intermediate, s.heads * s.head_dim, s.kv_heads * s.head_dim
    attn = [(T.ATTN_Q, (q, h)), (T.ATTN_K, (kv, h)), (T.ATTN_V, (kv, h))]
    ffn = [(T.FFN_GATE, (f, h)), (T.FFN_UP, (f, h))]
    if s.arch == "phi3":  # fused q/k/v rows, and gate stacked on up
        attn, ffn = [(T.ATTN_QKV, (q + 2 * kv, h))], [(T.FFN_UP, (2 * f, h))]
    qk_norms = [(T.ATTN_Q_NORM, (s.head_dim,)), (T.ATTN_K_NORM, (s.head_dim,))]
    qk_norms = qk_norms if s.arch in ("qwen3", "gemma3") else []
    post_attn = [(T.ATTN_POST_NORM, (h,))] if s.arch in GEMMAS else []
    post_ffn = [(T.FFN_POST_NORM, (h,))] if s.arch in GEMMAS else []
    rows = [(T.ATTN_NORM, (h,)), *attn, *qk_norms, (T.ATTN_OUT, (h, q)), *post_attn, (T.FFN_NORM, (h,)), *ffn]
    out = [(kind, dims, "weight") for kind, dims in [*rows, (T.FFN_DOWN, (h, f)), *post_ffn]]
    if s.arch == "qwen2":  # qwen2's q/k/v projections carry biases
        out += [(T.ATTN_Q, (q,), "bias"), (T.ATTN_K, (kv,), "bias"), (T.ATTN_V, (kv,), "bias")]
    return out


def _globals(s: Shape, vocab: int) -> list[tuple[MODEL_TENSOR, tuple[int, ...]]]:
    """The tensors outside the blocks (the rope tables llama.cpp's converter adds: llama3's, phi3's LongRoPE)."""
    out = [(T.OUTPUT_NORM, (s.hidden,))] + ([] if s.tied else [(T.OUTPUT, (vocab, s.hidden))])
    if s.llama3_rope:
        out.append((T.ROPE_FREQS, (s.head_dim // 2,)))
    if s.longrope_context:
        half = (s.rope_dims or s.head_dim) // 2
        out += [(T.ROPE_FACTORS_LONG, (half,)), (T.ROPE_FACTORS_SHORT, (half,))]
    return out


def tensor_plan(s: Shape, fmt: str, vocab: int) -> list[TensorSpec]:
    """Every tensor of the file in writing order, with its block type; ValueError on a name the arch lacks."""
    named = [(T.TOKEN_EMBD, (vocab, s.hidden), "weight", -1)]
    named += [(kind, dims, suffix, i) for i in range(s.n_layers) for kind, dims, suffix in _layer(s)]
    named += [(kind, dims, "weight", -1) for kind, dims in _globals(s, vocab)]
    known = {TENSOR_NAMES[kind] for kind in MODEL_TENSORS[ARCHES[s.arch]]}
    out = []
    for kind, dims, suffix, layer in named:
        if TENSOR_NAMES[kind] not in known:
            raise ValueError(f"{s.arch} has no tensor {TENSOR_NAMES[kind]}")
        name = f"{TENSOR_NAMES[kind].format(bid=layer)}.{suffix}"
        qtype = block_type(s, kind, dims, fmt, layer) if suffix == "weight" else Q.F32
        out.append(TensorSpec(name, kind, dims, qtype))
    return out


def param_count(s: Shape, vocab: int | None = None) -> int:
    """Parameters of the shape (the tied embedding counted once)."""
    return sum(math.prod(t.shape) for t in tensor_plan(s, "q8_0", vocab or s.vocab or DEFAULT_VOCAB))


def estimate_size(s: Shape, fmt: str, vocab: int | None = None) -> int:
    """Bytes of the file `write` makes: tensor data and infos exact, metadata estimated from the vocab size."""
    vocab = vocab or s.vocab or DEFAULT_VOCAB
    plan = tensor_plan(s, fmt, vocab)
    data = sum(GGUFWriter.ggml_pad(t.nbytes, 32) for t in plan)
    infos = sum(len(t.name) + 8 + 4 + 8 * len(t.shape) + 4 + 8 for t in plan)  # name, dims, type, offset
    return METADATA_BYTES + TOKENIZER_BYTES_PER_TOKEN * vocab + infos + data


def random_blocks(rng: np.random.Generator, qtype: Q, n_elements: int) -> np.ndarray:
    """[n_blocks, block bytes] uint8: random bytes, each fp16 scale set so the weights' RMS is `WEIGHT_RMS`."""
    block, size = GGML_QUANT_SIZES[qtype]
    n = n_elements // block * size
    data = rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n].reshape(-1, size)
    layout = LAYOUTS[qtype]
    for offset, ratio in zip(layout.offsets, layout.ratios, strict=True):
        data[:, offset : offset + 2] = np.array([WEIGHT_RMS / layout.unit_rms * ratio], np.float16).view(np.uint8)
    return data


def _llama3_factors(s: Shape) -> np.ndarray:
    """[head_dim / 2] llama3 rope frequency divisors, as convert_hf_to_gguf.py computes `rope_freqs`."""
    factor, low, high, original = s.llama3_rope
    wavelen = 2 * math.pi * s.rope_theta ** (np.arange(0, s.head_dim, 2) / s.head_dim)
    smooth = (original / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid)).astype(np.float32)


def _tensor_data(rng: np.random.Generator, s: Shape, t: TensorSpec) -> np.ndarray:
    if t.qtype != Q.F32:
        return random_blocks(rng, t.qtype, math.prod(t.shape))
    if t.kind == T.ROPE_FREQS:
        return _llama3_factors(s)
    if t.kind in (T.ROPE_FACTORS_LONG, T.ROPE_FACTORS_SHORT):  # LongRoPE's factors: 1 (no long-context quality)
        return np.ones(t.shape, np.float32)
    noise = rng.normal(0.0, BIAS_RMS if t.name.endswith(".bias") else NORM_NOISE, t.shape)
    return (noise if t.name.endswith(".bias") else 1.0 + noise).astype(np.float32)


@functools.lru_cache(maxsize=4)
def _tokenizer_fields(source: Path, version: tuple[int, int]) -> tuple[dict[str, tuple[list[int], object]], str]:
    """({key: (GGUF value types, value)} of the file's `tokenizer.*` keys, its general.name), cached per file
    `version` (size, mtime): GGUFReader takes seconds on a 100k-entry vocabulary."""
    reader = GGUFReader(source)
    fields = {k: (list(f.types), f.contents()) for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    origin = reader.fields["general.name"].contents() if "general.name" in reader.fields else source.name
    return fields, origin


def _copy_tokenizer(w: GGUFWriter, source: Path, vocab: int | None) -> int:
    """Copy every `tokenizer.*` key of the GGUF file `source`, the token lists padded with user-defined "<|pad_N|>"
    tokens (N: the token id) up to `vocab` (None: the tokenizer's own size), and say so in
    `swiftdecode.tokenizer_from`. Returns the vocab size written."""
    stat = source.stat()
    fields, origin = _tokenizer_fields(source.resolve(), (stat.st_size, stat.st_mtime_ns))
    if "tokenizer.ggml.tokens" not in fields:
        raise UserError(f"{source.name} has no tokenizer (tokenizer.ggml.tokens)")
    own = len(fields["tokenizer.ggml.tokens"][1])
    vocab = vocab or own
    if vocab < own:
        raise UserError(f"the shape's vocab ({vocab}) is smaller than {source.name}'s tokenizer ({own} tokens)")
    pads = {
        "tokenizer.ggml.tokens": [f"<|pad_{i}|>" for i in range(own, vocab)],
        "tokenizer.ggml.token_type": [int(TokenType.USER_DEFINED)] * (vocab - own),
        "tokenizer.ggml.scores": [PAD_SCORE] * (vocab - own),
    }
    for key, (types, value) in fields.items():
        if types[0] == GGUFValueType.ARRAY:
            w.add_key_value(key, value + pads.get(key, []), GGUFValueType.ARRAY, types[-1])
        else:
            w.add_key_value(key, value, types[0])
    padded = f", padded to {vocab}" if vocab > own else ""
    w.add_string("swiftdecode.tokenizer_from", f"{origin} ({source.name}: {own} tokens{padded})")
    return vocab


def _add_metadata(w: GGUFWriter, s: Shape, name: str, fmt: str, vocab: int) -> None:
    """The general and architecture keys convert_hf_to_gguf.py and llama-quantize write for the shape."""
    w.add_type("model")
    w.add_name(f"{name} (random weights)")
    w.add_bool("swiftdecode.random_weights", True)
    w.add_file_type(FORMATS[fmt][1])
    w.add_quantization_version(GGML_QUANT_VERSION)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.n_layers)
    w.add_feed_forward_length(s.intermediate)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_eps)
    if s.heads * s.head_dim != s.hidden or s.arch in GEMMAS:  # else llama.cpp derives it: hidden / heads
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    if s.arch in ("llama", "smollm3"):  # convert_hf_to_gguf.py's LlamaModel, which SmolLM3's converter extends
        w.add_vocab_size(vocab)
        w.add_rope_dimension_count(s.head_dim)
    if s.arch in ("phi3", *GEMMAS):
        w.add_sliding_window(s.sliding_window)
    if s.arch == "gemma2":
        w.add_attn_logit_softcapping(GEMMA2_SOFTCAPS[0])
        w.add_final_logit_softcapping(GEMMA2_SOFTCAPS[1])
    if s.arch == "phi3":
        w.add_rope_dimension_count(s.rope_dims or s.head_dim)
        w.add_rope_scaling_orig_ctx_len(s.longrope_context or s.context)
    if s.rope_linear:  # convert_hf_to_gguf.py's Gemma 3 (4B and up)
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(s.rope_linear)
    if s.longrope_context:  # convert_hf_to_gguf.py's LongRoPE attention factor
        scale = s.context / s.longrope_context
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(s.longrope_context)))


def write(
    shape: str | Shape,
    path: str | Path,
    fmt: str = "q4_k_m",
    seed: int = 0,
    *,
    tokenizer_from: Path,
    progress: bool = False,
) -> Path:
    """Write the GGUF file of `shape` with random weights (`seed`) in `fmt` ("q4_k_m", "q8_0", "q4_0") and the
    tokenizer of the GGUF file `tokenizer_from`; tensor by tensor, so memory stays near the largest tensor. The file
    appears at `path` only when complete."""
    name, s = resolve(shape)
    if fmt not in FORMATS:
        raise UserError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    if s.arch in GEMMAS and s.sliding_pattern != GEMMA_PATTERNS[s.arch]:
        raise UserError(f"{s.arch}'s sliding-window pattern is {GEMMA_PATTERNS[s.arch]} in llama.cpp and transformers")
    path, w = Path(path), GGUFWriter(None, s.arch)
    vocab = _copy_tokenizer(w, Path(tokenizer_from), s.vocab)
    _add_metadata(w, s, name, fmt, vocab)
    plan = tensor_plan(s, fmt, vocab)
    for t in plan:
        if t.qtype == Q.F32:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes)
        else:  # the writer takes quantized tensors as rows of bytes
            row_bytes = t.shape[-1] // GGML_QUANT_SIZES[t.qtype][0] * GGML_QUANT_SIZES[t.qtype][1]
            w.add_tensor_info(t.name, (*t.shape[:-1], row_bytes), np.dtype(np.uint8), t.nbytes, raw_dtype=t.qtype)
    part = path.with_name(path.name + ".part")
    rng = np.random.default_rng(seed)
    try:
        w.write_header_to_file(part)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in tqdm(plan, desc=path.name, unit="tensor", disable=not progress):
            w.write_tensor_data(_tensor_data(rng, s, t))
        w.close()
        os.replace(part, path)
    finally:
        w.close()
        part.unlink(missing_ok=True)
    return path
