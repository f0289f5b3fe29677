"""The soaked server's process, as `soak` sees it: started on a free port (or attached to), waited for, stopped,
and read from outside (its RSS, its /metrics)."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time

from swiftdecode.apps.server.soak_requests import Server, send
from swiftdecode.base.errors import UserError

STARTUP_S = 180  # the first start compiles kernels
STOP_GRACE_S = 10  # SIGTERM, then SIGKILL after this long
HEALTH_TIMEOUT_S = 5.0  # a /health or /metrics call that takes longer counts as unanswered


def wait_ready(srv: Server, proc: subprocess.Popen | None, log_path: str | None) -> str:
    """Wait for /health to answer 200; the served model's id."""
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = open(log_path, errors="replace").read()[-2000:] if log_path else ""
            raise UserError(f"the server exited with status {proc.returncode}:\n{tail}")
        try:
            if send(srv, "/health", None, timeout=HEALTH_TIMEOUT_S)[0] == 200:
                status, _, data = send(srv, "/v1/models", None, timeout=HEALTH_TIMEOUT_S)
                if status != 200:
                    raise UserError(f"GET /v1/models: status {status} (wrong --key?)")
                return json.loads(data)["data"][0]["id"]
        except (OSError, http.client.HTTPException):
            pass  # not listening yet
        time.sleep(1)
    raise UserError(f"the server did not answer /health within {STARTUP_S} s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def rss_mb(pid: int | None) -> float | None:
    """The resident memory (VmRSS) of the process and all its descendants (`serve --ray`: its Ray cluster and
    replicas), if known."""
    try:
        with open(f"/proc/{pid}/status") as f:
            own = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, TypeError):
        return None
    return own + sum(rss_mb(child) or 0.0 for child in children(pid))


def children(pid: int) -> list[int]:
    """The process's child processes (Linux's /proc/PID/task/TID/children)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return found


def metrics_text(srv: Server) -> str:
    """GET /metrics ("" if it does not answer)."""
    try:
        status, _, data = send(srv, "/metrics", None, timeout=HEALTH_TIMEOUT_S)
    except (OSError, http.client.HTTPException):
        return ""
    return data.decode(errors="replace") if status == 200 else ""


def metrics_5xx(srv: Server) -> dict[str, float] | None:
    """The server's own count of 5xx responses by path, if /metrics answers."""
    text = metrics_text(srv)
    found = re.findall(r'http_requests_total\{path="([^"]*)",status="(5\d\d)"\} (\S+)', text)
    return {f"{path} {code}": float(n) for path, code, n in found} if text else None


def kv_reserved_mb(srv: Server) -> float | None:
    """The KV cache the running requests hold (every replica's, on Ray), if /metrics answers: 0 once idle."""
    found = re.findall(r"^swiftdecode_kv_reserved_bytes(?:\{[^}]*\})? (\S+)$", metrics_text(srv), re.M)
    return sum(float(v) for v in found) / 2**20 if found else None


def prefix_mb(srv: Server) -> float | None:
    """The KV cache the server keeps for shared prompt prefixes (bounded by --prefix-cache-gb), if it says."""
    found = re.search(r"^swiftdecode_prefix_cache_bytes (\S+)$", metrics_text(srv), re.M)
    return float(found[1]) / 2**20 if found else None


def start_server(args: argparse.Namespace, ray: tuple[int, int] | None = None) -> tuple[subprocess.Popen, Server, str]:
    """`swiftdecode serve` on a free port with a random key, its output in a log file; `ray`: (replicas, threads)
    for `serve --ray`."""
    with socket.socket() as s:  # a free port: the kernel's pick for port 0
        s.bind(("127.0.0.1", 0))
        key, port = secrets.token_urlsafe(16), s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "swiftdecode.apps.cli",
        "serve",
        "--model",
        args.model,
        "--port",
        str(port),
        f"--api-key={key}",  # one argument: a key may begin with "-"
        "--max-batch",
        str(args.max_batch),
        *(["--ray", "--replicas", str(ray[0]), "--threads", str(ray[1])] if ray else []),
    ]
    with tempfile.NamedTemporaryFile(prefix="swiftdecode-soak-", suffix=".log", delete=False) as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    print(f"swiftdecode soak: server pid {proc.pid} on port {port}, its log in {log.name}", file=sys.stderr)
    return proc, Server("127.0.0.1", port, key, proc.pid), log.name
