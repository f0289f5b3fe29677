"""`swiftdecode.hub.synth` and `swiftdecode synth`: GGUF files of published model shapes with random weights."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize

from swiftdecode.apps.cli import main
from swiftdecode.base.errors import UserError
from swiftdecode.hub.shapes import SHAPES
from swiftdecode.hub.synth import (
    FLOATS,
    LAYOUTS,
    WEIGHT_RMS,
    estimate_size,
    param_count,
    random_blocks,
    tensor_plan,
    use_more_bits,
    write,
)

TINY = [name for name in SHAPES if name.startswith("tiny-")]
SMOLLM2_VOCAB = 49152
# Per tiny shape: tensors its architecture has, and tensors it must not have (llama.cpp's names).
EXPECTED = {
    "tiny-qwen3": (["blk.1.attn_q_norm.weight", "blk.1.attn_k_norm.weight"], ["output.weight", "rope_freqs.weight"]),
    "tiny-llama3": (["rope_freqs.weight", "blk.1.ffn_gate.weight"], ["output.weight", "blk.0.attn_q_norm.weight"]),
    "tiny-qwen2": (["output.weight", "blk.0.attn_q.bias", "blk.0.attn_v.bias"], ["blk.0.attn_q_norm.weight"]),
    "tiny-phi3": (
        ["blk.0.attn_qkv.weight", "rope_factors_long.weight"],
        ["output.weight", "blk.0.attn_q.weight", "blk.0.ffn_gate.weight"],
    ),
    "tiny-smollm3": (["blk.1.ffn_gate.weight"], ["output.weight", "rope_freqs.weight", "blk.0.attn_q_norm.weight"]),
    "tiny-gemma3": (["blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight"], ["output.weight"]),
    "tiny-gemma2": (
        ["blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight"],
        ["output.weight", "blk.0.attn_q_norm.weight"],
    ),
}
# bartowski/Qwen_Qwen3-4B-GGUF (llama.cpp b5200): Qwen3-4B-Q4_K_M.gguf 2.50 GB, Qwen3-4B-Q8_0.gguf 4.28 GB
PUBLISHED = [("qwen3-4b", "q4_k_m", 2.50e9), ("qwen3-4b", "q8_0", 4.28e9)]


@pytest.fixture(scope="session")
def tokenizer_gguf():
    """smollm2-135m's GGUF file (pulled once if absent): the tokenizer the synthetic files take."""
    from swiftdecode.hub import locate_gguf

    return locate_gguf("smollm2-135m", progress=False)[0]


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory, tokenizer_gguf):
    """Every tiny shape written once in q4_k_m: name -> path."""
    folder = tmp_path_factory.mktemp("synth")
    return {name: write(name, folder / f"{name}.gguf", tokenizer_from=tokenizer_gguf) for name in TINY}


@pytest.mark.parametrize("name", TINY)
def test_tiny_file_reads_back_with_the_architectures_tensors(name, tiny_files):
    reader = GGUFReader(tiny_files[name])
    plan = tensor_plan(SHAPES[name], "q4_k_m", SMOLLM2_VOCAB)
    found = {t.name: (t.tensor_type, tuple(int(n) for n in t.shape)) for t in reader.tensors}
    assert found == {t.name: (t.qtype, tuple(reversed(t.shape))) for t in plan}
    present, absent = EXPECTED[name]
    assert set(present) <= set(found) and not set(absent) & set(found)
    assert {qtype for qtype, _ in found.values()} == {Q.F32, Q.Q4_K, Q.Q6_K}
    fields = reader.fields
    assert fields["general.architecture"].contents() == SHAPES[name].arch
    assert fields["general.name"].contents() == f"{name} (random weights)"
    assert fields["swiftdecode.random_weights"].contents() is True
    assert len(fields["tokenizer.ggml.tokens"].data) == SMOLLM2_VOCAB
    assert "tokenizer.chat_template" in fields and "swiftdecode.tokenizer_from" in fields


@pytest.fixture(scope="module")
def prompt_ids(tiny_files):
    """A prompt's ids from transformers' tokenizer of a tiny file (all tiny files carry the same tokenizer keys, and
    building it takes seconds)."""
    from transformers import AutoTokenizer

    path = tiny_files["tiny-qwen3"]
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert len(tokenizer) == SMOLLM2_VOCAB
    return tokenizer("The quick brown fox jumps", return_tensors="pt").input_ids


@pytest.mark.parametrize("name", TINY)
def test_transformers_loads_tiny_files_and_gives_finite_logits(name, tiny_files, prompt_ids):
    """transformers' model of each file (SmolLM3, which its GGUF reader lacks: on our config of the file)."""
    from test_architectures import reference_model

    from swiftdecode.hub.convert import read_meta

    path = tiny_files[name]
    model = reference_model(path, read_meta(path, progress=False)[1]).eval()
    with torch.no_grad():
        logits = model(prompt_ids).logits
    assert logits.shape == (1, prompt_ids.shape[1], SMOLLM2_VOCAB)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("qtype", [*LAYOUTS, *FLOATS])
def test_random_blocks_dequantize_to_small_finite_weights(qtype):
    weights = dequantize(random_blocks(np.random.default_rng(0), qtype, 256 * 1024), qtype)
    assert weights.size == 256 * 1024 and np.isfinite(weights).all()
    assert abs(np.sqrt(np.mean(weights**2)) / WEIGHT_RMS - 1) < 0.05
    assert abs(weights.mean()) < 0.15 * WEIGHT_RMS  # Q4_0's 4-bit range (-8..7) leans half a step negative


def test_q4_k_m_follows_llama_cpps_recipe():
    more = [i for i in range(28) if use_more_bits(i, 28)]
    assert more == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]
    qwen = {t.name: t.qtype for t in tensor_plan(SHAPES["qwen3-0.6b"], "q4_k_m", 151936)}
    assert qwen["token_embd.weight"] == Q.Q6_K and "output.weight" not in qwen  # tied: the embedding is the output
    for i in range(28):
        assert qwen[f"blk.{i}.attn_v.weight"] == qwen[f"blk.{i}.ffn_down.weight"] == (Q.Q6_K if i in more else Q.Q4_K)
        assert qwen[f"blk.{i}.attn_q.weight"] == qwen[f"blk.{i}.ffn_up.weight"] == Q.Q4_K
    llama = {t.name: t.qtype for t in tensor_plan(SHAPES["llama-3.1-8b"], "q4_k_m", 128256)}
    assert (llama["token_embd.weight"], llama["output.weight"]) == (Q.Q4_K, Q.Q6_K)
    gemma = {t.name: t.qtype for t in tensor_plan(SHAPES["gemma-3-1b"], "q4_k_m", 262144)}
    assert gemma["token_embd.weight"] == Q.Q8_0  # 1152 columns: no 256-element blocks
    assert (gemma["blk.3.attn_q.weight"], gemma["blk.3.attn_output.weight"]) == (Q.Q5_0, Q.Q4_K)
    q4_0 = {t.name: t.qtype for t in tensor_plan(SHAPES["llama-3.1-8b"], "q4_0", 128256)}
    assert q4_0["output.weight"] == Q.Q6_K and q4_0["blk.0.ffn_down.weight"] == q4_0["token_embd.weight"] == Q.Q4_0
    q8_0 = {t.qtype for t in tensor_plan(SHAPES["phi-4-mini"], "q8_0", 200064)}
    assert q8_0 == {Q.F32, Q.Q8_0}


def test_the_other_mixes_follow_llama_cpps_recipes():
    q3 = {t.name: t.qtype for t in tensor_plan(SHAPES["llama-3.2-3b"], "q3_k_m", 128256)}
    assert q3["token_embd.weight"] == Q.Q6_K  # tied: the output's type
    assert [q3[f"blk.{i}.attn_v.weight"] for i in range(3)] == [Q.Q5_K, Q.Q5_K, Q.Q4_K]
    assert [q3[f"blk.{i}.ffn_down.weight"] for i in range(3)] == [Q.Q5_K, Q.Q4_K, Q.Q4_K]  # first 28 // 16 layers
    assert q3["blk.9.attn_output.weight"] == Q.Q4_K
    assert q3["blk.9.attn_q.weight"] == q3["blk.9.attn_k.weight"] == q3["blk.9.ffn_up.weight"] == Q.Q3_K
    iq = {t.name: t.qtype for t in tensor_plan(SHAPES["llama-3.2-3b"], "iq4_xs", 128256)}
    assert iq["blk.0.attn_v.weight"] == iq["blk.9.ffn_down.weight"] == iq["blk.9.attn_q.weight"] == Q.IQ4_XS  # GQA 3
    assert [iq[f"blk.{i}.ffn_down.weight"] for i in (2, 3)] == [Q.Q5_K, Q.IQ4_XS]  # first 28 // 8 layers
    qwen = {t.name: t.qtype for t in tensor_plan(SHAPES["qwen3-8b"], "iq4_xs", 151936)}
    assert qwen["blk.9.attn_v.weight"] == Q.Q5_K and qwen["output.weight"] == Q.Q6_K  # GQA 4: more bits for v
    gemma = {t.name: t.qtype for t in tensor_plan(SHAPES["gemma-3-1b"], "iq4_xs", 262144)}
    assert gemma["blk.9.attn_q.weight"] == Q.IQ4_NL  # 1152 columns: 32-value blocks
    assert gemma["blk.9.attn_v.weight"] == Q.Q5_1  # GQA 4: Q5_K, which 1152 columns turn into Q5_1
    q5 = {t.name: t.qtype for t in tensor_plan(SHAPES["llama-3.1-8b"], "q5_k_m", 128256)}
    assert (q5["blk.0.attn_v.weight"], q5["blk.5.attn_v.weight"], q5["blk.5.ffn_up.weight"]) == (Q.Q6_K, Q.Q5_K, Q.Q5_K)
    assert {t.qtype for t in tensor_plan(SHAPES["llama-3.1-8b"], "q6_k", 128256)} == {Q.F32, Q.Q6_K}
    q2 = {t.name: t.qtype for t in tensor_plan(SHAPES["llama-3.1-8b"], "q2_k", 128256)}
    assert (q2["blk.5.attn_v.weight"], q2["blk.5.ffn_down.weight"], q2["blk.5.attn_output.weight"]) == (
        Q.Q4_K,  # GQA 4
        Q.Q3_K,
        Q.Q3_K,
    )
    assert q2["blk.5.attn_q.weight"] == q2["token_embd.weight"] == Q.Q2_K and q2["output.weight"] == Q.Q6_K
    for fmt, qtype in (("f16", Q.F16), ("bf16", Q.BF16)):  # unquantized: every matrix, embedding and output too
        assert {t.qtype for t in tensor_plan(SHAPES["llama-3.1-8b"], fmt, 128256)} == {Q.F32, qtype}


def test_published_shapes_have_their_parameter_counts():
    assert param_count(SHAPES["qwen3-0.6b"]) == 596_049_920  # Qwen3-0.6B's model card: 0.6B (0.44B non-embedding)
    assert abs(param_count(SHAPES["llama-3.1-8b"]) / 8.03e9 - 1) < 0.01
    assert abs(param_count(SHAPES["phi-4-mini"]) / 3.84e9 - 1) < 0.01
    assert param_count(SHAPES["gemma-2-2b"]) == 2_614_341_888  # Gemma 2 2B's model card: 2.6B, tied embedding
    assert param_count(SHAPES["gemma-3-4b"]) == 3_880_263_168  # Gemma 3 4B's language model: 3.88B (4.3B with vision)


def test_size_estimate_matches_written_files(tiny_files):
    for name, path in tiny_files.items():
        assert abs(path.stat().st_size / estimate_size(SHAPES[name], "q4_k_m") - 1) < 0.03, name


@pytest.mark.parametrize(("name", "fmt", "published"), PUBLISHED)
def test_size_estimate_matches_published_files(name, fmt, published):
    assert abs(estimate_size(SHAPES[name], fmt) / published - 1) < 0.03


def test_tokenizer_is_padded_to_the_shapes_vocab(tokenizer_gguf, tmp_path):
    shape = dataclasses.replace(SHAPES["tiny-llama3"], vocab=SMOLLM2_VOCAB + 64)
    reader = GGUFReader(write(shape, tmp_path / "padded.gguf", "q8_0", tokenizer_from=tokenizer_gguf))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == SMOLLM2_VOCAB + 64 and tokens.contents(-1) == f"<|pad_{SMOLLM2_VOCAB + 63}|>"
    assert reader.fields["tokenizer.ggml.token_type"].contents(-1) == 4  # user-defined
    assert reader.fields["llama.vocab_size"].contents() == SMOLLM2_VOCAB + 64
    small = dataclasses.replace(shape, vocab=1000)
    with pytest.raises(UserError, match="smaller"):
        write(small, tmp_path / "small.gguf", tokenizer_from=tokenizer_gguf)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["padded.gguf"]  # no partial file left behind


def test_cli_lists_the_shapes(capsys):
    assert main(["synth", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in SHAPES) and "q4_k_m size" in out


def test_cli_writes_a_file(tokenizer_gguf, tmp_path, capsys):
    out = tmp_path / "tiny.gguf"
    argv = ["synth", "tiny-qwen2", "-o", str(out), "--format", "q4_0", "--tokenizer-from", str(tokenizer_gguf)]
    assert main(argv) == 0
    assert "random weights" in capsys.readouterr().out
    assert abs(out.stat().st_size / estimate_size(SHAPES["tiny-qwen2"], "q4_0") - 1) < 0.03


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nope", "-o", "{tmp}/x.gguf"], "unknown shape 'nope'; known: qwen3-0.6b"),
        (["tiny-qwen3", "-o", "{tmp}/exists.gguf"], "exists; --force overwrites it"),
        (["tiny-qwen3", "-o", "{tmp}/missing/x.gguf"], "missing does not exist"),
        (["tiny-qwen3"], "give a SHAPE and -o PATH"),
    ],
)
def test_cli_errors_exit_2_with_one_line(args, message, tmp_path, capsys):
    (tmp_path / "exists.gguf").write_bytes(b"")
    assert main(["synth", *(a.format(tmp=tmp_path) for a in args)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err
