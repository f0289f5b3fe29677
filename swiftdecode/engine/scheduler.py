"""Which kind of round comes next (see `config.MODES`), from speeds measured on live rounds, and the decayed
seconds of recent decoding, search and re-measuring that the search's and the exploration's caps are shares of."""

from __future__ import annotations

EXPLORE_EVERY = 8  # rate estimates of the round kinds not in use go stale; re-measure one every 8th round ...
EXPLORE_SHARE = 0.05  # ... while re-measuring takes under 5% of decoding time (measured: 14-20% before this cap)
# Per round, the decoding / search / re-measuring seconds fade by this factor: they cover about the last 200 rounds
# (1 / (1 - 0.995)), and idle time builds up no search burst.
BUDGET_DECAY = 0.995
# A kind's tokens/s estimate keeps 90% of its value per round of that kind (about 10 rounds of memory): rates
# drift with the text and the context length, but one round is noisy.
RATE_KEEP = 0.9
DRAFT_STEP_KEEP = 0.8  # a draft forward's seconds estimate keeps 80% per draft round (about 5 rounds of memory)


def ema(old: float | None, new: float, keep: float) -> float:
    """Exponential moving average keeping `keep` of `old` (None: start at `new`)."""
    return new if old is None else keep * old + (1 - keep) * new


class RoundScheduler:
    """Picks the kind of a round that does not copy (whether copying pays is measured apart, `rowcost`) among
    `modes` less "ngram" ("draft" only once a skip set exists): whichever has yielded the most tokens per second
    lately, measured; every EXPLORE_EVERY-th round tries another one in turn while such re-measuring stays within
    EXPLORE_SHARE of decoding time (a draft round can cost several plain ones). Non-adaptive schedules always
    draft."""

    def __init__(self, modes: tuple[str, ...], adaptive: bool):
        self.modes, self.adaptive = tuple(m for m in modes if m != "ngram"), adaptive
        self.copying = "ngram" in modes  # whether rounds may be n-gram copies
        self.rate: dict[str, float | None] = dict.fromkeys(self.modes)  # measured tokens/s of each kind it picks
        self.rounds = 0  # rounds scheduled adaptively
        self.decode_s = self.search_s = 0.0  # decoding and search seconds of the last ~200 rounds (overhead cap)
        self.explore_s = 0.0  # ... of those, seconds in rounds of a kind other than the fastest (re-measuring)
        self.draft_step_s: float | None = None  # measured seconds of one draft forward (EMA)

    def kind(self, can_draft: bool, copy_pays: bool) -> str:
        """The next round's kind: an n-gram copy where that pays (and copying is on), else `choose`'s pick."""
        return "ngram" if copy_pays and self.copying else self.choose(can_draft)

    def choose(self, can_draft: bool) -> str:
        """The next round's kind; `can_draft`: whether a skip set exists."""
        if not self.adaptive:
            return "draft"
        self.rounds += 1
        modes = self._usable(can_draft)
        untried = [m for m in modes if self.rate[m] is None]
        if untried:
            return untried[0]
        best = self.fastest(can_draft)
        explore = self.rounds % EXPLORE_EVERY == 0 and self.explore_s < EXPLORE_SHARE * self.decode_s
        if not explore or len(modes) == 1:
            return best
        others = [m for m in modes if m != best]
        return others[(self.rounds // EXPLORE_EVERY) % len(others)]

    def fastest(self, can_draft: bool) -> str | None:
        """The round kind with the highest measured tokens/s (None until every kind has been measured)."""
        modes = self._usable(can_draft)
        return None if any(self.rate[m] is None for m in modes) else max(modes, key=lambda m: self.rate[m])

    def _usable(self, can_draft: bool) -> list[str]:
        return [m for m in self.modes if m != "draft" or can_draft]

    def record(self, mode: str, tokens: int, seconds: float, can_draft: bool) -> None:
        """A round of kind `mode` took `seconds` for `tokens` tokens (copying rounds count as decoding time only)."""
        self.decode_s = BUDGET_DECAY * self.decode_s + seconds
        self.search_s *= BUDGET_DECAY
        if mode not in self.modes:
            return
        self.explore_s = BUDGET_DECAY * self.explore_s + (seconds if mode != self.fastest(can_draft) else 0.0)
        self.rate[mode] = ema(self.rate[mode], tokens / seconds, RATE_KEEP)

    def record_draft(self, seconds: float) -> None:
        """One draft forward took `seconds` (a round's draft time over its draft forwards)."""
        self.draft_step_s = ema(self.draft_step_s, seconds, DRAFT_STEP_KEEP)

    def draft_step_cost(self) -> float | None:
        """A draft forward's cost relative to a plain decoding step, once both have been measured."""
        plain_rate = self.rate["plain"]  # one token per plain round: its tokens/s is 1 / its seconds
        return self.draft_step_s * plain_rate if self.draft_step_s and plain_rate else None

    def search_within(self, cap: float) -> bool:
        """Whether recent search time is below `cap` of recent decoding time."""
        return self.search_s < cap * self.decode_s

    def record_search(self, seconds: float) -> None:
        self.search_s += seconds
