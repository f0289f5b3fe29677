"""GGUF files -> cache entries: the GGUF's config and tokenizer (the quantized path), or a float32 safetensors
folder dequantised once by transformers (`--weights fp32`); user GGUF files are checked and keyed by path."""

from __future__ import annotations

import hashlib
import re
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

from swiftdecode.base.errors import UserError
from swiftdecode.hub.entries import check_space, entry_ok, locked, resolve_cache_dir, write_entry

GGUF_FILE = "model.gguf"  # the model's GGUF inside a quantized-path cache entry
ROPE_FREQS_TENSOR = "rope_freqs.weight"  # Llama 3's rotary factors in its GGUF (llama.cpp's name)
ROPE_FREQS_FILE = "rope_freqs.npy"  # ... kept beside a float32 entry's config, which cannot hold them
# GGUF architectures whose config transformers' GGUF reader lacks and we read (`_config`); their tensors are
# stored as llama.cpp stores llama's (q/k rows permuted: SmolLM3's converter extends LlamaModel)
LLAMA_LIKE = ("smollm3",)
# llama.cpp scales the queries of Gemma 2 and 3 27B (known by their layers) by (hidden / heads)^-0.5, other sizes'
# by head_dim's
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}
# llama.cpp's keys of a Llama-anatomy GGUF (after "<arch>.") -> config fields, as transformers' reader maps llama's
LLAMA_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "rope.dimension_count": "head_dim",
    "vocab_size": "vocab_size",
}


def attention_for(config) -> str:
    """The attention transformers builds a model of `config` with: SDPA, or eager where its model class refuses
    SDPA (Gemma 2, whose scores are capped). On the fast path our own attention replaces either."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return "eager" if model_class is not None and not model_class._supports_sdpa else "sdpa"


def read_meta(gguf: Path, progress: bool):
    """(tokenizer, config) of a GGUF file, read by transformers without touching its tensors (the config of a
    `LLAMA_LIKE` architecture read here)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        with quiet(not progress):
            config, own = _config(gguf)
            # AutoTokenizer picks its class from transformers' reading of the config; ours: the tokenizer keys alone
            reader = PreTrainedTokenizerFast if own else AutoTokenizer
            tokenizer = reader.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except UserError:
        raise
    except Exception as e:  # e.g. an architecture transformers cannot read from GGUF
        msg = (str(e).splitlines() or [""])[0][:200]
        raise UserError(f"transformers cannot load {gguf.name}: {type(e).__name__}: {msg}") from None
    if tokenizer.chat_template is None:  # transformers drops some templates; take it from the GGUF if present
        tokenizer.chat_template = _gguf_field(gguf, "tokenizer.chat_template")
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if config.model_type == "phi3":
        _phi3(config, gguf)
    if config.model_type in GEMMA_27B_LAYERS:
        _gemma(config, gguf)
    return tokenizer, config


def _config(gguf: Path):
    """(config, whether read here rather than by transformers)."""
    from gguf import GGUFReader
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name), False
    except ValueError:  # an architecture transformers' GGUF reader lacks (the reader parsed only when so: seconds)
        reader = GGUFReader(gguf)
        if reader.fields["general.architecture"].contents() not in LLAMA_LIKE:
            raise
        return _llama_like_config(reader), True


def _llama_like_config(reader):
    """The config of a `LLAMA_LIKE` GGUF, from its Llama keys (SmolLM3: the config's default NoPE layers, every
    4th, are llama.cpp's too: it fixes the step, the file has no key for it)."""
    from transformers import AutoConfig

    arch = reader.fields["general.architecture"].contents()
    value = lambda key: None if (f := reader.fields.get(key)) is None else f.contents()
    if value(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise UserError(f"{arch} GGUF with rotary scaling {value(f'{arch}.rope.scaling.type')!r}: not supported")
    fields = {name: v for key, name in LLAMA_KEYS.items() if (v := value(f"{arch}.{key}")) is not None}
    fields.setdefault("vocab_size", len(reader.fields["tokenizer.ggml.tokens"].data))
    ids = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "padding_token_id"}
    fields |= {name: value(f"tokenizer.ggml.{key}") for name, key in ids.items()}  # absent: None, not a default
    fields["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    return AutoConfig.for_model(arch, **fields)


def _phi3(config, gguf: Path) -> None:
    """What transformers' GGUF reader leaves out of a Phi-3/Phi-4 config: the partial rotary (the rotated dims,
    `phi3.rope.dimension_count`), LongRoPE's per-frequency factors (`rope_factors_short`/`_long` tensors, with
    the original context and the attention factor) and the sliding window (Phi-3-mini-4k's 2047 tokens; one as
    long as the context, Phi-4-mini's, hides nothing and is left out)."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    value = lambda key: None if (f := reader.fields.get(f"phi3.{key}")) is None else f.contents()
    rope = dict(config.rope_parameters or {})
    if (dims := value("rope.dimension_count")) is not None:
        rope["partial_rotary_factor"] = dims / (config.hidden_size // config.num_attention_heads)
    factors = {t.name: [float(v) for v in t.data] for t in reader.tensors if t.name.startswith("rope_factors_")}
    if factors:
        rope |= {"rope_type": "longrope", "short_factor": factors.get("rope_factors_short.weight")}
        rope["long_factor"] = factors.get("rope_factors_long.weight")
        if (attn := value("rope.scaling.attn_factor")) is not None:
            rope["attention_factor"] = attn
        original = value("rope.scaling.original_context_length") or config.max_position_embeddings
        config.original_max_position_embeddings = rope["original_max_position_embeddings"] = original
    config.rope_parameters = rope
    if (window := value("attention.sliding_window")) and window < config.max_position_embeddings:
        config.sliding_window = window


def _gemma(config, gguf: Path) -> None:
    """What transformers' GGUF reader leaves out of a Gemma 2 or 3 config, as llama.cpp reads the file: Gemma 2's
    soft caps of the attention scores and the final logits (the config's defaults, 50 and 30, where the file has
    none), Gemma 3's global layers' linear rotary scaling (4B and up; the sliding layers' base and scale are
    fixed), and the queries' scale (llama.cpp's rule, by size: the config's default query_pre_attn_scalar, 256,
    holds where head_dim is 256)."""
    from gguf import GGUFReader

    arch = config.model_type.removesuffix("_text")
    fields = GGUFReader(gguf).fields
    value = lambda key: None if (f := fields.get(f"{arch}.{key}")) is None else f.contents()
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if arch == "gemma2" and (v := value(cap)) is not None:
            setattr(config, cap, v)
    if (kind := value("rope.scaling.type")) not in (None, "none") and (kind, arch) != ("linear", "gemma3"):
        raise UserError(f"{arch} GGUF with rotary scaling {kind!r}: not supported")
    if kind == "linear":
        rope, linear = config.rope_parameters, {"rope_type": "linear", "factor": value("rope.scaling.factor")}
        config.rope_parameters = rope | {"full_attention": rope["full_attention"] | linear}
    wide = config.num_hidden_layers == GEMMA_27B_LAYERS[config.model_type]
    config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if wide else config.head_dim


def fp32_entry(gguf: Path, entry: Path, source_sha256: str, progress: bool) -> None:
    """Dequantise `gguf` to a float32 safetensors HF folder at `entry` (`--weights fp32`), under the config
    `read_meta` completes (Phi-3's partial rotary, Gemma 3's scaling), with Llama 3's rotary factors beside it
    (ROPE_FREQS_FILE: a config cannot hold them)."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers import AutoModelForCausalLM

    tokenizer, config = read_meta(gguf, progress)
    try:
        with quiet(not progress):
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, config=config, dtype=torch.float32
            )
    except Exception as e:
        msg = (str(e).splitlines() or [""])[0][:200]
        raise UserError(f"transformers cannot load {gguf.name}: {type(e).__name__}: {msg}") from None
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    freqs = [dequantize(t.data, t.tensor_type) for t in GGUFReader(gguf).tensors if t.name == ROPE_FREQS_TENSOR]

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if freqs:
            np.save(tmp / ROPE_FREQS_FILE, np.asarray(freqs[0], dtype=np.float32).reshape(-1))

    write_entry(entry, source_sha256, gguf, fill)


def divide_rotary(model, factors) -> None:
    """Llama 3's rotary scaling as its GGUF stores it: per-frequency factors [head_dim / 2] (`rope_freqs`) that
    divide the rotary's inverse frequencies, as llama.cpp applies them (transformers' GGUF reader drops them)."""
    import torch

    rope = model.get_decoder().rotary_emb
    factors = torch.as_tensor(factors, dtype=torch.float32).reshape(-1)
    if factors.shape != rope.inv_freq.shape:
        raise UserError(f"rope_freqs has {factors.numel()} factors for {rope.inv_freq.numel()} rotary frequencies")
    rope.inv_freq = rope.inv_freq / factors
    rope.original_inv_freq = rope.inv_freq.clone()


def meta_entry(gguf: Path, entry: Path, source_sha256: str, progress: bool, copy: bool) -> None:
    """Cache entry for the quantized path: config and tokenizer read from `gguf`, plus the GGUF itself as
    `model.gguf` when `copy` (registry models, whose parts are assembled), else a reference to it."""
    tokenizer, config = read_meta(gguf, progress)

    def fill(tmp: Path) -> None:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if copy:  # an assembled GGUF (in the build folder) is moved; an installed single part is copied
            (shutil.move if gguf.parent.name.startswith(".build-") else shutil.copyfile)(gguf, tmp / GGUF_FILE)

    write_entry(entry, source_sha256, gguf, fill)


@contextmanager
def quiet(enabled: bool):
    """Hide transformers' progress bars when `enabled`."""
    from transformers.utils import logging

    if not enabled:
        yield
        return
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.enable_progress_bar()


def _gguf_field(gguf: Path, key: str) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get(key)
    return None if field is None else field.contents()


def check_gguf(path: Path) -> None:
    """UserError unless `path` is a complete GGUF file (header parses, all tensor data inside the file)."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise UserError(f"{path} is not a GGUF file (bad magic)")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        end = max(t.data_offset + t.n_bytes for t in reader.tensors)
    except Exception as e:  # the reader fails in many ways on truncated files
        raise UserError(f"{path} is a truncated or corrupt GGUF file ({type(e).__name__})") from None
    if end > path.stat().st_size:
        raise UserError(f"{path} is a truncated GGUF file ({path.stat().st_size} of {end} bytes)")


def convert_gguf(path: Path, cache_dir=None, progress: bool = True, force: bool = False, weights: str = "fp32") -> Path:
    """Cache entry of a user GGUF file: "fp32" a converted HF folder, "gguf" its config and tokenizer only
    (the weights are read from `path` itself). Cache key: the file's resolved path, size, mtime."""
    path = path.resolve()
    st = path.stat()
    source = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    cache = resolve_cache_dir(cache_dir)
    key = re.sub(r"[^A-Za-z0-9._-]", "_", path.stem)[:64] + "-" + source[:12] + ("" if weights == "fp32" else "-meta")
    entry = cache / "gguf" / key
    with locked(cache, f"gguf-{key}"):
        if not force and entry_ok(entry, source):
            return entry
        check_gguf(path)
        entry.parent.mkdir(parents=True, exist_ok=True)
        if weights == "gguf":
            meta_entry(path, entry, source, progress, copy=False)
            return entry
        check_space(cache, 8 * st.st_size + (64 << 20), f"convert {path.name}")
        print(f"swiftdecode: converting {path} once into {entry}", file=sys.stderr)
        fp32_entry(path, entry, source, progress)
    return entry
