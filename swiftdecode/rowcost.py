"""How many n-gram nodes a batched round can afford: the batch's forward seconds as a line in its row count, and
the acceptance of n-gram nodes by depth, both measured on the batch's own rounds.

Why: a forward's first row pays for streaming the weights, each further row only for its arithmetic, and on a
compute-bound CPU kernel that arithmetic is not small (`swiftdecode doctor`: 16 rows cost 3.4x one on a Zen 5,
8 rows 1.8x). With 8 requests decoding together a round already yields 8 tokens, so an extra verified node pays
only if it is accepted nearly as often as a whole request's row yields a token; with two requests it pays at a
fraction of that. A node is given out while its measured acceptance beats its row's measured cost in tokens.
"""

from __future__ import annotations

# The fit and the acceptance counts keep this much per round (about the last 100 rounds): costs drift with
# context length, acceptance with the text.
KEEP = 0.99
PRIOR_ACCEPT = (1.0, 2.0)  # (accepted, proposed) each depth starts from: an even chance, overruled in a few rounds
MAX_DEPTH = 16  # depths counted; deeper nodes share the last count


class RowCost:
    """seconds(rows) ≈ a + b·rows by decayed least squares over batched forwards, and P(n-gram node at depth d is
    accepted | proposed). `budget` turns both into a number of nodes per request."""

    def __init__(self):
        self.sums = [0.0] * 5  # decayed Σw, Σw·r, Σw·r², Σw·t, Σw·r·t
        self.accepted = [PRIOR_ACCEPT[0]] * MAX_DEPTH
        self.proposed = [PRIOR_ACCEPT[1]] * MAX_DEPTH

    def record_forward(self, rows: int, seconds: float) -> None:
        new = (1.0, rows, rows * rows, seconds, rows * seconds)
        self.sums = [KEEP * s + v for s, v in zip(self.sums, new, strict=True)]

    def record_tree(self, proposed: int, accepted: int) -> None:
        """A request's n-gram chain of `proposed` nodes had its first `accepted` accepted."""
        for d in range(min(proposed, MAX_DEPTH)):
            self.proposed[d] = KEEP * self.proposed[d] + 1.0
            self.accepted[d] = KEEP * self.accepted[d] + (d < accepted)

    def line(self) -> tuple[float, float] | None:
        """(a, b) of the fit, or None while the rows seen do not vary enough to tell the slope."""
        w, r, r2, t, rt = self.sums
        var = w * r2 - r * r
        if w <= 0 or var <= 1e-9 * w * w:
            return None
        b = (w * rt - r * t) / var
        return (t - b * r) / w, b

    def accept(self, depth: int) -> float:
        """Measured chance that an n-gram node at `depth` (1 = the root's child) is accepted when proposed."""
        d = min(depth, MAX_DEPTH) - 1
        return self.accepted[d] / self.proposed[d]

    def budget(self, requests: int, cap: int) -> int:
        """n-gram nodes per request, at most `cap`: the deepest d whose acceptance chance exceeds a row's cost in
        tokens, b / ((a + b·n) / n) for n requests. Until the fit exists, `cap` (so rows vary and it can form)."""
        fit = self.line()
        if fit is None:
            return cap
        a, b = fit
        per_token = (a + b * requests) / requests
        if b <= 0 or per_token <= 0:
            return cap
        threshold = b / per_token
        depth = 0
        while depth < cap and self.accept(depth + 1) > threshold:
            depth += 1
        return depth
