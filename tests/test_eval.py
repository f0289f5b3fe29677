"""`swiftdecode eval`: the scores' definitions on a real model (a forward against its own run; against perturbed
weights), the windows' rule, the F32 GGUF written for llama.cpp, and the command's output and errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from swiftdecode.apps.evaluate.corpus import NEWS, corpus_text, windows
from swiftdecode.apps.evaluate.fidelity import ReferenceStore, evaluate, fill, targets
from swiftdecode.apps.evaluate.llama_ppl import f32_gguf, parse_kld
from swiftdecode.runtime.model import SwiftModel

README = Path(__file__).resolve().parents[1] / "README.md"  # text the tests score: no shared data needed
CTX = 64


def _windows(tok, n: int = 2) -> list[list[int]]:
    return windows(tok.encode(README.read_text()), CTX, n, None)


def test_a_forward_scored_against_its_own_run_has_kl_zero(smollm, tmp_path):
    model, tok = smollm
    wins, sm = _windows(tok), SwiftModel(model)
    store = ReferenceStore(tmp_path, "self", wins)
    fill(sm, wins, store, progress=False)
    assert store.missing(len(wins)) == []
    s = evaluate(sm, wins, store, progress=False)
    assert s["tokens"] == len(wins) * (CTX // 2 - 1)
    assert s["kld_mean"] == 0.0 and s["kld_p99"] == 0.0 and s["same_top"] == 1.0
    assert s["ppl"] == s["ref_ppl"] and s["ppl_ratio"] == 1.0
    assert 1.0 < s["ppl"] < 200.0  # README prose: the model predicts it far better than chance (49152 tokens)


def test_perturbed_weights_diverge_and_more_noise_diverges_more(tmp_path):
    import swiftdecode

    model, tok = swiftdecode.load("smollm2-135m", fast_path="torch", weights="fp32", progress=False)
    wins, sm = _windows(tok), SwiftModel(model)
    store = ReferenceStore(tmp_path, "fp32", wins)
    fill(sm, wins, store, progress=False)
    weights = [layer.mlp.down_proj.weight for layer in model.model.layers]
    g = torch.Generator().manual_seed(0)
    klds = []
    for scale in (0.02, 0.1):
        with torch.no_grad():
            for w in weights:
                w.add_(torch.randn(w.shape, generator=g) * scale * w.std())
        klds.append(evaluate(sm, wins, store, progress=False))
    assert 0.0 < klds[0]["kld_mean"] < klds[1]["kld_mean"]
    assert klds[1]["same_top"] < 1.0 and klds[1]["kld_p99"] >= klds[1]["kld_mean"]


def test_windows_follow_llama_perplexity():
    ids = list(range(1000, 1300))
    wins = windows(ids, CTX, None, bos=7)
    assert len(wins) == 300 // CTX and all(len(w) == CTX and w[0] == 7 for w in wins)
    assert wins[1][1:] == ids[CTX + 1 : 2 * CTX]
    assert targets(wins[0]).tolist() == wins[0][CTX // 2 + 1 :]
    assert len(windows(ids, CTX, 2, None)) == 2


@pytest.mark.parametrize(
    ("ids", "ctx", "message"),
    [(list(range(100)), 64, "at least 2 x --ctx"), (list(range(1000)), 63, "even number"), ([1] * 40, 0, "even")],
)
def test_windows_refuse_what_cannot_be_scored(ids, ctx, message):
    from swiftdecode.base.errors import UserError

    with pytest.raises(UserError, match=message):
        windows(ids, ctx, None, None)


def test_news_corpus_reads_the_summarization_articles(tmp_path):
    rows = [
        {"question_id": 1, "category": "summarization", "turns": ["Summarize: First article."]},
        {"question_id": 2, "category": "writing", "turns": ["Not news."]},
        {"question_id": 3, "category": "summarization", "turns": ["Summarize: Second one."]},
    ]
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert corpus_text(NEWS, str(path)) == "First article.\n\nSecond one."


def test_f32_gguf_holds_the_dequantized_weights_and_the_metadata(tmp_path):
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    from swiftdecode.hub import locate_gguf

    src = locate_gguf("smollm2-135m", progress=False)[0]
    dst = f32_gguf(src, tmp_path / "f32.gguf")
    a, b = GGUFReader(src), GGUFReader(dst)
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    assert all(t.tensor_type.name == "F32" for t in b.tensors)
    assert set(a.fields) == set(b.fields)
    assert b.fields["tokenizer.ggml.tokens"].contents() == a.fields["tokenizer.ggml.tokens"].contents()
    q = next(t for t in a.tensors if t.tensor_type.name.startswith("Q"))
    f = next(t for t in b.tensors if t.name == q.name)
    want = dequantize(q.data, GGMLQuantizationType(q.tensor_type)).reshape(-1)
    assert np.array_equal(np.asarray(f.data).reshape(-1), want)


def test_llama_perplexity_summary_is_parsed():
    out = (
        "Mean PPL(Q)                   :  12.345678 ±   0.123456\n"
        "Mean PPL(base)                :  12.000000 ±   0.120000\n"
        "Mean PPL(Q)/PPL(base)         :   1.028807 ±   0.001000\n"
        "Mean    KLD:   0.031234 ±   0.000456\n"
        "99.0%   KLD:   0.301234\n"
        "Same top p: 93.456 ± 0.123 %\n"
    )
    s = parse_kld(out)
    want = {"ppl": 12.345678, "ref_ppl": 12.0, "ppl_ratio": 1.028807, "kld_mean": 0.031234, "kld_p99": 0.301234}
    assert s == {**want, "same_top": pytest.approx(0.93456)}


def test_eval_command_prints_scores_and_rejects_bad_input(capsys):
    from swiftdecode.apps.cli import main

    base = ["eval", "--model", "smollm2-135m", "--corpus", str(README), "--reference", "none", "--json"]
    assert main([*base, "--ctx", str(CTX), "--windows", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["windows"] == 2 and out["swiftdecode"]["tokens"] == 2 * (CTX // 2 - 1) and out["swiftdecode"]["ppl"] > 1
    for bad, message in [
        (["--ctx", "7"], "even number"),
        (["--windows", "0"], "--windows"),
        (["--ctx", "100000"], "2 x"),
    ]:
        assert main([*base, *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1
    assert main(["eval", "--corpus", "/nonexistent.txt"]) == 2
    assert "neither" in capsys.readouterr().err
    assert main([*base, "--ctx", str(CTX), "--windows", "2", "--out", "/nonexistent/dir/r.json"]) == 2
    assert "--out" in capsys.readouterr().err
