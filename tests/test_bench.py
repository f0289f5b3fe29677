import argparse
import json
from pathlib import Path

import pytest

from swiftdecode.apps.bench import hf, runners, stream, summary
from swiftdecode.apps.bench.methods import Outcome, cut_at_eos
from swiftdecode.apps.cli import main
from swiftdecode.apps.data import Prompt

PNG = b"\x89PNG\r\n\x1a\n"


def write_data(path: Path) -> Path:
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["Write one sentence about the sea."]},
        {"question_id": 2, "category": "qa", "turns": ["What is the capital of France?"]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def bench_argv(tmp_path: Path, methods: str, tokens: int, *extra: str) -> list[str]:
    """`swiftdecode bench` on SmolLM2 over a small prompt file, its output in tmp_path / "out"."""
    data = str(write_data(tmp_path / "d.jsonl"))
    out = ["--max-new-tokens", str(tokens), "--out", str(tmp_path / "out")]
    return ["bench", "--model", "smollm2-135m", "--data", data, "--methods", methods, *out, *extra]


def test_end_to_end_greedy_lossless(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(bench_argv(tmp_path, "hf,ar,swift", 16, "--warmup", "1", "--json")) == 0
    results = json.loads((out / "results.json").read_text())
    assert json.loads(capsys.readouterr().out) == results
    assert results["model"] == "smollm2-135m"
    assert {"cpu", "threads", "torch", "fast_path"} <= results["env"].keys()
    assert list(results["methods"]) == ["hf", "ar", "swift"]
    keys = {
        "tokens_per_s",
        "prompt_tokens_per_s",
        "speedup_vs_hf",
        "speedup_vs_ar",
        "mean_accepted_tokens",
        "acceptance_rate",
        "lossless",
        "n",
    }
    for res in results["methods"].values():
        assert keys <= res["overall"].keys() and res["overall"]["n"] == 2
        assert set(res["by_category"]) == {"writing", "qa"}  # not Spec-Bench: categories as written
        for cat in res["by_category"].values():
            assert keys <= cat.keys() and cat["n"] == 1
    for m in ("ar", "swift"):
        assert results["methods"][m]["overall"]["lossless"] is True, results["mismatches"]
        assert results["methods"][m]["overall"]["agreement"] == 1.0
        assert res["overall"]["tokens_per_s"] > 0
    assert all(m["method"] == "hf" for m in results["mismatches"])
    records = results["records"]
    assert len(records) == 6 and all(r["new_tokens"] > 0 for r in records)
    assert all(0 < r["prefill_s"] < r["wall_s"] for r in records if r["method"] != "hf")  # HF: not measured
    assert results["methods"]["hf"]["overall"]["prompt_tokens_per_s"] is None
    assert all(r["identical"] for r in records if r["method"] != "hf")
    assert {r["method"] for r in records if r["index"] == 0} == {"hf", "ar", "swift"}
    md = (out / "results.md").read_text()
    assert "## Overall" in md and "| swift |" in md and "token-identical to `ar`" in md
    for png in ("speedup_by_category.png", "prompt_stream.png"):
        assert (out / png).read_bytes().startswith(PNG)


@pytest.mark.parametrize(
    "extra, data, message",
    [
        ([], None, "data file not found"),
        ([], "{broken\n", ":1: not valid JSON"),
        ([], "\n\n", "no prompts in"),
        (["--categories", "poetry"], "ok", "unknown category 'poetry'"),
        (["--methods", "hf,magic"], "ok", "unknown method 'magic'"),
        (["--methods", "hf,draft-model"], "ok", "draft-model needs --draft-model"),
        (["--max-new-tokens", "0"], "ok", "--max-new-tokens must be >= 1"),
        (["--temperature", "0.7", "--top-p", "1.5"], "ok", "--top-p must be"),
        (["--temperature", "0.7", "--methods", "ar,llama.cpp"], "ok", "llama.cpp runs greedy"),
        (["--methods", "hf,ar", "--regex", "[0-9]+"], "ok", "hf takes no grammar"),
        (["--json-schema", "{bad"], "ok", "--json-schema is not valid JSON"),
    ],
)
def test_bad_input_exits_2_before_loading(tmp_path, capsys, monkeypatch, extra, data, message):
    monkeypatch.setattr(runners, "load_target", lambda args: pytest.fail("model loaded despite bad input"))
    path = tmp_path / "d.jsonl"
    if data == "ok":
        write_data(path)
    elif data is not None:
        path.write_text(data)
    assert main(["bench", "--model", "smollm2-135m", "--data", str(path), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def record(index: int, method: str, ids: list[int], tps: float, category: str = "qa") -> dict:
    o = Outcome(ids, wall_s=len(ids) / tps)
    return stream.record(index, Prompt(str(index), category, "x"), method, 3, o)


class Tok:
    def decode(self, ids):
        return " ".join(map(str, ids))


def test_constrained_methods_are_checked_against_constrained_ar(tmp_path):
    out = tmp_path / "out"
    schema = '{"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}'
    assert main(bench_argv(tmp_path, "ar,swift,ngram", 24, "--json-schema", schema)) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["grammar"] == {"json_schema": json.loads(schema)} and not results["mismatches"]
    assert all(r["identical"] for r in results["records"]) and results["records"][0]["new_tokens"] > 0


def test_summary_counts_every_mismatch():
    records = [record(0, "hf", [1, 2, 3], 10.0), record(0, "ar", [1, 2, 3], 20.0), record(0, "pld", [1, 9, 3], 30.0)]
    records += [record(1, "hf", [4, 5], 10.0, "math"), record(1, "ar", [4, 5], 10.0, "math")]
    records += [record(1, "pld", [4, 5, 6], 40.0, "math")]
    args = argparse.Namespace(
        data="d",
        categories=None,
        limit=None,
        max_new_tokens=3,
        temperature=0.0,
        top_p=1.0,
        warmup=0,
        draft_model=None,
        seed=0,
        model="m",
        fast_path="auto",
        hf_fast_path=False,
        grammar=None,
    )
    res = summary.summarize(records, ["hf", "ar", "pld"], args, {}, Tok(), chat=False)
    assert [(m["method"], m["prompt_id"], m["position"]) for m in res["mismatches"]] == [
        ("pld", "0", 1),
        ("pld", "1", 2),
    ]
    pld = res["methods"]["pld"]
    assert pld["overall"]["lossless"] is False and pld["overall"]["mismatches"] == 2
    assert pld["by_category"]["qa"]["mismatches"] == 1
    assert res["methods"]["ar"]["overall"]["lossless"] is True
    assert res["methods"]["ar"]["overall"]["speedup_vs_hf"] == pytest.approx(1.5)  # (20 + 10) / 2 over (10 + 10) / 2
    assert pld["overall"]["prompt_speedup_vs_hf"] == pytest.approx(3.5)  # mean of 3x and 4x
    assert pld["by_category"]["math"]["speedup_vs_ar"] == pytest.approx(4.0)


def test_sampling_outputs_are_checked_against_ar():
    assert summary.lossless_reference(["hf", "ar", "swift"], 0.7) == "ar"
    assert summary.lossless_reference(["hf", "swift"], 0.7) is None  # HF's samples are its own
    assert summary.lossless_reference(["hf", "ar"], 0.0) == "ar" and summary.lossless_reference(["hf"], 0.0) == "hf"


def test_cut_at_eos():
    assert cut_at_eos([5, 6, 2, 7], {2}) == [5, 6]
    assert cut_at_eos([5, 6], {2}) == [5, 6]
    assert cut_at_eos([2], {2, 3}) == []


class TinyTok:
    eos_token_id, pad_token_id = None, None


@pytest.mark.parametrize("method", ["pld", "early-exit"])
def test_hf_assisted_methods_match_plain_greedy(method):
    """On a tiny random Llama: assisted outputs equal plain greedy, and the probe counts rounds and drafts."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=None,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(cfg).eval()
    args = argparse.Namespace(max_new_tokens=12, temperature=0.0, draft_model=None)
    prompt = [1, 2, 3, 4, 5, 6] * 3 + [1, 2]  # ends in an n-gram seen before: prompt lookup must propose
    plain = hf.hf_runner("hf", model, TinyTok(), args)(prompt, 0)
    out = hf.hf_runner(method, model, TinyTok(), args)(prompt, 0)
    assert len(plain.token_ids) == 12 and out.token_ids == plain.token_ids
    assert plain.rounds is None and plain.acceptance_rate is None
    assert out.rounds >= 1 and 1.0 <= out.mean_accepted_tokens and out.acceptance_rate is not None
    assert "_get_candidate_generator" not in vars(model)  # the probe unwrapped itself


FAKE_LLAMA = """#!/bin/sh
printf 'The capital of France is Paris, a city on the Seine with many old bridges. \342\202'
echo 'common_perf_print: prompt eval time =     100.00 ms /    17 tokens' >&2
echo 'common_perf_print:        eval time =     400.00 ms /     7 runs' >&2
"""


def test_llama_cpp_peer_rows(tmp_path, monkeypatch, capsys):
    """A llama.cpp binary found through SWIFTDECODE_LLAMA_CPP gets a row timed by its own reported prompt +
    decode time (its output may end inside a multi-byte character); a missing one is skipped with a note saying
    how to build it."""
    fake = tmp_path / "bin" / "llama-completion"
    fake.parent.mkdir()
    fake.write_text(FAKE_LLAMA)
    fake.chmod(0o755)
    monkeypatch.setenv("SWIFTDECODE_LLAMA_CPP", str(fake.parent))
    from swiftdecode.hub import resolve_cache_dir

    monkeypatch.setenv("SWIFTDECODE_CACHE", str(resolve_cache_dir()))  # the models stay where they are
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.cache/llama-cpp-peer
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    out = tmp_path / "out"
    argv = bench_argv(tmp_path, "ar,llama.cpp,llama.cpp-lookup", 8, "--warmup", "0")
    assert main(argv) == 0
    assert "skipping llama.cpp-lookup" in capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert list(results["methods"]) == ["ar", "llama.cpp"]
    peer = [r for r in results["records"] if r["method"] == "llama.cpp"]
    assert [(r["wall_s"], r["prefill_s"], r["new_tokens"]) for r in peer] == [(pytest.approx(0.5), 0.1, 8)] * 2
    tokens = sum(r["prompt_tokens"] for r in peer)
    assert results["methods"]["llama.cpp"]["overall"]["prompt_tokens_per_s"] == pytest.approx(tokens / 0.2)
    assert "n/a (own numerics" in (out / "results.md").read_text()


def test_warm_up_never_sees_a_timed_prompt():
    seen = []

    def runner(ids, seed):
        seen.append((tuple(ids), seed))
        return Outcome([1, 2], 0.1)

    prompts = [Prompt("1", "qa", "a"), Prompt("2", "qa", "b")]
    args = argparse.Namespace(warmup=2, seed=0)
    records, failures = stream.run_stream({"ar": runner}, prompts, [[1], [2]], args, [[9], [8]])
    assert seen[:2] == [((9,), -1), ((8,), -2)] and [r["prompt_id"] for r in records] == ["1", "2"] and not failures


def test_a_method_failing_on_one_prompt_costs_that_row_not_the_run():
    """As llama.cpp did when it printed half of a multi-byte character: the other prompts and methods go on."""

    def flaky(ids, seed):
        if ids == [2]:
            raise UnicodeDecodeError("utf-8", b"\xe2", 0, 1, "unexpected end of data")
        return Outcome([1, 2], 0.1)

    prompts = [Prompt("1", "qa", "a"), Prompt("2", "qa", "b"), Prompt("3", "qa", "c")]
    args = argparse.Namespace(warmup=0, seed=0)
    records, failures = stream.run_stream(
        {"ar": lambda i, s: Outcome([1], 0.1), "llama.cpp": flaky}, prompts, [[1], [2], [3]], args, []
    )
    assert [(r["method"], r["prompt_id"]) for r in records if r["method"] == "llama.cpp"] == [
        ("llama.cpp", "1"),
        ("llama.cpp", "3"),
    ]
    assert len(records) == 5 and [(f["method"], f["prompt_id"]) for f in failures] == [("llama.cpp", "2")]
    assert "UnicodeDecodeError" in failures[0]["error"]
    from swiftdecode.apps.bench.report import failure_lines

    assert "llama.cpp` on prompt 2" in "\n".join(failure_lines({"failures": failures}))


def test_concurrency_mode_replays_through_the_server(tmp_path, capsys):
    """--concurrency: the prompts through our server one client at a time, then all at once, answers compared."""
    rows = [{"question_id": i, "category": "qa", "turns": [f"Name {i + 2} animals."]} for i in range(4)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    argv = [
        "bench",
        "--model",
        "smollm2-135m",
        "--data",
        str(data),
        "--methods",
        "swift",
        "--max-new-tokens",
        "16",
        "--concurrency",
        "4",
        "--max-batch",
        "4",
        "--pairs",
        "2",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    result = json.loads((out / "concurrency.json").read_text())
    assert len(result["pairs"]) == 2 and result["speedup"] == min(p["speedup"] for p in result["pairs"])  # median
    assert all(p["identical_to_one_client"] == 4 for p in result["pairs"])
    assert result["concurrent"]["completed"] == result["one_client"]["completed"] == 4
    assert result["identical_to_one_client"] == 4 and result["concurrent"]["rejected_429"] == 0
    assert all(a["tokens"] > 0 and a["ttft_s"] <= a["wall_s"] for a in result["concurrent"]["answers"])
    assert all(0 < result[k]["client_cpu_s"] for k in ("one_client", "concurrent"))  # the clients' share of the CPU
    assert "Aggregate speedup" in capsys.readouterr().out
    bad = ["bench", "--model", "smollm2-135m", "--data", str(data), "--methods", "ar,swift", "--concurrency", "2"]
    assert main(bad) == 2
    assert main([*bad[:5], "--methods", "swift", "--concurrency", "2", "--pairs", "0"]) == 2


FAKE_LLAMA_SERVER = """#!{python}
# A stand-in for llama-server: /health, /completion (token ids back, its own timings), streamed /v1/completions.
import json, os, signal, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

if os.environ.get("FAKE_CRASH") and "--no-repack" not in sys.argv:  # as on a CPU that reports AMX it cannot run
    os.kill(os.getpid(), signal.SIGSEGV)

port = int(sys.argv[sys.argv.index("--port") + 1])
open({args_file!r}, "a").write(" ".join(sys.argv[1:]) + "\\n")


class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def reply(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply({{"status": "ok"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/completion":
            assert body["cache_prompt"] is False and body["temperature"] == 0
            toks = [100 + (len(body["prompt"]) + i) % 50 for i in range(body["n_predict"])]  # no EOS among them
            return self.reply({{"tokens": toks, "timings": {{"prompt_ms": 100.0, "predicted_ms": 400.0}}}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for t in body["prompt"][-body["max_tokens"]:]:
            self.wfile.write(("data: " + json.dumps({{"choices": [{{"text": str(t)}}]}}) + "\\n\\n").encode())
        usage = {{"completion_tokens": min(body["max_tokens"], len(body["prompt"]))}}
        last = "data: " + json.dumps({{"choices": [], "usage": usage}}) + "\\n\\ndata: [DONE]\\n\\n"
        self.wfile.write(last.encode())


ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def fake_llama_server(tmp_path, monkeypatch) -> Path:
    """A fake llama-server on SWIFTDECODE_LLAMA_CPP; returns the file where it writes its command lines."""
    import sys

    args_file = tmp_path / "server-args.txt"
    fake = tmp_path / "bin" / "llama-server"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text(FAKE_LLAMA_SERVER.format(python=sys.executable, args_file=str(args_file)))
    fake.chmod(0o755)
    monkeypatch.setenv("SWIFTDECODE_LLAMA_CPP", str(fake.parent))
    return args_file


def test_llama_server_peer_rows(tmp_path, monkeypatch):
    """llama-server methods: one server per method (with its --spec-type), the prompt's token ids in, the
    answer's ids out, timed by the server's own timings; the servers are stopped when the bench ends."""
    args_file = fake_llama_server(tmp_path, monkeypatch)
    out = tmp_path / "out"
    argv = bench_argv(tmp_path, "ar,llama-server,llama-server-ngram-mod", 8)
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert list(results["methods"]) == ["ar", "llama-server", "llama-server-ngram-mod"]
    lines = args_file.read_text().splitlines()
    assert len(lines) == 2 and "--spec-type" not in lines[0] and "--spec-type ngram-mod" in lines[1]
    for m in ("llama-server", "llama-server-ngram-mod"):
        rows = [r for r in results["records"] if r["method"] == m]
        assert [(r["wall_s"], r["prefill_s"], r["new_tokens"]) for r in rows] == [(pytest.approx(0.5), 0.1, 8)] * 2
    ar = {r["prompt_id"]: r for r in results["records"] if r["method"] == "ar"}
    peer = [r for r in results["records"] if r["method"] == "llama-server"]
    assert all(r["token_ids"] != ar[r["prompt_id"]]["token_ids"] for r in peer)  # the fake's own answer came back
    import subprocess

    alive = subprocess.run(["pgrep", "-f", str(tmp_path / "bin")], capture_output=True, text=True).stdout
    assert not alive.strip()  # no server left running


def test_concurrency_mode_beside_llama_server(tmp_path, monkeypatch, capsys):
    """--concurrency with a llama-server method: its server runs N slots and gets the same replays."""
    args_file = fake_llama_server(tmp_path, monkeypatch)
    out = tmp_path / "out"
    argv = bench_argv(tmp_path, "ngram,llama-server", 8, "--concurrency", "2")
    assert main(argv) == 0
    result = json.loads((out / "concurrency.json").read_text())
    peer = result["peers"]["llama-server"]
    starts = args_file.read_text().splitlines()
    assert len(starts) == 1 + 2 and all("-np 2" in line for line in starts)  # a fresh server for each replay
    assert peer["concurrent"]["completed"] == peer["one_client"]["completed"] == 2
    assert peer["identical_to_one_client"] == 2 and peer["concurrent"]["clients"] == 2
    assert "llama-server: aggregate" in capsys.readouterr().out
    assert main([*argv[:5], "--methods", "llama-server", "--concurrency", "2"]) == 2  # ours is the reference


def test_llama_server_killed_at_start_is_retried_without_repacking(tmp_path, monkeypatch, capsys):
    from swiftdecode.apps.bench import llama_server

    args_file = fake_llama_server(tmp_path, monkeypatch)
    monkeypatch.setenv("FAKE_CRASH", "1")
    with llama_server.LlamaServer(tmp_path / "bin" / "llama-server", tmp_path / "m.gguf", 2, "ngram-mod") as srv:
        assert srv.repack is False and srv.complete([1, 2, 3], 4)[1:] == (0.5, 0.1)
    assert "retrying with --no-repack" in capsys.readouterr().err
    assert args_file.read_text().count("--no-repack") == 1  # the first start died before writing its line


def test_a_method_failing_its_warm_up_is_left_out():
    def broken(ids, seed):
        raise RuntimeError("killed by a signal")

    prompts = [Prompt("1", "qa", "a"), Prompt("2", "qa", "b")]
    args = argparse.Namespace(warmup=1, seed=0)
    records, failures = stream.run_stream(
        {"ar": lambda i, s: Outcome([1], 0.1), "llama.cpp": broken}, prompts, [[1], [2]], args, [[9]]
    )
    assert [r["method"] for r in records] == ["ar", "ar"]
    assert [(f["method"], f["prompt_id"]) for f in failures] == [("llama.cpp", "warm-up")]


def test_follow_up_reads_the_second_turn_after_the_cached_first(tmp_path):
    """--follow-up: our methods find the first turn (prompt and answer) in their prefix cache, answer as `ar`, and
    prompt tok/s counts only the tokens they read."""
    out = tmp_path / "out"
    assert main(bench_argv(tmp_path, "ar,suffix", 12, "--follow-up", "restate", "--warmup", "0", "--json")) == 0
    results = json.loads((out / "results.json").read_text())
    records = results["records"]
    assert len(records) == 4 and all(r["identical"] for r in records)
    assert all(0 < r["cached_prompt_tokens"] < r["prompt_tokens"] for r in records)
    for m in ("ar", "suffix"):
        mine = [r for r in records if r["method"] == m]
        read = sum(r["prompt_tokens"] - r["cached_prompt_tokens"] for r in mine) / sum(r["prefill_s"] for r in mine)
        assert results["methods"][m]["overall"]["prompt_tokens_per_s"] == pytest.approx(read)


FAKE_LLAMA_BENCH = """#!/bin/sh
case "$*" in *"--repack 1"*) exit 134;; esac  # its repacked layout dies (llama.cpp's AMX path on some CPUs)
echo '[{"build_commit": "abc123", "n_prompt": 512, "n_gen": 0, "avg_ts": 40.5},'
echo ' {"build_commit": "abc123", "n_prompt": 0, "n_gen": 128, "avg_ts": 3.25}]'
"""


def test_doctor_beside_llama_bench(tmp_path, monkeypatch, capsys):
    """`doctor --llama-bench` times pp512/tg128 on our forward and runs llama-bench on the same GGUF in each weight
    layout, keeping the best that runs; without the binary it stops before loading, with how to build it."""
    from swiftdecode.hub import resolve_cache_dir

    monkeypatch.setenv("SWIFTDECODE_CACHE", str(resolve_cache_dir()))  # the models stay where they are
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.cache/llama-cpp-peer
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("SWIFTDECODE_LLAMA_CPP", str(tmp_path / "bin"))
    argv = ["doctor", "--model", "smollm2-135m", "--llama-bench", "--repeats", "1", "--context", "8", "--json"]
    assert main(argv) == 2 and "llama-cpp-peer.sh" in capsys.readouterr().err
    fake = tmp_path / "bin" / "llama-bench"
    fake.parent.mkdir()
    fake.write_text(FAKE_LLAMA_BENCH)
    fake.chmod(0o755)
    assert main(argv) == 0
    b = json.loads(capsys.readouterr().out)["llama_bench"]
    assert b["llama.cpp"] == {"pp": 40.5, "tg": 3.25, "pp_repack": "0", "tg_repack": "0", "build": "abc123"}
    assert b["ours"]["pp"] > 0 and b["ours"]["tg"] > 0
    from swiftdecode.apps.bench.llama_bench import report_lines

    assert "pp512" in report_lines(b["ours"], b["llama.cpp"])[1]
