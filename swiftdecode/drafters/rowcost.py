"""Which copied tokens a round verifies (the row-cost planner): a forward's seconds as a line in its row
count, measured on live rounds, against the chance that a copied token at each depth is accepted, which the
copying drafter measures (`DepthAcceptance`: a copy is scored against the tokens actually generated whether or
not it was verified, so no round has to be spent on copying to learn whether copying pays).

Why: a forward's first row pays for streaming the weights, each further row only for its arithmetic, and on a
compute-bound CPU kernel that arithmetic is not small (Qwen2.5-0.5B on a 2-core Zen 5: 16 rows cost 2.0x one,
8 rows 1.4x; `swiftdecode doctor` prints the curve). A copied token is worth its row while its acceptance chance
raises the tokens per second of the forward it joins: alone, it pays at a modest chance; with 8 requests
decoding together a forward already yields 8 tokens, so an extra row must be accepted nearly always.
"""

from __future__ import annotations

from swiftdecode.drafters.base import Branch

# The fit and the acceptance counts keep this much per observation (about the last 100): costs drift with the
# context length, acceptance with the text.
KEEP = 0.99
# Each depth d starts from PRIOR_WEIGHT copies of which a share PRIOR_P**d were accepted that deep: an even chance
# for the first token, halving with every further one (a copy is accepted up to its first miss), overruled in a
# few rounds. A flat even chance sent 32-token copies out on a table's first rounds.
PRIOR_P, PRIOR_WEIGHT = 0.5, 2.0
MAX_DEPTH = 64  # depths counted (a copy round's chain is at most 32 tokens); deeper ones share the last count


class CostLine:
    """seconds(rows) ≈ a + b·rows, by decayed least squares over the forwards recorded."""

    def __init__(self):
        self.sums = [0.0] * 5  # decayed Σw, Σw·r, Σw·r², Σw·t, Σw·r·t

    def record(self, rows: int, seconds: float) -> None:
        new = (1.0, rows, rows * rows, seconds, rows * seconds)
        self.sums = [KEEP * s + v for s, v in zip(self.sums, new, strict=True)]

    def line(self) -> tuple[float, float] | None:
        """(a, b), or None while the rows seen do not vary enough to tell the slope."""
        w, r, r2, t, rt = self.sums
        var = w * r2 - r * r
        if w <= 0 or var <= 1e-9 * w * w:
            return None
        b = (w * rt - r * t) / var
        return (t - b * r) / w, b


class DepthAcceptance:
    """P(a copied token at depth d is accepted), d = 1 the root's child: the chance that the first d copied
    tokens equal the tokens generated."""

    def __init__(self, prior: float = PRIOR_P):
        self.accepted = [PRIOR_WEIGHT * prior ** (d + 1) for d in range(MAX_DEPTH)]
        self.proposed = [PRIOR_WEIGHT] * MAX_DEPTH

    def record(self, proposed: int, accepted: int) -> None:
        """A copy of `proposed` tokens whose first `accepted` were the ones generated."""
        for d in range(min(proposed, MAX_DEPTH)):
            self.proposed[d] = KEEP * self.proposed[d] + 1.0
            self.accepted[d] = KEEP * self.accepted[d] + (d < accepted)

    def accept(self, depth: int) -> float:
        d = min(depth, MAX_DEPTH) - 1
        return self.accepted[d] / self.proposed[d]


def nodes_that_pay(line: CostLine, branches: list[Branch], rows: int, cap: int) -> list[list[int]]:
    """The copied chains to verify (a beginning of each branch worth one, best first; none if nothing pays) in a
    forward of `rows` rows that yields `rows` tokens. The branches form a tree (shared beginnings are one node);
    a node's worth is p, the chance that it is generated (its branch's accept at its depth, no more than its
    parent's), and nodes join in order of p while the next one raises tokens per second, (tokens + p) /
    (seconds + b) > tokens / seconds with seconds = a + b·rows, at most `cap` of them. Until the line exists, the
    first branch's first `cap` tokens (so that the rows vary and the line can form)."""
    fit = line.line()
    if fit is None or fit[1] <= 0 or fit[0] + fit[1] * rows <= 0:
        return [branches[0].tokens[:cap]] if cap > 0 and branches[0].tokens else []
    worth, depth, node_of = [], [], {}  # nodes of the branches' tree; node_of: (parent node, token) -> node
    paths = []  # each branch's nodes, root's child first
    for branch in branches:
        parent, path = -1, []
        for d, token in enumerate(branch.tokens[:cap], 1):
            p = min(branch.accept(d), worth[parent] if parent >= 0 else 1.0)
            if (parent, token) not in node_of:
                node_of[parent, token] = len(worth)
                worth.append(0.0)
                depth.append(d)
            parent = node_of[parent, token]
            worth[parent] = max(worth[parent], p)
            path.append(parent)
        paths.append(path)
    b = fit[1]
    tokens, seconds, chosen = float(rows), fit[0] + b * rows, set()
    for node in sorted(range(len(worth)), key=lambda i: (-worth[i], depth[i])):  # a parent before its children
        if len(chosen) == cap or worth[node] * seconds <= b * tokens:
            break
        chosen.add(node)
        tokens, seconds = tokens + worth[node], seconds + b
    chains = []
    for branch, path in zip(branches, paths, strict=True):
        d = next((i for i, node in enumerate(path) if node not in chosen), len(path))
        if d and branch.tokens[:d] not in chains:
            chains.append(branch.tokens[:d])
    return chains
