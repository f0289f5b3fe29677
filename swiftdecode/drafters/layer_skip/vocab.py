"""The draft vocabulary: the draft head scores only the tokens seen most often so far (prompts always in)."""

from __future__ import annotations

import torch

from swiftdecode.runtime.model import SwiftModel


class DraftVocab:
    """The draft vocabulary: the `size` tokens seen most often so far in prompts and outputs (0: the whole
    vocabulary). A request's prompt is always in; verification still scores the whole vocabulary."""

    def __init__(self, sm: SwiftModel, size: int):
        self.sm, self.size = sm, size
        self.counts = torch.zeros(sm.vocab_size)  # tokens seen in prompts and outputs: the draft vocabulary's prior

    def count(self, ids: list[int]) -> None:
        self.counts.index_add_(0, torch.tensor(ids, dtype=torch.long), torch.ones(len(ids)))

    def prompt(self, ids: list[int]) -> None:
        """Count a prompt and draft over the `size` tokens most seen so far (this prompt's always in), earlier
        ids first on ties (BPE ids roughly follow frequency)."""
        if not self.size:
            return
        self.count(ids)
        prior = 1.0 / (1.0 + torch.arange(len(self.counts), dtype=torch.float32))
        score = self.counts + prior
        score[torch.tensor(ids)] = float("inf")
        self.sm.set_draft_vocab(torch.topk(score, min(self.size, len(score))).indices)
