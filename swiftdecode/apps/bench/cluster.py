"""`bench --concurrency N --ray RxT`: the same replays through `serve --ray` (R replicas of T threads on a local
Ray cluster), beside our single server: what the distribution layer costs or gains."""

from __future__ import annotations

import argparse
import socket
import statistics

from swiftdecode.apps.bench import concurrency
from swiftdecode.apps.bench.concurrency import MODEL_ID


def serve_args(args: argparse.Namespace, method: str, queue: int, replicas: int, threads: int) -> argparse.Namespace:
    """`serve --ray`'s arguments for the bench's model, method and batching, on a free local port."""
    from swiftdecode.apps.server.cli import add_arguments, check_args

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["--model", args.model, "--method", method, "--weights", args.weights, "--fast-path", args.fast_path]
    argv += ["--act-block", str(args.act_block)]
    argv += ["--ray", "--replicas", str(replicas), "--threads", str(threads), "--port", str(port)]
    argv += ["--max-batch", str(args.max_batch), "--max-queue", str(queue), "--served-model-name", MODEL_ID]
    argv += ["--cache-dir", args.cache_dir] if args.cache_dir else []
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parsed = parser.parse_args(argv)
    check_args(parsed)
    return parsed


def run(args, method: str, ids: list[list[int]], single: list[str | None], replicas: int, threads: int) -> dict:
    """One client, then `--concurrency` at once, through fresh replicas each time (redeployed: no prefix cache
    or copy pool carried over from the other replay): one pair of a round (`cli.ray_rounds`);
    `identical_to_single_server`: its concurrent answers equal to `single` (our single server's
    one-client answers). A failure is the result's `error`, as a peer's."""
    import ray
    from ray import serve

    from swiftdecode.apps.cluster.deploy import APP_NAME, application, start

    try:
        sargs = serve_args(args, method, max(len(ids), 1), replicas, threads)
        url = start(sargs).removesuffix("/v1")

        def fresh() -> str:
            serve.delete(APP_NAME)
            serve.run(application(sargs), name=APP_NAME, route_prefix="/")
            return url

        result = concurrency.replay_pairs(url, fresh, ids, args.max_new_tokens, args.concurrency, 1)
    except Exception as e:  # reported in the table, as a peer's failure
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
    same = sum(a.get("text") == s for a, s in zip(result["concurrent"]["answers"], single, strict=True))
    return {"replicas": replicas, "threads": threads, "identical_to_single_server": same, **result}


def against(single: list[dict], rounds: list[dict]) -> dict:
    """A shape's rounds (`run` results, one pair each) beside the single server's of the same rounds, as one
    result: `against_single` is each round's N-client aggregate over the single server's, `against_single_median`
    their median; `identical_to_single_server` counts over every round's N-client answers."""
    ratios = [
        r["concurrent"]["aggregate_tokens_per_s"] / s["concurrent"]["aggregate_tokens_per_s"]
        for s, r in zip(single, rounds, strict=True)
    ]
    return {
        **concurrency.combined(rounds),
        "identical_to_single_server": sum(r["identical_to_single_server"] for r in rounds),
        "against_single": ratios,
        "against_single_median": statistics.median_low(ratios),
    }
