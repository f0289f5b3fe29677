"""The CLI contract of `swiftdecode generate` (other tools depend on it) and `chat`, and their bad-input behaviour."""

from __future__ import annotations

import json

import pytest

from swiftdecode.apps.cli import main
from swiftdecode.runtime.fastpath import SPARSITY_LEVELS

SMOL = "smollm2-135m"  # the smallest model (the default is larger): these tests check the CLI, not the model
KEYS = {"text", "token_ids", "new_tokens", "wall_s", "tokens_per_s", "mean_accepted_tokens", "acceptance_rate"}


def test_generate_json_lines_for_a_prompt_file(tmp_path, capsys, spec_bench):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in spec_bench[:2]) + "\n")
    argv = ["generate", "--model", SMOL, "--prompt-file", str(data), "--prompt", "Name a colour.", "--chat", "--json"]
    assert main([*argv, "--max-new-tokens", "12", "--method", "swift"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 3
    for rec in lines:
        assert KEYS | {"tree_rounds", "skip", "time_split", "round_kinds", "accepted_by_source"} <= rec.keys()
        assert 0 < rec["new_tokens"] == len(rec["token_ids"]) <= 12
        assert set(rec["skip"]) == {"attn", "mlp", "sparsity"}
        assert rec["skip"]["sparsity"] in range(len(SPARSITY_LEVELS))
    assert lines[0]["cached_prompt_tokens"] == 0 and all(r["cached_prompt_tokens"] > 0 for r in lines[1:])  # template
    assert all("logprobs" not in r for r in lines)  # only when asked for


def test_generate_json_logprobs(capsys):
    assert (
        main(["generate", "--model", SMOL, "--prompt", "2 + 2 =", "--max-new-tokens", "5", "--json", "--logprobs", "2"])
        == 0
    )
    rec = json.loads(capsys.readouterr().out)
    assert [e["token"] for e in rec["logprobs"]] == rec["token_ids"]
    assert all(len(e["top"]) == 2 and e["top"][0] == [e["token"], e["logprob"]] for e in rec["logprobs"])  # greedy


def test_generate_logit_bias_and_repetition_penalty(capsys):
    argv = ["generate", "--model", SMOL, "--prompt", "1, 2, 3,", "--max-new-tokens", "6", "--json"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)["token_ids"][0]
    assert main([*argv, "--logit-bias", f"{first}=-100", "--repetition-penalty", "1.1", "--min-p", "0.05"]) == 0
    assert first not in json.loads(capsys.readouterr().out)["token_ids"]


def test_generate_json_schema_from_a_file(tmp_path, capsys):
    schema = tmp_path / "schema.json"
    schema.write_text(
        '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": false}'
    )
    ask = "Reply in JSON with a field n holding a number."
    argv = ["generate", "--model", SMOL, "--prompt", ask, "--max-new-tokens", "24", "--json-schema", str(schema)]
    assert main([*argv, "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["finish_reason"] == "stop" and isinstance(json.loads(rec["text"])["n"], int)


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--prompt", ""], "empty"),
        (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["--prompt", "hi", "--temperature", "nan"], "--temperature"),
        (["--prompt", "hi", "--temperature", "inf"], "--temperature"),
        (["--prompt", "hi", "--top-p", "2"], "--top-p"),
        (["--prompt", "hi", "--json", "--logprobs", "21"], "--logprobs"),
        (["--prompt", "hi", "--logprobs", "2"], "--logprobs needs --json"),
        (["--prompt", "hi", "--stop", ""], "--stop"),
        (["--prompt", "hi", "--repetition-penalty", "0"], "--repetition-penalty"),
        (["--prompt", "hi", "--min-p", "1.5"], "--min-p"),
        (["--prompt", "hi", "--min-tokens", "-1"], "--min-tokens"),
        (["--prompt", "hi", "--logit-bias", "5"], "--logit-bias takes ID=BIAS"),
        (["--prompt", "hi", "--logit-bias", "x=1"], "--logit-bias takes ID=BIAS"),
        (["--prompt", "hi", "--logit-bias", "5=200"], "--logit-bias"),
        (["--prompt", "hi", "--logit-bias", "99999999=1"], "integers in [0, 49152)"),
        (["--prompt", "hi", "--json-schema", "{not json"], "--json-schema is not valid JSON"),
        (["--prompt", "hi", "--json-schema", "/no/such/schema.json"], "cannot read"),
        (["--prompt", "hi", "--regex", "[a-"], "does not compile"),
        (["--prompt", "hi", "--model", "no-such-model"], "no-such-model"),
        (["--prompt", "hi", "--cache-dir", "/proc/no-such-dir"], "cannot create the cache directory"),
        (["--prompt", "hi " * 9000], "context"),
        ([], "--prompt"),
    ],
)
def test_generate_bad_input_is_one_line_and_exit_2(capsys, args, msg):
    assert main(["generate", "--model", SMOL, *args]) == 2  # a later --model wins
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]  # earlier lines can only be the model-loading progress bar
    assert last.startswith("swiftdecode generate: error:") and msg in last and "Traceback" not in err


def test_chat_keeps_the_conversation_and_reuses_its_earlier_turns(monkeypatch, capsys):
    """Two turns on stdin: each answer streams, its stats line follows, and the second turn's prompt (the first
    turn resent as history) is mostly copied from the prefix cache."""
    import io
    import re

    monkeypatch.setattr("sys.stdin", io.StringIO("Name a fruit.\nName another one.\n\n"))
    assert main(["chat", "--model", "smollm2-135m", "--max-new-tokens", "16"]) == 0
    out = capsys.readouterr()
    cached = [int(n) for n in re.findall(r"prompt tokens cached (\d+)\]", out.err)]
    assert len(cached) == 2 and cached[0] == 0 and cached[1] > 20, out.err
    assert out.out.count("> ") >= 2
