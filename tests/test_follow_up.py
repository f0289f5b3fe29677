"""`bench --follow-up`: the second turn holds the model's own first answer and the follow-up request; our engine
reads it after the first turn, primed in its prefix cache, with the same answer."""

from swiftdecode import Generator
from swiftdecode.apps.bench.follow_up import FOLLOW_UPS, conversations, prime
from swiftdecode.apps.data import Prompt


def test_follow_up_conversation_holds_the_first_answer(smollm):
    gen = Generator(*smollm, method="ar")
    prompt = Prompt("1", "writing", "Name three colours.")
    [ids], [earlier] = conversations(gen, [prompt], "restate", 16)
    asked = gen.chat_ids([{"role": "user", "content": prompt.text}])
    first = gen.generate(asked, max_new_tokens=16)
    assert earlier == asked + list(first.token_ids)
    text = gen.decode(ids)
    assert prompt.text in text and first.text.strip() in text and FOLLOW_UPS["restate"] in text
    assert text.index(first.text.strip()) < text.index(FOLLOW_UPS["restate"])


def test_a_primed_first_turn_is_read_from_the_prefix_cache_with_the_same_answer(smollm):
    ar = Generator(*smollm, method="ar")
    [ids], [earlier] = conversations(ar, [Prompt("1", "writing", "Name three colours.")], "restate", 16)
    want = ar.generate(ids, max_new_tokens=24)
    gen = Generator(*smollm, method="suffix", prefix_cache_gb=0.1)
    prime(gen, earlier)
    got = gen.generate(ids, max_new_tokens=24)
    assert got.token_ids == want.token_ids
    cached = got.stats.cached_prompt_tokens
    assert len(earlier) - 4 <= cached < len(ids) and ids[:cached] == earlier[:cached]
