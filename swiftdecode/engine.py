"""The generation engine: prefill, then rounds of draft (layer-skipped model) → verify (full model, one forward
over the draft tree) → accept, with on-the-fly search of the skip set between rounds."""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, replace

import numpy as np
import torch

from swiftdecode import METHODS, fastpath
from swiftdecode.drafting import COMPACT_TOPK, DraftConfig, add_chain, draft, ngram_continuation
from swiftdecode.errors import UserError
from swiftdecode.model import SwiftModel
from swiftdecode.request import MODES, GenerationResult, GenerationStats, Request, StreamEvent
from swiftdecode.sampling import Sampler, SamplingParams
from swiftdecode.search import DraftCost, LayerSearch, SearchConfig
from swiftdecode.skip import SkipSet
from swiftdecode.tree import Tree
from swiftdecode.verification import verify


@dataclass(frozen=True)
class EngineConfig:
    draft: DraftConfig = DraftConfig()
    search: SearchConfig | None = SearchConfig()  # None: keep the initial skip set
    init: str = "cosine"  # initial skip set: "cosine" (prefill collinearity) or "uniform"
    init_ratio: float = 0.3  # fraction of inner sublayers skipped initially
    window: int = 32  # matchness window (tokens)
    draft_vocab: int = 0  # score drafts over this many likely tokens only (0 = the whole vocabulary)
    sparsity: int = 0  # initial activation-sparsity level of the draft's MLPs (fastpath.SPARSITY_LEVELS)
    adaptive: bool = True  # choose each round's kind by measured speed; False: always draft with the skip model
    modes: tuple[str, ...] = MODES  # round kinds the engine may use (ablations leave out a drafter)


# SWIFT's released defaults (hemingkx/SWIFT): up to 1000 optimisation steps, stop after 300 without improvement,
# one step per decoding step (opt_interval=1) for as long as the optimisation phase lasts.
PAPER_SEARCH = {"max_evals": 1000, "patience": 300, "max_overhead": math.inf}


def preset(method: str) -> EngineConfig:
    """Configuration of each method: ours, SWIFT's published one, a static uniform draft."""
    if method == "swift":
        compact = DraftConfig(epsilon=0.5, max_nodes=8, topk=COMPACT_TOPK, sampling_topk=COMPACT_TOPK, ngram=8)
        return EngineConfig(draft=compact, draft_vocab=16384, init_ratio=0.1, sparsity=3)
    if method == "ngram":  # ablation: swift's tree rounds without the layer-skip draft
        return replace(preset("swift"), search=None, draft_vocab=0, sparsity=0, modes=("ngram", "plain"))
    if method == "skip-only":  # ablation: swift without the n-gram branch
        swift = preset("swift")
        return replace(swift, draft=replace(swift.draft, ngram=0), modes=("draft", "plain"))
    if method == "swift-paper":  # SWIFT's optimisation phase: a search step every round, no overhead cap
        paper = SearchConfig(fixed_ratio=0.45, restart_drop=0.0, **PAPER_SEARCH)
        return EngineConfig(DraftConfig(max_nodes=64), paper, init="uniform", init_ratio=0.45, adaptive=False)
    if method == "uniform":
        return EngineConfig(search=None, init="uniform", init_ratio=0.5, adaptive=False)
    raise UserError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


class Generator:
    """Lossless generation with one model. Not thread-safe; search state carries across calls."""

    def __init__(self, model: torch.nn.Module, tokenizer, method: str = "swift", config: EngineConfig | None = None):
        if method not in METHODS:
            raise UserError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
        self.method, self.tokenizer = method, tokenizer
        self.sm = SwiftModel(model)
        self.cfg = config or (preset(method) if method != "ar" else None)
        self.eos = _eos_ids(model, tokenizer)
        self.search: LayerSearch | None = None
        self.decode_s = self.search_s = 0.0  # decoding and search seconds of the last ~200 rounds (overhead cap)
        self.explore_s = 0.0  # ... of those, seconds in rounds of a kind other than the fastest (re-measuring)
        self.rate: dict[str, float | None] = dict.fromkeys(MODES)  # measured tokens/s of rounds of each mode
        self.step_s: float | None = None  # measured seconds of one draft forward (EMA)
        self.search_step_s: float | None = None  # seconds of a search step: the last, or a decaying maximum
        self.rounds = 0
        vocab = self.sm.vocab_size
        self.token_counts = torch.zeros(vocab)  # tokens seen in prompts and outputs: the draft vocabulary's prior
        self.skip: SkipSet | None = None
        if self.cfg is not None:  # draft settings for greedy (True) and sampling (False), built once
            d = self.cfg.draft
            self.draft_cfg = {True: d, False: replace(d, topk=d.sampling_topk)}
        if self.cfg is not None and self.cfg.init == "uniform" and "draft" in self.cfg.modes:
            self._start_search(SkipSet.uniform(self.sm.n_layers, self.cfg.init_ratio))

    # ---- public API -------------------------------------------------------------------------------------
    def chat_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` in the model's chat template, ready for the assistant's answer."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise UserError("this model's tokenizer has no chat template")
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def generate(self, prompt: str | list[int], **kwargs) -> GenerationResult:
        """Generate to completion; see `stream` for the parameters."""
        for event in self.stream(prompt, **kwargs):
            if event.result is not None:
                return event.result
        raise AssertionError("stream ended without a result")

    def stream(
        self,
        prompt: str | list[int],
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: list[str] | None = None,
        chat: bool = False,
    ) -> Iterator[StreamEvent]:
        """Validate, then return an iterator of text pieces; the last event carries the GenerationResult."""
        req = self.request(prompt, max_new_tokens, temperature, top_p, top_k, seed, stop, chat)
        return self._run(req)

    def request(
        self, prompt, max_new_tokens=128, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=None, chat=False
    ) -> Request:
        """A validated request, not started (UserError on bad input); see `stream` for the parameters."""
        params = check_params(max_new_tokens, temperature, top_p, top_k, stop)
        ids = self._encode(prompt, chat)
        limit = self.sm.max_length - len(ids)
        if limit <= 0:
            raise UserError(f"prompt has {len(ids)} tokens; the model's context is {self.sm.max_length} tokens")
        sampler = Sampler(params, seed if seed is not None else secrets.randbits(63))
        budget = min(max_new_tokens, limit)
        return Request(ids, budget, sampler, stop or [], self.eos, self._decode, self.sm.n_layers)

    # ---- decoding loop ----------------------------------------------------------------------------------
    def _run(self, req: Request) -> Iterator[StreamEvent]:
        event = self.begin(req)
        while True:
            if event is not None:
                yield event
            if req.done:
                return
            event = self.step(req)

    def step(self, req: Request) -> StreamEvent | None:
        """One decoding round of a started request."""
        self.sm.cache = req.cache
        return self.advance(req, self._round(req.ctx, req.room, req.sampler, req.stats))

    def begin(self, req: Request) -> StreamEvent | None:
        """Prefill the request's prompt into its cache and take the first token."""
        self.sm.cache = req.cache
        self._set_draft_vocab(req.ids)
        t = time.perf_counter()
        first = req.sampler.pick(self._prefill(req.ids), len(req.ids))
        req.stats.time_split["prefill"] = time.perf_counter() - t
        return self.advance(req, [first])

    def plain_prefill(self) -> bool:
        """Whether a prompt's prefill is a plain forward, which may then run in chunks beside other requests: no
        skip set to initialise from its collinearity, no sparsity thresholds to calibrate on it."""
        return self.cfg is None or "draft" not in self.cfg.modes or (self.skip is not None and not self._sparse())

    def note_prompt(self, ids: list[int]) -> None:
        """A prompt whose prefill runs elsewhere (chunked batching): it still informs the draft vocabulary."""
        self._set_draft_vocab(ids)

    def advance(self, req: Request, tokens: list[int]) -> StreamEvent | None:
        """Give the request a round's tokens; on completion, record its stats and what it generated."""
        event = req.take(tokens)
        if req.done:
            if self.skip is not None:
                req.stats.skip, req.stats.search = self.skip.to_dict(), self.search.state if self.search else "off"
            self.token_counts.index_add_(0, torch.tensor(req.new, dtype=torch.long), torch.ones(len(req.new)))
        return event

    def _round(self, ctx: list[int], room: int, sampler: Sampler, stats: GenerationStats) -> list[int]:
        """One decoding round from the last token of ctx (not yet in the cache); returns the new tokens."""
        mode = "plain" if self.cfg is None or room <= 1 else self._choose_mode()
        t0 = time.perf_counter()
        out = self._plain(ctx, sampler) if mode == "plain" else self._tree_round(ctx, room, sampler, stats, mode)
        t1 = time.perf_counter()
        if mode == "plain":
            stats.time_split["verify"] += t1 - t0
        stats.round_kinds[mode] += 1
        stats.round_seconds[mode] += t1 - t0
        if self.cfg is None:
            return out
        self.decode_s = 0.995 * self.decode_s + (t1 - t0)  # decayed: idle time builds up no search burst
        self.search_s *= 0.995
        self.explore_s = 0.995 * self.explore_s + (t1 - t0 if mode != self._fastest() else 0.0)
        self._observe_rate(mode, len(out), t1 - t0)
        if self.search is not None:
            if mode != "plain":
                self.search.observe_acceptance(len(out))
            self._maybe_search(ctx, out, stats)
        return out

    def _maybe_search(self, ctx: list[int], out: list[int], stats: GenerationStats) -> None:
        """One search step if searching, once this request has generated a whole matchness window (so windows
        hold its own output only), within the overhead cap both over recent rounds and within this request:
        the request's search time, this step's included (its expected cost), stays below the cap's share of
        its decoding time, so short answers cannot overspend."""
        cap = self.search.cfg.max_overhead
        decoded = stats.time_split["draft"] + stats.time_split["verify"]
        first_guess = FIRST_STEP_TOKENS * decoded / max(len(ctx) - stats.prompt_tokens, 1)  # before one is measured
        step = self.search_step_s if self.search_step_s is not None else first_guess
        within = self.search_s < cap * self.decode_s and stats.time_split["optimize"] + step <= cap * decoded
        if self.search.searching and within and len(ctx) - stats.prompt_tokens >= self.cfg.window:
            t = time.perf_counter()
            self._search_step(ctx + out[:-1], out[-1])
            spent = time.perf_counter() - t
            self.search_step_s = spent if self.search_step_s is None else max(spent, 0.8 * self.search_step_s)
            stats.time_split["optimize"] += spent
            self.search_s += spent

    def _plain(self, ctx: list[int], sampler: Sampler) -> list[int]:
        """Plain decoding: one full forward of the last token."""
        P = self.sm.cache.length
        logits = self.sm.logits(self.sm.forward([ctx[-1]], torch.tensor([P]), torch.ones(1, 1, dtype=torch.bool)))
        return [sampler.pick(logits[0], P + 1)]

    def _tree_round(self, ctx: list[int], room: int, sampler: Sampler, stats: GenerationStats, mode: str) -> list[int]:
        """Draft a tree (skip model if mode == "draft", n-gram branch always), verify it in one full forward."""
        sm, P = self.sm, self.sm.cache.length
        t0 = time.perf_counter()
        tree = Tree(ctx[-1])
        cfg = self.draft_cfg[sampler.params.greedy]
        steps = draft(sm, tree, P, self.skip, cfg, room - 1, self._step_cost(), sampler) if mode == "draft" else 0
        add_chain(tree, ngram_continuation(ctx, min(cfg.ngram, room - 1)), cfg.max_nodes)
        sm.cache.truncate(P)
        t1 = time.perf_counter()
        logits = sm.logits(sm.forward(tree.input_ids(), tree.positions(P), tree.ancestry()))
        path, bonus = verify(tree, logits, sampler, P)
        sm.cache.keep(P, torch.tensor([0] + [i + 1 for i in path]))
        t2 = time.perf_counter()
        stats.time_split["draft"] += t1 - t0
        stats.time_split["verify"] += t2 - t1
        stats.draft_steps += steps
        stats.count_tree(tree, path)
        if steps:
            self.step_s = _ema(self.step_s, (t1 - t0) / steps)
        return [tree.tokens[i] for i in path] + [bonus]

    def _prefill(self, ids: list[int]) -> torch.Tensor:
        """Full forward of the prompt; picks the initial skip set on first use. Returns the last logits [V]."""
        if self.cfg is None or "draft" not in self.cfg.modes:
            return self.sm.logits(self.sm.prefill(ids)[-1:])[0]
        sparse, start = self._sparse(), None
        with fastpath.calibrate() if sparse else nullcontext():  # sparsity thresholds follow this prompt
            if self.search is None and self.cfg.init == "cosine":
                with _collinearity(self.sm) as cos:
                    hidden = self.sm.prefill(ids)
                n = round(self.cfg.init_ratio * (self.sm.n_layers - 2))
                layers = frozenset(int(i) + 1 for i in np.argsort(-cos()[1:-1])[:n])
                start = SkipSet(layers, layers, self.cfg.sparsity if sparse else 0)
            else:
                hidden = self.sm.prefill(ids)
        logits = self.sm.logits(hidden[-1:])[0]
        if start is not None:  # after calibration: the search's cost timing must not set the thresholds
            self._start_search(start)
        return logits

    def _sparse(self) -> bool:
        """Whether drafts may be activation-sparse: the config asks and the MLPs run on the sparse kernel."""
        return self.cfg.sparsity > 0 and fastpath.sparse_capable(self.sm.model)

    def _choose_mode(self) -> str:
        """How this round drafts, among the config's `modes` (see MODES; "draft" once a skip set exists):
        whichever has yielded the most tokens per second lately, measured; every EXPLORE_EVERY-th round tries
        another one in turn while such re-measuring stays within EXPLORE_SHARE of decoding time (a draft round
        can cost several plain ones). Non-adaptive configs always draft."""
        if not self.cfg.adaptive:
            return "draft"
        self.rounds += 1
        modes = self._modes()
        untried = [m for m in modes if self.rate[m] is None]
        if untried:
            return untried[0]
        best = self._fastest()
        explore = self.rounds % EXPLORE_EVERY == 0 and self.explore_s < EXPLORE_SHARE * self.decode_s
        if not explore or len(modes) == 1:
            return best
        others = [m for m in modes if m != best]
        return others[(self.rounds // EXPLORE_EVERY) % len(others)]

    def _modes(self) -> list[str]:
        return [m for m in self.cfg.modes if m != "draft" or self.skip is not None]

    def _fastest(self) -> str | None:
        """The round kind with the highest measured tokens/s (None until every kind has been measured)."""
        modes = self._modes()
        return None if any(self.rate[m] is None for m in modes) else max(modes, key=lambda m: self.rate[m])

    def _observe_rate(self, mode: str, tokens: int, seconds: float) -> None:
        self.rate[mode] = _ema(self.rate[mode], tokens / seconds, 0.9)

    def _step_cost(self) -> float:
        """Cost of one draft forward relative to a plain decoding step: measured on live rounds once both kinds
        have run, until then the search's cost model (timed at its start)."""
        if self.search is None or self.search.cfg.fixed_ratio is not None:
            return 0.0
        plain_rate = self.rate["plain"]  # one token per plain round: its tokens/s is 1 / its seconds
        return self.step_s * plain_rate if self.step_s and plain_rate else self.search.cost(self.skip)

    def _set_draft_vocab(self, ids: list[int]) -> None:
        """Draft over the `draft_vocab` tokens most seen so far (this prompt's always in), earlier ids first
        on ties (BPE ids roughly follow frequency). Verification still scores the whole vocabulary."""
        if self.cfg is None or not self.cfg.draft_vocab:
            return
        self.token_counts.index_add_(0, torch.tensor(ids, dtype=torch.long), torch.ones(len(ids)))
        prior = 1.0 / (1.0 + torch.arange(len(self.token_counts), dtype=torch.float32))
        score = self.token_counts + prior
        score[torch.tensor(ids)] = float("inf")
        self.sm.set_draft_vocab(torch.topk(score, min(self.cfg.draft_vocab, len(score))).indices)

    # ---- layer-set search -------------------------------------------------------------------------------
    def _start_search(self, init: SkipSet) -> None:
        self.skip = init
        if self.cfg.search is not None:
            timed = self.cfg.search.fixed_ratio is None  # SWIFT's mode scores matchness alone: no costs needed
            cost = _draft_cost(self.sm, self._sparse()) if timed else DraftCost(0.0, np.zeros(0), np.zeros(0), 0.0)
            self.search = LayerSearch(self.sm.n_layers, cost, self.cfg.search, init)

    def _search_step(self, ctx: list[int], pending: int) -> None:
        """Score one candidate skip set on the live context and adopt the best set found so far."""
        if self.sm.cache.length < 2:
            return
        candidate = self.search.propose()
        alpha = self.matchness(candidate, ctx + [pending])
        challenger = self.search.challenges(candidate, alpha)  # then score the best set on the same window
        self.search.record(candidate, alpha, self.matchness(self.search.best, ctx + [pending]) if challenger else None)
        self.skip = self.search.best

    def matchness(self, skip: SkipSet, ctx: list[int]) -> float:
        """Fraction of the last `window` cached positions where the skip model's top-1 equals the real next token.

        One forward over the window, appended after the cache and rolled back: query i sits at its real position
        s+i and sees the full model's cached entries before it (what a depth-1 draft sees) and itself.
        ctx holds the cached tokens followed by the pending one (len(ctx) == cache length + 1).
        """
        P = self.sm.cache.length
        s = max(P - self.cfg.window, 0)
        pos = torch.arange(s, P)
        hidden = self.sm.forward(ctx[s:P], pos, torch.eye(P - s, dtype=torch.bool), visible=pos, skip=skip)
        self.sm.cache.truncate(P)
        logits, ids = self.sm.draft_logits(hidden)
        pred = logits.argmax(-1) if ids is None else ids[logits.argmax(-1)]
        return float((pred.cpu() == torch.tensor(ctx[s + 1 : P + 1])).float().mean())

    # ---- text -------------------------------------------------------------------------------------------
    def _encode(self, prompt: str | list[int], chat: bool) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise UserError("prompt is empty")
            if chat:
                return self.chat_ids([{"role": "user", "content": prompt}])
            return list(self.tokenizer(prompt)["input_ids"])
        ids = [int(i) for i in prompt]
        if not ids:
            raise UserError("prompt is empty")
        vocab = self.sm.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise UserError(f"prompt token ids must lie in [0, {vocab})")
        return ids

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def check_params(max_new_tokens, temperature, top_p, top_k, stop) -> SamplingParams:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
        raise UserError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or math.isnan(temperature) or temperature < 0:
        raise UserError(f"temperature must be a number ≥ 0, got {temperature!r}")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise UserError(f"top_p must lie in (0, 1], got {top_p!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise UserError(f"top_k must be an integer ≥ 0, got {top_k!r}")
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise UserError("stop must be a list of non-empty strings")
    return SamplingParams(float(temperature), float(top_p), top_k)


def _eos_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = set(ids if isinstance(ids, list) else [ids])
    ids.add(tokenizer.eos_token_id)
    return {int(i) for i in ids if i is not None}


EXPLORE_EVERY = 8  # rate estimates of the round kinds not in use go stale; re-measure one every 8th round ...
EXPLORE_SHARE = 0.05  # ... while re-measuring takes under 5% of decoding time (measured: 14-20% before this cap)
FIRST_STEP_TOKENS = 3.0  # a search step (1-2 forwards of a 32-token window), guessed in per-token decoding time


def _ema(old: float | None, new: float, keep: float = 0.8) -> float:
    return new if old is None else keep * old + (1 - keep) * new


def _draft_cost(sm: SwiftModel, sparse: bool) -> DraftCost:
    """Each part's share of a one-token full forward's time, timed now on the cache as it is (one-token forwards
    of: the full model, the dense draft, the draft without inner MLPs and without any inner sublayer), and the
    MLP bytes read per sparsity level (level 0 only unless `sparse`). Layers are assumed alike."""
    L, P = sm.n_layers, sm.cache.length
    inner = frozenset(range(1, L - 1))

    def seconds(skip: SkipSet | None) -> float:
        best = math.inf
        for _ in range(2):
            t = time.perf_counter()
            hidden = sm.forward([0], torch.tensor([P]), torch.ones(1, 1, dtype=torch.bool), skip=skip)
            logits = sm.draft_logits(hidden)[0] if skip is not None else sm.logits(hidden)
            float(logits[0, 0])  # waits for the device (GPU kernels run asynchronously)
            best = min(best, time.perf_counter() - t)
            sm.cache.truncate(P)
        return best

    full, dense, attn_only, none = (seconds(s) for s in (None, SkipSet(), SkipSet(mlp=inner), SkipSet(inner, inner)))
    mlp = max(dense - attn_only, 0.0) / (L - 2) / full
    attn = max(attn_only - none, 0.0) / (L - 2) / full
    read = (1.0,)
    if sparse:
        roles = [(m.role, m.weight.numel()) for m in sm.skipper.layers[0].mlp.modules() if getattr(m, "role", "")]
        down = sum(n for r, n in roles if r == "down") / sum(n for _, n in roles)
        read = tuple((1 - down) * (1 - s_in) + down * (1 - s_down) for s_in, s_down in fastpath.SPARSITY_LEVELS)
    return DraftCost(max(none / full - 2 * mlp, 0.0), np.full(L - 2, attn), np.full(L - 2, mlp), 2 * mlp, read)


class _collinearity:
    """Context manager hooking every decoder layer; yields a function giving cos(layer input, layer output) [L]."""

    def __init__(self, sm: SwiftModel):
        self.sm, self.layers, self.cos, self.handles = sm, sm.skipper.layers, {}, []

    def _record(self, i: int, h_in: torch.Tensor, h_out: torch.Tensor) -> None:
        h_in, h_out = h_in.reshape(-1, h_in.shape[-1]), h_out.reshape(-1, h_out.shape[-1])
        self.cos[i] = float(torch.cosine_similarity(h_in[-64:], h_out[-64:], dim=-1).mean())

    def __enter__(self):
        def hook(i):
            def fn(module, args, kwargs, output):
                h_in = kwargs.get("hidden_states", args[0] if args else None)
                self._record(i, h_in, output[0] if isinstance(output, tuple) else output)

            return fn

        self.handles = [m.register_forward_hook(hook(i), with_kwargs=True) for i, m in enumerate(self.layers)]
        self.sm.observer = self._record  # the lean forward calls this instead of module hooks
        return lambda: np.array([self.cos.get(i, 0.0) for i in range(len(self.layers))])

    def __exit__(self, *exc):
        self.sm.observer = None
        for h in self.handles:
            h.remove()
