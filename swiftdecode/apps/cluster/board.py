"""/metrics across replicas: each replica's Prometheus text, kept by one small deployment, merged with a label;
and the replicas' request body limit, which the ingress applies before routing.

A Ray Serve handle reaches some replica, not a chosen one, so each replica pushes its own text here every few
seconds (replica.METRICS_PUSH_S) and the ingress serves the merge: every sample once per replica, labelled
`replica="<id>"`, each family's HELP and TYPE once.
"""

from __future__ import annotations

import time

STALE_S = 10.0  # a replica silent this long (stopped, or replaced) leaves /metrics


class Board:
    """The latest metrics text of each replica (a Ray Serve deployment of one replica, no CPU reserved)."""

    def __init__(self):
        self.texts: dict[str, tuple[float, str]] = {}
        self.body_limit: int | None = None  # the replicas' request body limit (one model: one limit)

    def put(self, replica: str, text: str, max_body: int | None = None) -> None:
        self.texts[replica] = (time.monotonic(), text)
        self.body_limit = max_body or self.body_limit

    def max_body(self) -> int | None:
        """The replicas' body limit, for the ingress (None until a replica has pushed)."""
        return self.body_limit

    def get(self) -> dict[str, str]:
        """{replica id: its text}, for the replicas heard from within STALE_S."""
        now = time.monotonic()
        self.texts = {r: (at, text) for r, (at, text) in self.texts.items() if now - at < STALE_S}
        return {r: text for r, (_, text) in sorted(self.texts.items())}


def merge(texts: dict[str, str]) -> str:
    """One exposition of several replicas' texts: per family (in first-seen order) its comment lines once, then
    every replica's samples with `replica="<id>"` added to their labels."""
    heads: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in texts.items():
        family = ""
        for line in text.splitlines():
            if line.startswith("#"):
                family = line.split()[2] if len(line.split()) > 2 else family
                if line not in heads.setdefault(family, []):
                    heads[family].append(line)
            elif line.strip():
                heads.setdefault(family, [])
                samples.setdefault(family, []).append(labelled(line, replica))
    return "".join("\n".join(heads[f] + samples.get(f, [])) + "\n" for f in heads)


def labelled(sample: str, replica: str) -> str:
    """A sample line (`name{labels} value` or `name value`) with the replica label first among its labels."""
    label = f'replica="{replica}"'
    name_end = min(i for i in (sample.find("{"), sample.find(" ")) if i >= 0)
    if sample[name_end] == "{":
        rest = sample[name_end + 1 :]
        return f"{sample[:name_end]}{{{label}{'' if rest.startswith('}') else ','}{rest}"
    return f"{sample[:name_end]}{{{label}}}{sample[name_end:]}"
