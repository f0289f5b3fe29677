"""The drafters by round kind: an engine builds those its config's `modes` name, in that order (the first copying
drafter with a chain leads a copy round). A new drafter is one module and one line here."""

from __future__ import annotations

from swiftdecode.base.config import EngineConfig
from swiftdecode.drafters.base import Drafter
from swiftdecode.drafters.layer_skip.drafter import LayerSkipDrafter
from swiftdecode.drafters.ngram import NgramDrafter
from swiftdecode.drafters.suffix import SuffixDrafter
from swiftdecode.runtime.model import SwiftModel

DRAFTERS: dict[str, type[Drafter]] = {
    SuffixDrafter.kind: SuffixDrafter,
    NgramDrafter.kind: NgramDrafter,
    LayerSkipDrafter.kind: LayerSkipDrafter,
}


def build(sm: SwiftModel, cfg: EngineConfig) -> dict[str, Drafter]:
    """kind -> the drafter, for each round kind of `cfg.modes` but "plain"."""
    return {kind: DRAFTERS[kind](sm, cfg) for kind in cfg.modes if kind != "plain"}
