"""The Hugging Face baselines: plain `generate`, prompt lookup, early exit at L/2, a draft model; each on the
model's own generation config, with its assisted rounds counted by RoundProbe."""

from __future__ import annotations

import argparse
import time

from swiftdecode.apps.bench.methods import Outcome, Runner, cut_at_eos, peak_rss_mb, reset_peak_rss
from swiftdecode.base.text import eos_ids


def generation_config(model, tok, args: argparse.Namespace):
    """The model's generation config, copied: pad id set, greedy at temperature 0, else sampling (top-p as given)."""
    import copy

    gc = copy.deepcopy(model.generation_config)
    gc.max_new_tokens, gc.max_length, gc.min_new_tokens = args.max_new_tokens, None, None
    gc.eos_token_id = sorted(eos_ids(model, tok)) or None
    if gc.pad_token_id is None:
        gc.pad_token_id = next((i for i in (tok.pad_token_id, *(gc.eos_token_id or [])) if i is not None), 0)
    sample = args.temperature > 0
    gc.do_sample, gc.num_beams = sample, 1
    gc.temperature, gc.top_p, gc.top_k = (args.temperature, args.top_p, 0) if sample else (None, None, None)
    gc.repetition_penalty = None
    return gc


def hf_runner(method: str, model, tok, args: argparse.Namespace) -> Runner:
    """HF `generate`: plain, prompt lookup, early exit at L//2, or a draft model."""
    import torch

    gc, eos = generation_config(model, tok, args), eos_ids(model, tok)
    extra = draft_kwargs(args.draft_model, tok) if method == "draft-model" else {}
    if method == "pld":
        gc.prompt_lookup_num_tokens = 10
    elif method == "early-exit":
        gc.assistant_early_exit = model.config.get_text_config().num_hidden_layers // 2

    def call(ids: list[int], seed: int) -> Outcome:
        x = torch.tensor([ids])
        torch.manual_seed(seed)
        reset_peak_rss()
        with RoundProbe(model) as probe, torch.inference_mode():
            t0 = time.perf_counter()
            y = model.generate(x, attention_mask=torch.ones_like(x), generation_config=gc, **extra)
            wall = time.perf_counter() - t0
        rss = peak_rss_mb()
        new = cut_at_eos(y[0, len(ids) :].tolist(), eos)
        accepted, acceptance = probe.stats()
        return Outcome(
            new,
            wall,
            rounds=probe.rounds or None,
            mean_accepted_tokens=accepted,
            acceptance_rate=acceptance,
            peak_rss_mb=rss,
        )

    return call


def draft_kwargs(name: str, tok) -> dict:
    """`generate` kwargs for assisted generation by `name` (tokenizers too if vocabularies differ)."""
    from swiftdecode.hub import load_model

    draft, draft_tok = load_model(name)
    if draft_tok.get_vocab() == tok.get_vocab():
        return {"assistant_model": draft}
    return {"assistant_model": draft, "tokenizer": tok, "assistant_tokenizer": draft_tok}


class RoundProbe:
    """Counts HF assisted-generation rounds, drafted and accepted tokens while entered (wraps the candidate
    generator `generate` builds; plain decoding has none, so it counts nothing)."""

    def __init__(self, model):
        self.model, self.rounds, self.drafted, self.matched = model, 0, 0, 0

    def __enter__(self) -> RoundProbe:
        original = self.model._get_candidate_generator

        def wrapped(*a, **kw):
            cg = original(*a, **kw)
            get, update = cg.get_candidates, cg.update_candidate_strategy

            def get_candidates(input_ids, *a2, **kw2):
                cand, logits = get(input_ids, *a2, **kw2)
                self.drafted += cand.shape[1] - input_ids.shape[1]
                return cand, logits

            def update_candidate_strategy(input_ids, scores, num_matches):
                self.rounds, self.matched = self.rounds + 1, self.matched + int(num_matches)
                return update(input_ids, scores, num_matches)

            cg.get_candidates, cg.update_candidate_strategy = get_candidates, update_candidate_strategy
            return cg

        self.model._get_candidate_generator = wrapped
        return self

    def __exit__(self, *exc) -> None:
        del self.model._get_candidate_generator

    def stats(self) -> tuple[float | None, float | None]:
        """(mean accepted tokens per round incl. the bonus token, acceptance rate of drafted tokens)."""
        mat = (self.matched + self.rounds) / self.rounds if self.rounds else None
        return mat, (self.matched / self.drafted if self.drafted else None)
