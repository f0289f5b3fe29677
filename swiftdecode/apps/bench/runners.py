"""The benchmarked model and prompts, and one Runner per method: our engine, HF (see `hf`), llama.cpp peers."""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import ExitStack

from swiftdecode.apps.bench import llama_server
from swiftdecode.apps.bench.hf import hf_runner
from swiftdecode.apps.bench.methods import (
    ENGINE_METHODS,
    PEER_METHODS,
    Outcome,
    Runner,
    cut_at_eos,
    peak_rss_mb,
    reset_peak_rss,
)
from swiftdecode.base.config import PREFIX_CACHE_GB
from swiftdecode.base.errors import UserError
from swiftdecode.base.text import eos_ids


def load_target(args: argparse.Namespace):
    """(model, tokenizer, fast-path info as a dict) of the benchmarked model, on the fast path."""
    from swiftdecode.apps.pull_cli import load_model

    model, tok = load_model(args)
    return model, tok, {"path": model.fast_path.path, "reason": model.fast_path.reason}


class PathSwitch:
    """Puts the model on the fast path for our engine and on stock torch for the HF methods (unless
    --hf-fast-path); switching re-patches the linear layers and re-lays out the MLP weights in place (well
    under a second, outside the timed generations)."""

    def __init__(self, model, path: str, args: argparse.Namespace):
        self.model, self.current = model, args.fast_path
        self.engine = args.fast_path if path != "torch" else "torch"
        self.hf = self.engine if args.hf_fast_path else "torch"

    def __call__(self, hf: bool) -> None:
        from swiftdecode.runtime.fastpath import accelerate

        mode = self.hf if hf else self.engine
        if mode != self.current:
            accelerate(self.model, mode)
            self.current = mode


def use_chat(tok, chat: bool | None) -> bool:
    """--chat/--no-chat, default: whether the tokenizer has a chat template."""
    has = bool(getattr(tok, "chat_template", None))
    if chat and not has:
        raise UserError("--chat: this tokenizer has no chat template")
    return has if chat is None else chat


def encode(tok, text: str, chat: bool) -> list[int]:
    """Prompt ids, shared by all methods: a user turn in the chat template, or the plain text."""
    if not chat:
        return tok(text).input_ids
    text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False).input_ids


def peer_runners(
    methods: list[str], tok, eos: set[int], args: argparse.Namespace, stack: ExitStack
) -> dict[str, Runner]:
    """Runners of the llama.cpp methods asked for whose binaries exist; says on stderr why any is left out. A
    llama-server method starts its server at its first call and `stack` stops it."""
    from swiftdecode.apps.bench import peers

    wanted = [m for m in methods if m in PEER_METHODS]
    if not wanted or (gguf := peer_gguf(wanted, args)) is None:
        return {}
    threads, out = peer_threads(args), {}
    for m in wanted:
        binary = peers.find_binary(llama_server.BINARY if m in llama_server.METHODS else peers.BINARIES[m])
        if binary is None:
            print(f"swiftdecode: skipping {m}: {peers.HOW_TO}", file=sys.stderr)
            continue
        if m in llama_server.METHODS:
            out[m] = server_runner(binary, gguf, threads, llama_server.METHODS[m], eos, args, stack)
            continue

        def call(ids: list[int], seed: int, m=m, binary=binary) -> Outcome:
            prompt = tok.decode(ids)
            text, seconds, prompt_s = peers.run_peer(m, binary, gguf, prompt, args.max_new_tokens, threads)
            new = tok(text, add_special_tokens=False).input_ids[: args.max_new_tokens]
            return Outcome(cut_at_eos(new, eos), seconds, prompt_s)

        out[m] = call
    return out


def peer_gguf(methods: list[str], args: argparse.Namespace):
    """The model's GGUF file, which the llama.cpp peers `methods` read, or None (said on stderr)."""
    from swiftdecode.hub import locate_gguf

    files = locate_gguf(args.model, cache_dir=args.cache_dir, progress=False)
    if files is None:
        print(f"swiftdecode: skipping {', '.join(methods)}: the model has no GGUF file", file=sys.stderr)
        return None
    return files[0]


def peer_threads(args: argparse.Namespace) -> int:
    """The peers' threads: --threads, or as many as ours run."""
    import torch

    return args.threads or torch.get_num_threads()


def server_runner(binary, gguf, threads: int, spec_type: str | None, eos: set[int], args, stack: ExitStack) -> Runner:
    """A llama-server method: the prompt's token ids in, the answer's ids out (no re-tokenizing)."""
    servers: list[llama_server.LlamaServer] = []

    def call(ids: list[int], seed: int) -> Outcome:
        if not servers:
            servers.append(stack.enter_context(llama_server.LlamaServer(binary, gguf, threads, spec_type)))
        new, seconds, prompt_s = servers[0].complete(ids, args.max_new_tokens)
        return Outcome(cut_at_eos(new, eos), seconds, prompt_s)

    return call


def server_replays(methods: list[str], ids: list[list[int]], args: argparse.Namespace) -> dict[str, dict]:
    """--concurrency for llama-server peers: each method's server with --concurrency slots, replayed by one
    client and by N (concurrency.replay_pairs), a fresh process for each replay; {method: result}. A method whose
    binary or GGUF is missing is left out with a word on stderr, one whose server fails is recorded as failed."""
    from swiftdecode.apps.bench import concurrency, peers

    if (gguf := peer_gguf(methods, args)) is None:
        return {}
    if (binary := peers.find_binary(llama_server.BINARY)) is None:
        print(f"swiftdecode: skipping {', '.join(methods)}: {peers.HOW_TO}", file=sys.stderr)
        return {}
    threads, out = peer_threads(args), {}
    for m in methods:
        try:
            with llama_server.LlamaServer(binary, gguf, threads, llama_server.METHODS[m], args.concurrency) as srv:
                try:
                    out[m] = concurrency.replay_pairs(
                        srv.url, srv.restart, ids, args.max_new_tokens, args.concurrency, args.pairs
                    )
                except Exception as e:  # a peer's failure costs its row: its server's last words say why
                    raise RuntimeError(f"{type(e).__name__}: {e} (llama-server's log ends: {srv.log_tail()})") from e
        except (RuntimeError, OSError) as e:
            print(f"swiftdecode bench: {m} failed: {e}", file=sys.stderr)
            out[m] = {"error": str(e)}
    return out


def make_runner(method: str, model, tok, args: argparse.Namespace, switch: PathSwitch, earlier: dict) -> Runner:
    """`earlier`: conversation ids -> its earlier turns, in our engine's prefix cache before it is timed."""
    hf = method not in ENGINE_METHODS
    run = hf_runner(method, model, tok, args) if hf else engine_runner(method, model, tok, args, earlier)

    def call(ids: list[int], seed: int) -> Outcome:
        switch(hf)
        return run(ids, seed)

    return call


def engine_runner(method: str, model, tok, args: argparse.Namespace, earlier: dict) -> Runner:
    """One Generator for the whole run, so search state carries across prompts as in a server; with a prefix
    cache where prompts have `earlier` turns (conversation ids -> those turns' ids), primed untimed."""
    from swiftdecode.apps.bench.follow_up import prime
    from swiftdecode.engine.generator import Generator

    gen = Generator(model, tok, method=method, prefix_cache_gb=PREFIX_CACHE_GB if earlier else 0.0)
    eos = eos_ids(model, tok)

    def call(ids: list[int], seed: int) -> Outcome:
        if (turns := earlier.get(tuple(ids))) is not None:
            prime(gen, turns)
        reset_peak_rss()
        t0 = time.perf_counter()
        res = gen.generate(ids, params=args.params, seed=seed, grammar=args.grammar)
        wall = time.perf_counter() - t0
        st = res.stats.to_dict()
        rounds = st["tree_rounds"] or None  # ar: no tree rounds, no acceptance
        acc = (st["mean_accepted_tokens"], st["acceptance_rate"]) if rounds else (None, None)
        opt = st["time_split"]["optimize"]
        sources = {k: st[k] for k in ("round_kinds", "round_seconds", "accepted_by_source", "cached_prompt_tokens")}
        ids, prefill = cut_at_eos(list(res.token_ids), eos), st["time_split"]["prefill"]
        return Outcome(ids, wall, prefill, rounds, *acc, opt, peak_rss_mb(), **sources)  # fields in order

    return call
