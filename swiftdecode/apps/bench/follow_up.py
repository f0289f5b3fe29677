"""`bench --follow-up`: multi-turn work where the answer restates text the conversation holds. Each prompt becomes
a conversation: the prompt, the model's own answer to it (plain decoding, greedy, computed once and untimed), and
a follow-up turn asking to restate or revise that answer; every method is then timed on the follow-up turn. As in
a server that answered the first turn, our engine's methods find the first turn (prompt and answer) in their own
prefix cache (`prime`, untimed) and read only the rest of the conversation; other methods read all of it."""

from __future__ import annotations

import sys

from swiftdecode.apps.data import Prompt
from swiftdecode.base.errors import UserError

FOLLOW_UPS = {
    "restate": "Please restate your previous answer in full, word for word, so I can copy it.",
    "revise": "Please revise your previous answer: keep what is right, fix anything wrong, and give it in full.",
}


def conversations(
    gen, prompts: list[Prompt], kind: str, max_new_tokens: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Each prompt's follow-up conversation as chat-template ids ready for the answer, and its first turn's ids
    (prompt, then the answer's tokens); `gen`: a plain-decoding Generator that writes the first answers (with a
    progress bar)."""
    from tqdm import tqdm

    if kind not in FOLLOW_UPS:
        raise UserError(f"--follow-up must be one of {', '.join(FOLLOW_UPS)}, got {kind!r}")
    out, firsts = [], []
    for p in tqdm(prompts, desc="first turns", file=sys.stderr, leave=False):
        asked = [{"role": "user", "content": p.text}]
        first = gen.chat_ids(asked)
        answer = gen.generate(first, max_new_tokens=max_new_tokens)
        turns = [*asked, {"role": "assistant", "content": answer.text}, {"role": "user", "content": FOLLOW_UPS[kind]}]
        out.append(gen.chat_ids(turns))
        firsts.append(first + list(answer.token_ids))
    return out, firsts


def prime(gen, ids: list[int]) -> None:
    """Put `ids` (a conversation's earlier turns) in the Generator's prefix cache, as a server keeps a sequence it
    answered: a prefill into a cache of its own, then kept."""
    from swiftdecode.runtime.cache import SwiftCache

    cache = SwiftCache(gen.sm.kv_layout().windows)
    gen.sm.prefill(ids, cache)
    gen.save_prefix(ids, cache, None)
