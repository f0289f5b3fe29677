"""Which kind of round comes next, where no copy pays (see `Generator.propose`): a plain step or a model drafter's
round, by speeds measured on live rounds; and the decayed seconds of recent decoding, search and re-measuring
that the search's and the exploration's caps are shares of."""

from __future__ import annotations

from collections.abc import Collection

from swiftdecode.drafters.budget import BUDGET_DECAY, TimeBudget, ema

EXPLORE_EVERY = 8  # rate estimates of the round kinds not in use go stale; re-measure one every 8th round ...
EXPLORE_SHARE = 0.05  # ... while re-measuring takes under 5% of decoding time (measured: 14-20% before this cap)
# A kind's tokens/s estimate keeps 90% of its value per round of that kind (about 10 rounds of memory): rates
# drift with the text and the context length, but one round is noisy.
RATE_KEEP = 0.9


class RoundScheduler:
    """Picks the kind of a round that does not copy among `modes` (model drafters' kinds and "plain"; a drafter
    only once it is ready): whichever has yielded the most tokens per second lately, measured; every
    EXPLORE_EVERY-th round tries another one in turn while such re-measuring stays within EXPLORE_SHARE of
    decoding time (a draft round can cost several plain ones). Non-adaptive schedules always run the first mode.
    `budget`: the decoding and search time the drafters' searches are capped by."""

    def __init__(self, modes: list[str], adaptive: bool):
        self.modes, self.adaptive = tuple(modes), adaptive
        self.rate: dict[str, float | None] = dict.fromkeys(self.modes)  # measured tokens/s of each kind it picks
        self.rounds = 0  # rounds scheduled adaptively
        self.budget = TimeBudget()
        self.explore_s = 0.0  # decayed seconds of rounds of a kind other than the fastest (re-measuring)

    def choose(self, ready: Collection[str]) -> str:
        """The next round's kind; `ready`: the model drafters that can draft now."""
        if not self.adaptive:
            return self.modes[0]  # the first model drafter's kind (config order; "plain" where there is none)
        self.rounds += 1
        modes = self._usable(ready)
        untried = [m for m in modes if self.rate[m] is None]
        if untried:
            return untried[0]
        best = self.fastest(ready)
        explore = self.rounds % EXPLORE_EVERY == 0 and self.explore_s < EXPLORE_SHARE * self.budget.decode_s
        if not explore or len(modes) == 1:
            return best
        others = [m for m in modes if m != best]
        return others[(self.rounds // EXPLORE_EVERY) % len(others)]

    def fastest(self, ready: Collection[str]) -> str | None:
        """The round kind with the highest measured tokens/s (None until every kind has been measured)."""
        modes = self._usable(ready)
        return None if any(self.rate[m] is None for m in modes) else max(modes, key=lambda m: self.rate[m])

    def _usable(self, ready: Collection[str]) -> list[str]:
        return [m for m in self.modes if m == "plain" or m in ready]

    def record(self, mode: str, tokens: int, seconds: float, ready: Collection[str]) -> None:
        """A round of kind `mode` took `seconds` for `tokens` tokens (copying rounds count as decoding time only)."""
        self.budget.decoded(seconds)
        if mode not in self.modes:
            return
        self.explore_s = BUDGET_DECAY * self.explore_s + (seconds if mode != self.fastest(ready) else 0.0)
        self.rate[mode] = ema(self.rate[mode], tokens / seconds, RATE_KEEP)
