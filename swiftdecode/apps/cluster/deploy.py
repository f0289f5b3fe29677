"""`swiftdecode serve --ray`: the Ray Serve application (ingress, replicas, metrics board) and its run.

Replicas: `--replicas N` engines (`--max-replicas M`: autoscaled between N and M on their ongoing requests), each
reserving `--threads` CPUs, routed by router.AffinityRouter (Ray's prefix-affinity router, followed while the
replica has a free batch slot).
"""

from __future__ import annotations

import argparse
import os
import signal
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
# Requests a replica takes beyond its batch and queue (--max-batch + --max-queue), which its server answers with
# its own 429 (Retry-After) at once: without them Ray would hold the overflow at the ingress, and the single
# server's 429 would never come.
OVERFLOW_SLOTS = 4
GRACE_S = 5  # as the single server: in-flight requests get this long on shutdown
# How often a stopping replica looks for requests still in flight (Ray's default, 2 s, made a stop of idle
# replicas take ~9 s; the stop must end within 10 s of Ctrl-C).
DRAIN_POLL_S = 0.25
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # either stops Serve, and a Ray started here, cleanly


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
    from swiftdecode.apps.cluster.ingress import Gate, Ingress
    from swiftdecode.apps.cluster.replica import Replica
    from swiftdecode.apps.server.options import api_keys, model_id

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
    drain = {"graceful_shutdown_wait_loop_s": DRAIN_POLL_S}
    board = serve.deployment(Board, ray_actor_options={"num_cpus": 0}, logging_config=quiet, **drain).bind()
    replicas = serve.deployment(Replica).options(
        ray_actor_options={"num_cpus": threads},
        max_ongoing_requests=args.max_batch + args.max_queue + OVERFLOW_SLOTS,
        request_router_config=router,
        graceful_shutdown_timeout_s=GRACE_S,
        **drain,
        **scaling(args),
    )
    engine_args = argparse.Namespace(**{**vars(args), "threads": threads})
    no_cpu = {"ray_actor_options": {"num_cpus": 0}}
    ingress = serve.deployment(Ingress, **no_cpu, max_ongoing_requests=INGRESS_ONGOING, **drain)
    keys = api_keys(args)
    gate = Gate(tuple(keys) if keys else None, args.metrics_key, model_id(args), args.request_timeout)
    return ingress.bind(replicas.bind(engine_args, board), board, gate)


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
    from swiftdecode.apps.server.options import listen, model_id

    listen(args.host, args.port).close()  # fails fast, before Ray starts, if the address is taken
    for sig in STOP_SIGNALS:  # set, not inherited: a shell starts background jobs with SIGINT ignored
        signal.signal(sig, stop)
    try:
        print(f"swiftdecode: serving {model_id(args)} ({args.method}) on Ray Serve at {start(args)}")
        while True:
            time.sleep(1)
    except Stopped:
        return 0
    finally:
        for sig in STOP_SIGNALS:  # the shutdown runs to its end (bounded by GRACE_S): no Ray process is left
            signal.signal(sig, signal.SIG_IGN)
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()


class Stopped(Exception):
    """SIGINT (Ctrl-C) or SIGTERM reached `serve --ray`."""


def stop(signum: int, frame) -> None:
    raise Stopped(signal.Signals(signum).name)
