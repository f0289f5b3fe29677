"""`bench --follow-up`: the second turn holds the model's own first answer and the follow-up request."""

from swiftdecode import Generator
from swiftdecode.apps.bench.follow_up import FOLLOW_UPS, conversations
from swiftdecode.apps.data import Prompt


def test_follow_up_conversation_holds_the_first_answer(smollm):
    gen = Generator(*smollm, method="ar")
    prompt = Prompt("1", "writing", "Name three colours.")
    [ids] = conversations(gen, [prompt], "restate", 16)
    first = gen.generate(gen.chat_ids([{"role": "user", "content": prompt.text}]), max_new_tokens=16)
    text = gen.decode(ids)
    assert prompt.text in text and first.text.strip() in text and FOLLOW_UPS["restate"] in text
    assert text.index(first.text.strip()) < text.index(FOLLOW_UPS["restate"])
