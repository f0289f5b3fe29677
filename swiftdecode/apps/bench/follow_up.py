"""`bench --follow-up`: multi-turn work where the answer restates text the conversation holds. Each prompt becomes
a conversation: the prompt, the model's own answer to it (plain decoding, greedy, computed once and untimed), and
a follow-up turn asking to restate or revise that answer; every method is then timed on the follow-up turn, its
whole conversation read as the prompt (no method reuses another's cache)."""

from __future__ import annotations

import sys

from swiftdecode.apps.data import Prompt
from swiftdecode.base.errors import UserError

FOLLOW_UPS = {
    "restate": "Please restate your previous answer in full, word for word, so I can copy it.",
    "revise": "Please revise your previous answer: keep what is right, fix anything wrong, and give it in full.",
}


def conversations(gen, prompts: list[Prompt], kind: str, max_new_tokens: int) -> list[list[int]]:
    """Each prompt's follow-up conversation as chat-template ids ready for the answer; `gen`: a plain-decoding
    Generator that writes the first answers (with a progress bar)."""
    from tqdm import tqdm

    if kind not in FOLLOW_UPS:
        raise UserError(f"--follow-up must be one of {', '.join(FOLLOW_UPS)}, got {kind!r}")
    out = []
    for p in tqdm(prompts, desc="first turns", file=sys.stderr, leave=False):
        asked = [{"role": "user", "content": p.text}]
        answer = gen.generate(gen.chat_ids(asked), max_new_tokens=max_new_tokens).text
        turns = [*asked, {"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UPS[kind]}]
        out.append(gen.chat_ids(turns))
    return out
