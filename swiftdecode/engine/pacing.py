"""How much of a long prompt a round reads while other requests decode (chunked prefill, and a prompt scored for
its log-probabilities): as many rows as keep the decoding requests' rounds within STALL times their length
alone, so a long prompt arriving slows the running streams by a bounded factor instead of stopping them for its
whole prefill. A prompt row's cost grows with the context it attends to (at 16k tokens of Qwen2.5-0.5B,
attention is ~10 ms a row on 2 cores, against ~20 ms for a round of 4 decoding requests), so each chunk's rows
follow what the last chunk of the same kind cost. With nobody decoding a chunk is CHUNK rows: a request arriving
meanwhile waits at most one chunk.
"""

from __future__ import annotations

CHUNK = 256  # prompt rows per round when nobody decodes (bounds the logits held while scoring, too)
FIRST_ROWS = 8  # rows of a first chunk beside decoding requests, before its cost is measured
# A round that reads prompt rows beside decoding requests takes at most about this many times their round alone.
STALL = 2.0
KEEP = 0.8  # the decoding rounds' seconds: an average keeping 80% per round (about 5 rounds of memory)
# A chunk's rows change by at most this factor from one chunk to the next (the measured seconds are noisy: a
# round of 20 ms moves by a few ms), up or down.
STEP = 2.0


class ChunkPacer:
    """The rows of the next prompt chunk of each kind ("prefill", "score") beside decoding requests: the last
    chunk's rows scaled by how far its added seconds were from the share it may add (`read`), from the measured
    seconds of the decoding rounds alone (`decoded`)."""

    def __init__(self):
        self.decode_s: float | None = None  # a round of the decoding requests alone
        self.next: dict[str, int] = {}  # kind -> rows of its next chunk beside decoding requests

    def decoded(self, seconds: float) -> None:
        self.decode_s = seconds if self.decode_s is None else KEEP * self.decode_s + (1 - KEEP) * seconds

    def read(self, kind: str, rows: int, added: float) -> None:
        """A chunk of `rows` prompt rows added `added` seconds to the decoding requests' round."""
        share = (STALL - 1) * (self.decode_s or 0.0)
        scale = min(STEP, max(1 / STEP, share / max(added, 1e-6)))
        self.next[kind] = max(1, min(CHUNK, int(rows * scale)))

    def rows(self, kind: str, decoding: bool) -> int:
        """Rows of the next chunk: CHUNK when nobody decodes, else as `read` set them."""
        return self.next.get(kind, FIRST_ROWS) if decoding else CHUNK
