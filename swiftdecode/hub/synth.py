"""GGUF files of published model shapes with random weights: speed work on a model's real sizes without its download.

`hub/shapes.py` holds the shapes (the published models' config.json numbers, and tiny test shapes).
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
from swiftdecode.hub.shapes import Shape, resolve

GEMMAS = ("gemma2", "gemma3")
ARCHES = {n: a for a, n in MODEL_ARCH_NAMES.items() if n in ("qwen3", "llama", "qwen2", "phi3", "smollm3", *GEMMAS)}
# every Nth layer attends globally: llama.cpp's loaders and transformers' configs fix it per architecture
GEMMA_PATTERNS = {"gemma2": 2, "gemma3": 6}
GEMMA2_SOFTCAPS = (50.0, 30.0)  # attention and final logit caps of every published Gemma 2 (config.json)

# --format -> (llama.cpp's default block type for it, general.file_type)
FORMATS = {  # fewest bits first
    "q2_k": (Q.Q2_K, LlamaFileType.MOSTLY_Q2_K),
    "q3_k_m": (Q.Q3_K, LlamaFileType.MOSTLY_Q3_K_M),
    "iq4_xs": (Q.IQ4_XS, LlamaFileType.MOSTLY_IQ4_XS),
    "q4_0": (Q.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "q4_k_m": (Q.Q4_K, LlamaFileType.MOSTLY_Q4_K_M),
    "q5_k_m": (Q.Q5_K, LlamaFileType.MOSTLY_Q5_K_M),
    "q6_k": (Q.Q6_K, LlamaFileType.MOSTLY_Q6_K),
    "q8_0": (Q.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "bf16": (Q.BF16, LlamaFileType.MOSTLY_BF16),  # unquantized (convert_hf_to_gguf.py --outtype): every matrix
    "f16": (Q.F16, LlamaFileType.MOSTLY_F16),
}
FLOATS = (Q.F16, Q.BF16)
# llama.cpp's types for rows that 256-element blocks do not divide
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0, Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.IQ4_XS: Q.IQ4_NL}
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
    Q.Q4_1: Layout((0, 2), (1.0, -7.5), math.sqrt(21.25)),  # d * q + m, q 4-bit: m = -7.5 d centres the weights
    Q.Q5_1: Layout((0, 2), (1.0, -15.5), math.sqrt(85.25)),  # d * q + m, q 5-bit
    Q.Q8_0: Layout((0,), (1.0,), math.sqrt(5461.5)),  # d * q, q int8
    # d * sc * q - dmin * m with 6-bit sc, m and 4-bit q; dmin = 7.5 d centres the weights on 0
    Q.Q4_K: Layout((0, 2), (1.0, 7.5), math.sqrt(66727.5)),
    Q.Q5_K: Layout((0, 2), (1.0, 15.5), math.sqrt(277651.5)),  # as Q4_K with 5-bit q: dmin = 15.5 d
    Q.Q2_K: Layout((80, 82), (1.0, 1.5), math.sqrt(192.5)),  # d * sc * q - dmin * m, 4-bit sc, m, 2-bit q
    Q.Q3_K: Layout((108,), (1.0,), math.sqrt(341.5 * 5.5)),  # d * (sc - 32) * (q - 4), sc 6-bit, q 3-bit; d last
    Q.IQ4_NL: Layout((0,), (1.0,), math.sqrt(4548.0)),  # d * v[q], v the 16 codebook values: E[v^2] = 4548
    Q.IQ4_XS: Layout((0,), (1.0,), math.sqrt(341.5 * 4548.0)),  # d * (sc - 32) * v[q], sc 6-bit
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


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's rule for the layers whose attn_v and ffn_down Q4_K_M stores as Q6_K (llama-quant.cpp)."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def block_type(s: Shape, kind: MODEL_TENSOR, shape: tuple[int, ...], fmt: str, layer: int) -> Q:
    """The block type llama.cpp's `llama_tensor_get_type` gives a tensor (norms and 1-D tensors stay F32)."""
    if len(shape) == 1:
        return Q.F32
    base, cols = FORMATS[fmt][0], shape[1]
    if base in FLOATS:
        return base
    if kind == T.OUTPUT or (s.tied and kind == T.TOKEN_EMBD):  # the output projection: Q6_K unless Q8_0 anyway
        return Q.Q8_0 if cols % GGML_QUANT_SIZES[base][0] or base == Q.Q8_0 else Q.Q6_K
    qtype = _mixed_type(s, kind, fmt, layer) or base
    return FALLBACK[qtype] if cols % GGML_QUANT_SIZES[qtype][0] else qtype


def _mixed_type(s: Shape, kind: MODEL_TENSOR, fmt: str, layer: int) -> Q | None:
    """The more bits llama.cpp's mixed formats give some layers' tensors (llama-quant.cpp; no imatrix), or None."""
    attn_v, n = kind in (T.ATTN_V, T.ATTN_QKV), s.n_layers
    if fmt in ("q4_k_m", "q5_k_m") and (attn_v or kind == T.FFN_DOWN) and use_more_bits(layer, n):
        return Q.Q6_K
    if fmt == "q2_k" and (attn_v or kind in (T.FFN_DOWN, T.ATTN_OUT)):
        return Q.Q4_K if attn_v and s.heads // s.kv_heads >= 4 else Q.Q3_K
    if fmt == "q3_k_m" and (attn_v or kind in (T.FFN_DOWN, T.ATTN_OUT)):
        first = layer < 2 if attn_v else layer < n // 16 if kind == T.FFN_DOWN else False
        return Q.Q5_K if first else Q.Q4_K
    if fmt == "iq4_xs" and ((attn_v and s.heads // s.kv_heads >= 4) or (kind == T.FFN_DOWN and layer < n // 8)):
        return Q.Q5_K
    return None


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


def float_bits(values: np.ndarray, qtype: Q) -> np.ndarray:
    """float32 values -> their 16-bit F16 (rounded to nearest) or BF16 (cut to the high half) bits, uint16."""
    return (
        values.astype(np.float16).view(np.uint16)
        if qtype == Q.F16
        else (values.view(np.uint32) >> 16).astype(np.uint16)
    )


def random_blocks(rng: np.random.Generator, qtype: Q, n_elements: int) -> np.ndarray:
    """[n_blocks, block bytes] uint8: random bytes, each fp16 scale set so the weights' RMS is `WEIGHT_RMS` (float
    types: normal values of that RMS)."""
    if qtype in FLOATS:  # N(0, WEIGHT_RMS) values
        return (
            float_bits(rng.normal(0.0, WEIGHT_RMS, n_elements).astype(np.float32), qtype).view(np.uint8).reshape(-1, 2)
        )
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
