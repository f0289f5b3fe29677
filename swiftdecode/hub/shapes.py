"""Published decoder shapes (their config.json numbers) and tiny test shapes, one per architecture, for the
random-weight files of hub/synth.py."""

from __future__ import annotations

from dataclasses import dataclass

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


def resolve(shape: str | Shape) -> tuple[str, Shape]:
    """(name, Shape) of a shape name in `SHAPES` or a Shape; UserError naming the known shapes otherwise."""
    if isinstance(shape, Shape):
        return f"{shape.arch}-custom", shape
    if shape not in SHAPES:
        raise UserError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    return shape, SHAPES[shape]
