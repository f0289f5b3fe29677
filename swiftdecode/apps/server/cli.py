"""`swiftdecode serve`: its flags, the listening socket, and the uvicorn run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import uvicorn

from swiftdecode.apps.server.options import api_keys, app_options, engine, listen, model_id, tenancy_note
from swiftdecode.apps.server.protocol import check_keys
from swiftdecode.apps.server.worker import DEFAULT_KV_GB, DEFAULT_MAX_BATCH, DEFAULT_TIMEOUT_S
from swiftdecode.base.config import COPY_POOL_TOKENS, FAST_PATH_HELP, PREFIX_CACHE_GB
from swiftdecode.base.errors import UserError

GRACE_S = 5  # on shutdown, in-flight requests get this long before they are cancelled
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
    parser.add_argument(
        "--response-stats",
        action="store_true",
        help="responses carry the engine's statistics ('swiftdecode': rounds, copies accepted, timings); they tell a "
        "caller how its tenant's copy pool served it, so they are off by default",
    )


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
    keys = [*(api_keys(args) or ()), *([args.metrics_key] if args.metrics_key is not None else [])]
    try:
        check_keys(keys)
    except UserError as e:
        raise UserError(f"{e} (--api-key, --metrics-key, $SWIFTDECODE_API_KEY)") from None


class DrainingServer(uvicorn.Server):
    """uvicorn's Server whose stop signal first drains the generation worker (`drain`: Worker.drain's): requests
    still generating GRACE_S - 1 s later end with 503 (a stream with an error event and [DONE]) before uvicorn, at
    GRACE_S, would cut them off mid-stream."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[float], None]):
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig, frame) -> None:
        self.drain(GRACE_S - 1)
        super().handle_exit(sig, frame)


def run(args: argparse.Namespace) -> int:
    check_args(args)
    if args.ray:
        from swiftdecode.apps.cluster.deploy import run as run_cluster

        return run_cluster(args)
    from swiftdecode.apps.server.app import create_app

    sock = listen(args.host, args.port)
    if note := tenancy_note(args):
        print(note, file=sys.stderr)
    app = create_app(engine(args), model_id(args), **app_options(args))
    print(f"swiftdecode: serving {model_id(args)} ({args.method}) on http://{args.host}:{sock.getsockname()[1]}/v1")
    config = uvicorn.Config(
        app, log_level="info", timeout_graceful_shutdown=GRACE_S, limit_concurrency=args.max_connections
    )
    server = DrainingServer(config, app.state.api.drain)
    server.run(sockets=[sock])
    if not server.started:
        raise UserError("the server did not start (see the log above)")
    return 0
