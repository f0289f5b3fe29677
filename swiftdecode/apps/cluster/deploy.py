"""`swiftdecode serve --ray`: the Ray Serve application (ingress, replicas, metrics board) and its run.

Replicas: `--replicas N` engines (`--max-replicas M`: autoscaled between N and M on their ongoing requests), each
reserving `--threads` CPUs, routed by router.AffinityRouter (Ray's prefix-affinity router, followed while the
replica has a free batch slot).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from swiftdecode.base.errors import UserError

APP_NAME = "swiftdecode"
ROUTER = "swiftdecode.apps.cluster.router:AffinityRouter"
# A request follows the replica that served the longest part of its routing text when that part is at least
# this share of it: a conversation's next turn (most of it seen before) stays, while new conversations that share
# only a chat template's system prompt (a fifth to a third of a short first turn) are spread by load.
AFFINITY_MATCH = 0.5
# Characters of routed text the router's prefix tree keeps, all replicas together (Ray's default): ~100k tokens,
# the order of what a few replicas' prefix caches hold (1 GB each by default: ~43k tokens of Qwen2.5-0.5B).
TREE_CHARS = 400_000
INGRESS_ONGOING = 4096  # requests the ingress holds at once: each replica bounds its own queue (429 beyond)
GRACE_S = 5  # as the single server: in-flight requests get this long on shutdown


def replica_threads(args: argparse.Namespace) -> int:
    """Threads (and reserved CPUs) per replica: --threads, else this machine's cores shared by --replicas."""
    return args.threads or max(1, (os.cpu_count() or 1) // args.replicas)


def scaling(args: argparse.Namespace) -> dict:
    """Ray Serve's replica-count options: fixed, or autoscaled on each replica's ongoing requests (one batch)."""
    if args.max_replicas is None or args.max_replicas == args.replicas:
        return {"num_replicas": args.replicas}
    target = {"target_ongoing_requests": args.max_batch}
    return {"autoscaling_config": {"min_replicas": args.replicas, "max_replicas": args.max_replicas, **target}}


def application(args: argparse.Namespace):
    """The bound Ray Serve application: the ingress over the replicas, both over the metrics board."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from swiftdecode.apps.cluster.board import Board
    from swiftdecode.apps.cluster.ingress import Ingress
    from swiftdecode.apps.cluster.replica import Replica

    threads = replica_threads(args)
    router = RequestRouterConfig(
        request_router_class=ROUTER,
        request_router_kwargs={
            "capacity": args.max_batch,
            "match_rate_threshold": AFFINITY_MATCH,
            "do_eviction": True,  # the tree of routed texts is bounded: least recently used text goes first
            "eviction_threshold_chars": TREE_CHARS,
            "eviction_target_chars": TREE_CHARS * 9 // 10,
        },
    )
    quiet = {"log_level": "WARNING"}  # its puts, every few seconds from each replica, are not worth a log line
    board = serve.deployment(Board, ray_actor_options={"num_cpus": 0}, logging_config=quiet).bind()
    replicas = serve.deployment(Replica).options(
        ray_actor_options={"num_cpus": threads},
        max_ongoing_requests=args.max_batch + args.max_queue,
        request_router_config=router,
        graceful_shutdown_timeout_s=GRACE_S,
        **scaling(args),
    )
    engine_args = argparse.Namespace(**{**vars(args), "threads": threads})
    ingress = serve.deployment(Ingress, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=INGRESS_ONGOING)
    return ingress.bind(replicas.bind(engine_args, board), board)


def start(args: argparse.Namespace) -> str:
    """Join (or start) the Ray cluster, deploy, and return the OpenAI base URL once every replica is ready."""
    import ray
    from ray import serve

    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    if address is None:
        cores, wanted = os.cpu_count() or 1, replica_threads(args) * (args.max_replicas or args.replicas)
        if wanted > cores:
            raise UserError(f"{wanted} threads of replicas do not fit this machine's {cores} cores (--threads)")
        ray.init(num_cpus=cores, include_dashboard=False, configure_logging=False)
    else:
        ray.init(address=address, configure_logging=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(application(args), name=APP_NAME, route_prefix="/")
    return f"http://{args.host}:{args.port}/v1"


def run(args: argparse.Namespace) -> int:
    """`serve --ray`: deploy, then serve until interrupted; Serve and a Ray started here stop with it."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise UserError("serve --ray needs Ray Serve: pip install 'swiftdecode[cluster]'") from None
    from swiftdecode.apps.server.cli import listen, model_id

    listen(args.host, args.port).close()  # fails fast, before Ray starts, if the address is taken
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a stop request shuts Serve down as Ctrl-C does
    try:
        print(f"swiftdecode: serving {model_id(args)} ({args.method}) on Ray Serve at {start(args)}")
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        return 0
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
