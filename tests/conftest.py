"""Shared fixtures: real models, loaded once per test session (converted safetensors cached on disk)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from swiftdecode.runtime.cache import SwiftCache

SPEC_BENCH = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "spec_bench.jsonl"


@pytest.fixture(scope="session", autouse=True)
def _deterministic():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def smollm():
    """(model, tokenizer) of SmolLM2-135M-Instruct on the default path: its own quantized GGUF weights."""
    import swiftdecode

    return swiftdecode.load("smollm2-135m")


@pytest.fixture(scope="session")
def qwen():
    """(model, tokenizer) of Qwen2.5-Coder-0.5B-Instruct on its own quantized GGUF blocks (Q5_0/Q8_0/Q4_K/Q6_K)."""
    import swiftdecode

    return swiftdecode.load("qwen2.5-coder-0.5b", progress=False)


@pytest.fixture(scope="session")
def smollm_torch():
    """(model, tokenizer) of SmolLM2-135M-Instruct on torch's path: its layers run through transformers' modules
    (not batch-invariant), the path a model takes where our kernels cannot run it."""
    import swiftdecode

    return swiftdecode.load("smollm2-135m", fast_path="torch", progress=False)


@pytest.fixture(scope="session")
def gemma():
    """(model, tokenizer) of Gemma-3-270M (base model; sliding-window layers, GeGLU, four norms a layer)."""
    import swiftdecode

    return swiftdecode.load("gemma3-270m", progress=False)


@pytest.fixture(scope="session")
def fp32_builds():
    """Every build of the fp32 kernel library this CPU runs (AVX-512 and AVX2 on a Zen 4/5), widest first."""
    from swiftdecode.kernels.fp32 import ISA_FLAGS, KernelUnavailable, load_kernel

    out = []
    for isa in sorted(ISA_FLAGS):
        try:
            out.append(load_kernel(isa))
        except KernelUnavailable:
            pass
    return out


@pytest.fixture(scope="session")
def smollm_fp32():
    """(model, tokenizer) of SmolLM2-135M-Instruct dequantised to float32 (`--weights fp32`), fast path."""
    import swiftdecode

    return swiftdecode.load("smollm2-135m", weights="fp32")


@pytest.fixture(scope="session")
def spec_bench_path() -> Path:
    """../shared/data/spec_bench.jsonl: skipped where absent, but a failure under CI (CI=true), which has it."""
    if not SPEC_BENCH.exists():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"Spec-Bench data not found at {SPEC_BENCH} (CI must have it)")
        pytest.skip(f"Spec-Bench data not found at {SPEC_BENCH}")
    return SPEC_BENCH


@pytest.fixture(scope="session")
def spec_bench(spec_bench_path) -> list[dict]:
    return [json.loads(line) for line in spec_bench_path.read_text().splitlines() if line.strip()]


def pick_prompts(records: list[dict], per_category: int, categories: list[str]) -> list[str]:
    """The first `per_category` first-turn prompts of each category, in file order."""
    out = []
    for cat in categories:
        out += [r["turns"][0] for r in records if r["category"] == cat][:per_category]
    return out


def batched_and_solo(gen, mix: list[tuple[str, dict]], max_new_tokens: int) -> tuple[list, list[list[int]]]:
    """Chat prompts with their keywords, answered alone and then joining a Batch one round apart: (the batched
    Requests, the solo answers' token ids). The solo answers run as another tenant (`cache_salt`), so the batch
    cannot copy them whole from the suffix drafter's pool and finish before the others join."""
    from swiftdecode.engine.batch import Batch

    solo = [
        gen.generate(p, chat=True, max_new_tokens=max_new_tokens, cache_salt="solo", **kw).token_ids for p, kw in mix
    ]
    batch, reqs = Batch(gen), [gen.request(p, chat=True, max_new_tokens=max_new_tokens, **kw) for p, kw in mix]
    for req in reqs:
        batch.add(req)
        batch.step()
    while len(batch):
        batch.step()
    return reqs, solo


def teacher_forced_rows(gen, prompt: str, answer: list[int]):
    """Logits [len(answer), V] of a fresh forward over the chat prompt and answer: row i chose answer[i]."""
    ids = gen.chat_ids([{"role": "user", "content": prompt}])
    hidden = gen.sm.prefill(ids + answer, SwiftCache(gen.sm.n_layers))
    return gen.sm.logits(hidden[len(ids) - 1 :]), ids


# the shapes whose architectures run natively (the Gemmas' windows, 16 tokens, are shorter than the tests' contexts)
NATIVE = ("tiny-qwen3", "tiny-llama3", "tiny-qwen2", "tiny-phi3", "tiny-smollm3", "tiny-gemma3", "tiny-gemma2")


@pytest.fixture(scope="session", params=NATIVE)
def tiny(request, tmp_path_factory):
    """(shape name, model folder, GGUF file, (model, tokenizer) on our path) of a tiny random-weight model."""
    import swiftdecode
    from swiftdecode.hub import locate_gguf
    from swiftdecode.hub.synth import write

    folder = tmp_path_factory.mktemp(request.param)
    path = write(request.param, folder / "model.gguf", tokenizer_from=locate_gguf("smollm2-135m", progress=False)[0])
    loaded = swiftdecode.load(str(path), cache_dir=str(folder / "cache"), progress=False)
    entry = locate_gguf(str(path), cache_dir=str(folder / "cache"), progress=False)[1]
    return request.param, entry, path, loaded
