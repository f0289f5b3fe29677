"""A user's first contact: `--version`, `models`, the short line after an answer, chat's limit, errors that name
their fix, and a README short enough to read."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import swiftdecode
from swiftdecode.apps import models_cli
from swiftdecode.apps.cli import main
from swiftdecode.apps.generate_cli import after_answer, summary_line
from swiftdecode.hub import DEFAULT_MODEL, REGISTRY, pull
from swiftdecode.runtime.lean import MODEL_TYPES

ROOT = Path(__file__).resolve().parents[1]
SRC = ("skip", "suffix", "ngram", "both")


def stats(**kw) -> dict:
    """A stats dict as GenerationStats.to_dict gives it: 41 tokens, 10 plain rounds of 0.05 s, 10 copy rounds."""
    s = {
        "new_tokens": 41,
        "wall_s": 1.0,
        "tokens_per_s": 41.0,
        "cached_prompt_tokens": 7,
        "round_kinds": {"suffix": 10, "ngram": 0, "draft": 0, "plain": 10},
        "round_seconds": {"suffix": 0.5, "ngram": 0.0, "draft": 0.0, "plain": 0.5},
        "accepted_by_source": {"skip": 2, "suffix": 25, "ngram": 1, "both": 2},
    }
    return s | kw


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"swiftdecode {swiftdecode.__version__}"


def test_models_lists_every_registry_model(tmp_path, capsys):
    assert main(["models", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = {r[0].split()[0]: r for r in models_cli.rows(str(tmp_path))}
    assert set(rows) == set(REGISTRY) and all(name in out for name in REGISTRY)
    assert rows[DEFAULT_MODEL][0].endswith("(default)")
    assert all(r[-1] == "no" for r in rows.values())  # an empty cache: nothing pulled
    for name, row in rows.items():
        assert row[5].startswith("yes" if models_cli.ARCHITECTURES[name] in MODEL_TYPES else "no")
    assert rows["gemma3-270m"][5] == "yes" and rows["smollm2-135m"][5] == "yes"


def test_models_architecture_is_the_pulled_config_s():
    """The table's architecture is what the model's own config says (smollm2-135m, which the suite pulls)."""
    entry = pull("smollm2-135m", progress=False)
    config = json.loads((entry / "config.json").read_text())
    assert models_cli.ARCHITECTURES["smollm2-135m"] == config["model_type"]
    assert dict((r[0].split()[0], r[-1]) for r in models_cli.rows())["smollm2-135m"].startswith("gguf")


def test_summary_line_is_short_and_counts_its_sources():
    line = summary_line(stats(), "swift")
    # plain decoding of the 40 tokens after the first: 40 x 0.05 s = 2 s, against 1 s of rounds
    assert "~2.00x plain decoding" in line and "41 tokens in 1.0 s, 41.0 tok/s" in line
    assert "28 copied from the text, 2 from the layer-skip draft" in line
    assert "\n" not in line and len(line) < 160 and "cached" not in line
    assert "prompt tokens cached 7]" in summary_line(stats(), "swift", cached=True)
    assert "plain decoding" not in summary_line(stats(), "ar")  # ar is plain decoding
    kinds = {"suffix": 10, "ngram": 0, "draft": 0, "plain": 0}
    quiet = stats(round_kinds=kinds, accepted_by_source=dict.fromkeys(SRC, 0))  # no plain round, nothing accepted
    assert summary_line(quiet, "swift") == "[41 tokens in 1.0 s, 41.0 tok/s; no draft tokens accepted]"


@pytest.mark.parametrize(
    "tokens,finish,says",
    [(41, "stop", None), (41, "length", "--max-new-tokens 41"), (100 - 9, "length", "filled the model's context")],
)
def test_after_answer_says_which_limit_cut_it(tokens, finish, says):
    s = stats(new_tokens=tokens)
    res = SimpleNamespace(stats=SimpleNamespace(to_dict=lambda: s), finish_reason=finish, prompt_tokens=9)
    args = SimpleNamespace(verbose=False, method="swift", max_new_tokens=41)
    lines = after_answer(res, args, context=100).splitlines()
    assert len(lines) == (1 if says is None else 2) and (says is None or says in lines[1])


def test_generate_prints_one_short_line_or_every_counter(capsys):
    argv = ["generate", "--model", "smollm2-135m", "--prompt", "1, 2, 3, 4,", "--max-new-tokens", "6"]
    assert main(argv) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-2].startswith("[6 tokens in") and "rounds" not in lines[-2]
    assert lines[-1] == "[stopped at --max-new-tokens 6; raise it for a longer answer]"
    assert main([*argv, "--verbose"]) == 0
    assert "rounds suffix" in capsys.readouterr().err


def test_chat_answers_to_the_end_and_survives_a_turn_too_long(monkeypatch, capsys):
    """No --max-new-tokens: the limit is the model's context. A turn that does not fit is refused with its fix,
    and the conversation goes on."""
    monkeypatch.setattr("sys.stdin", io.StringIO("hi " * 9000 + "\nName a fruit.\n\n"))
    assert main(["chat", "--model", "smollm2-135m"]) == 0
    out = capsys.readouterr()
    assert "the model's context is 8192 tokens: /reset starts a new conversation]" in out.err
    assert "prompt tokens cached" in out.err and "stopped at" not in out.err and out.out.count("> ") == 3


def test_a_missing_torch_names_the_pinned_install(monkeypatch, capsys):
    def run(args):
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(models_cli, "run", run)
    assert main(["models"]) == 2
    assert "pip install torch==2.13.0" in capsys.readouterr().err


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
