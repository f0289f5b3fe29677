"""Decayed measurements shared by the scheduler and the drafters: moving averages, and the seconds of recent
decoding and search that the search's overhead cap is a share of."""

from __future__ import annotations

# Per round, the decoding and search seconds fade by this factor: they cover about the last 200 rounds
# (1 / (1 - 0.995)), and idle time builds up no search burst.
BUDGET_DECAY = 0.995


def ema(old: float | None, new: float, keep: float) -> float:
    """Exponential moving average keeping `keep` of `old` (None: start at `new`)."""
    return new if old is None else keep * old + (1 - keep) * new


class TimeBudget:
    """Seconds of decoding and of search over the last ~200 rounds (decayed): a drafter's own search may spend
    `cap` of decoding time (`within`), so a search never slows decoding by more than its cap."""

    def __init__(self):
        self.decode_s = self.search_s = 0.0

    def decoded(self, seconds: float) -> None:
        """A round took `seconds`: decoding time grows, every measure fades."""
        self.decode_s = BUDGET_DECAY * self.decode_s + seconds
        self.search_s *= BUDGET_DECAY

    def within(self, cap: float) -> bool:
        """Whether recent search time is below `cap` of recent decoding time."""
        return self.search_s < cap * self.decode_s

    def searched(self, seconds: float) -> None:
        self.search_s += seconds
