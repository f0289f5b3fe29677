"""`swiftdecode serve`: its flags, the listening socket, and the uvicorn run."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from dataclasses import replace

from swiftdecode.apps.server.worker import DEFAULT_KV_GB, DEFAULT_MAX_BATCH, DEFAULT_TIMEOUT_S
from swiftdecode.base.config import COPY_POOL_TOKENS, FAST_PATH_HELP, PREFIX_CACHE_GB, preset
from swiftdecode.base.errors import UserError

GRACE_S = 5  # on shutdown, in-flight requests get this long before they are cancelled
MAX_PORT = 65535
# Open connections at most (uvicorn's limit_concurrency; beyond -> 503): the queue, the batch and their streams
# are far fewer, and /health must stay reachable, so this bounds only sockets left open by misbehaving clients.
DEFAULT_MAX_CONNECTIONS = 512


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from swiftdecode import METHODS
    from swiftdecode.apps.pull_cli import add_model_argument

    add_model_argument(parser)
    parser.add_argument("--method", default="swift", choices=METHODS, help="decoding method (default: swift)")
    parser.add_argument("--fast-path", default="auto", help=FAST_PATH_HELP)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument(
        "--max-batch",
        type=int,
        default=DEFAULT_MAX_BATCH,
        help=f"requests decoded together, one forward per round (default: {DEFAULT_MAX_BATCH})",
    )
    parser.add_argument("--max-queue", type=int, default=64, help="requests allowed to wait; beyond -> 429")
    parser.add_argument(
        "--max-kv-gb",
        type=float,
        default=DEFAULT_KV_GB,
        help="KV cache the running requests may reserve (prompt + max tokens each); a request waits for room, "
        f"one that can never fit gets 413 (default: {DEFAULT_KV_GB:g})",
    )
    parser.add_argument(
        "--prefix-cache-gb",
        type=float,
        default=PREFIX_CACHE_GB,
        help="KV cache of finished requests kept so that prompts beginning with the same tokens (system prompt, "
        f"earlier chat turns) skip their prefill, exactly; 0 = off (default: {PREFIX_CACHE_GB:g})",
    )
    parser.add_argument(
        "--copy-pool",
        type=int,
        default=COPY_POOL_TOKENS,
        help="tokens of finished requests (per API key and cache_salt) the suffix drafter may copy from; drafts "
        f"never change an answer, only its speed; 0 = off (default: {COPY_POOL_TOKENS})",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds a request may take from arrival, queue included; beyond -> 504 (default: {DEFAULT_TIMEOUT_S:g})",
    )
    add_access_arguments(parser)
    parser.add_argument(
        "--served-model-name", help="the model name clients send and responses carry (default: --model)"
    )
    parser.add_argument("--threads", type=int, help="torch and kernel threads per engine (default: torch's)")
    add_cluster_arguments(parser)
    parser.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help=f"open connections at most; beyond -> 503 (default: {DEFAULT_MAX_CONNECTIONS})",
    )


def add_access_arguments(parser: argparse.ArgumentParser) -> None:
    """Who may call the API, /metrics and the docs pages."""
    parser.add_argument(
        "--api-key",
        action="append",
        help="require 'Authorization: Bearer KEY'; repeat for several keys, each a tenant of the prefix cache "
        "(default: $SWIFTDECODE_API_KEY; none = open)",
    )
    parser.add_argument(
        "--metrics-key", help="the key /metrics asks for instead of an API key (default: any API key; none = open)"
    )
    parser.add_argument("--docs", action="store_true", help="serve FastAPI's /docs, /redoc and /openapi.json (open)")


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """`--ray` and its replica flags (apps/cluster)."""
    cluster = parser.add_argument_group("on Ray Serve (pip install 'swiftdecode[cluster]')")
    cluster.add_argument("--ray", action="store_true", help="serve on Ray Serve: replicas behind one ingress")
    cluster.add_argument("--replicas", type=int, default=1, help="with --ray: engine replicas (default: 1)")
    cluster.add_argument(
        "--max-replicas",
        type=int,
        help="with --ray: autoscale between --replicas and this many on queue depth (default: no autoscaling)",
    )
    cluster.add_argument(
        "--ray-address", help="with --ray: the Ray cluster to join (default: $RAY_ADDRESS, else a local one)"
    )


def check_args(args: argparse.Namespace) -> None:
    """The serving limits' ranges, checked before the model is loaded."""
    if args.max_queue < 0:
        raise UserError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_batch < 1:
        raise UserError(f"--max-batch must be >= 1, got {args.max_batch}")
    if not args.request_timeout > 0:
        raise UserError(f"--request-timeout must be > 0, got {args.request_timeout}")
    if not args.max_kv_gb > 0:
        raise UserError(f"--max-kv-gb must be > 0, got {args.max_kv_gb}")
    if not args.prefix_cache_gb >= 0:
        raise UserError(f"--prefix-cache-gb must be >= 0, got {args.prefix_cache_gb}")
    if args.copy_pool < 0:
        raise UserError(f"--copy-pool must be >= 0, got {args.copy_pool}")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be >= 1, got {args.threads}")
    if args.replicas < 1 or (args.max_replicas is not None and args.max_replicas < args.replicas):
        raise UserError("--replicas must be >= 1 and --max-replicas >= --replicas")
    if not args.ray and (args.replicas != 1 or args.max_replicas is not None or args.ray_address):
        raise UserError("--replicas, --max-replicas and --ray-address need --ray")
    if args.max_connections < 1:
        raise UserError(f"--max-connections must be >= 1, got {args.max_connections}")
    if not all(api_keys(args) or ()) or args.metrics_key == "":
        raise UserError("an API key must not be empty (--api-key, --metrics-key, $SWIFTDECODE_API_KEY)")


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

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    model, tokenizer = swiftdecode.load(
        args.model, cache_dir=args.cache_dir, fast_path=args.fast_path, weights=args.weights
    )
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
    }


def run(args: argparse.Namespace) -> int:
    check_args(args)
    if args.ray:
        from swiftdecode.apps.cluster.deploy import run as run_cluster

        return run_cluster(args)
    import uvicorn

    from swiftdecode.apps.server.app import create_app

    sock = listen(args.host, args.port)
    app = create_app(engine(args), model_id(args), **app_options(args))
    print(f"swiftdecode: serving {model_id(args)} ({args.method}) on http://{args.host}:{sock.getsockname()[1]}/v1")
    config = uvicorn.Config(
        app, log_level="info", timeout_graceful_shutdown=GRACE_S, limit_concurrency=args.max_connections
    )
    server = uvicorn.Server(config)
    server.run(sockets=[sock])
    if not server.started:
        raise UserError("the server did not start (see the log above)")
    return 0
