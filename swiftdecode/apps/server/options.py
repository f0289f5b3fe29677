"""What `serve` (and each replica of `serve --ray`) makes of its checked arguments: the API keys, the listening
socket, the engine, the app's options and the served name. Shared by apps/server/cli.py and apps/cluster, which
import it (and not each other's command line)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
from dataclasses import replace

from swiftdecode.base.config import preset
from swiftdecode.base.errors import UserError

MAX_PORT = 65535


def api_keys(args: argparse.Namespace) -> list[str] | None:
    """The --api-key flags, else $SWIFTDECODE_API_KEY, else None (an open server)."""
    env = os.environ.get("SWIFTDECODE_API_KEY")
    return args.api_key or ([env] if env is not None else None)


def listen(host: str, port: int) -> socket.socket:
    """A bound TCP socket (fails fast, before loading the model, if the address is taken)."""
    if not 0 <= port <= MAX_PORT:
        raise UserError(f"--port must be in 0..{MAX_PORT}, got {port}")
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def engine(args: argparse.Namespace):
    """The Generator `serve` runs: the model loaded on the fast path, the method's preset with the copy pool."""
    import swiftdecode
    from swiftdecode.apps.pull_cli import load_model

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args)
    config = replace(preset(args.method), copy_pool=args.copy_pool) if args.method != "ar" else None
    gen = swiftdecode.Generator(model, tokenizer, args.method, config, prefix_cache_gb=args.prefix_cache_gb)
    if args.prefix_cache_gb > 0 and not gen.memory()["prefix_budget"]:
        print("swiftdecode: no prefix cache on this model's forward path (needs the skinny kernels)", file=sys.stderr)
    return gen


def model_id(args: argparse.Namespace) -> str:
    """The name the API serves the model under."""
    return args.served_model_name or args.model


def app_options(args: argparse.Namespace) -> dict:
    """`create_app`'s keyword arguments: the serving limits and access."""
    return {
        "max_queue": args.max_queue,
        "max_batch": args.max_batch,
        "timeout_s": args.request_timeout,
        "kv_gb": args.max_kv_gb,
        "api_key": api_keys(args),
        "metrics_key": args.metrics_key,
        "docs": args.docs,
        "response_stats": args.response_stats,
    }


def tenancy_note(args: argparse.Namespace) -> str | None:
    """What a server reachable beyond this machine without API keys shares between its callers, said at start."""
    if api_keys(args) is not None or is_loopback(args.host):
        return None
    return (
        f"swiftdecode: serving on {args.host} without --api-key: every caller is one tenant, sharing the prefix "
        "cache and the copy pool (a caller's 'user' or 'cache_salt' separates only callers that send one)"
    )


def is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except (OSError, ValueError):
        return False
