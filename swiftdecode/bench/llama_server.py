"""llama.cpp's server as a peer in `swiftdecode bench`: plain decoding and each of its draft-free speculative
types (`--spec-type`), on the same GGUF file, threads, prompt token ids and token budget, greedy.

One `llama-server` process per method, started before the method's first prompt and stopped when the bench
ends (model loading excluded, as for our methods). Each prompt is one `/completion` request carrying the prompt's
token ids (llama.cpp reads the vocabulary from the same GGUF, so it reads exactly our prompt) with
`cache_prompt` off (every prompt read from scratch, as our bench does); the answer's token ids come back with it.
Time is the server's own `timings` (prompt + generation ms), so HTTP and JSON are not counted against it. In
`--concurrency N` mode the same server runs N parallel slots (`-np N`) and the replay goes through its
OpenAI-compatible `/v1/completions`, as it does through ours.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from swiftdecode.peers import CONTEXT, NO_REPACK

SPEC_TYPES = (
    "ngram-mod",
    "ngram-map-k",
    "ngram-map-k4v",
    "ngram-simple",
    "ngram-cache",
)  # llama-server's draft-free drafters
METHODS = {"llama-server": None, **{f"llama-server-{t}": t for t in SPEC_TYPES}}  # method -> its --spec-type
BINARY = "llama-server"
STARTUP_S = 120  # loading a 1.5B GGUF and warming up takes ~5-20 s on 2 cores
REQUEST_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A running `llama-server` on a free local port; `close()` (or the with-block's end) stops it."""

    def __init__(self, binary: Path, gguf: Path, threads: int, spec_type: str | None, parallel: int = 1):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "-np", str(parallel), "-c", str(CONTEXT * parallel), "--no-webui"]
        if spec_type is not None:
            cmd += ["--spec-type", spec_type]
        self.log = tempfile.NamedTemporaryFile(prefix="swiftdecode-llama-server-", suffix=".log", delete=False)
        self.repack, self.proc = True, None  # repack: its weights repacked for its fastest kernels (the default)
        try:
            if not self._start(cmd):  # killed by a signal while warming up: see peers.NO_REPACK
                print("swiftdecode bench: llama-server was killed at start; retrying with --no-repack", file=sys.stderr)
                self.repack = False
                if not self._start([*cmd, NO_REPACK]):
                    raise RuntimeError(f"llama-server was killed by a signal at start: {self.log_tail()}")
        except BaseException:
            self.close()
            raise

    def _start(self, cmd: list[str]) -> bool:
        """Start the server process; True once it answers /health, False if a signal killed it on the way."""
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return self._wait_ready()

    def _wait_ready(self) -> bool:
        """True once /health answers 200; False if a signal killed the process."""
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if (rc := self.proc.poll()) is not None:
                if rc < 0:
                    return False
                raise RuntimeError(f"llama-server exited with status {rc}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return True
            except (OSError, urllib.error.URLError):
                pass  # not listening yet, or 503 while loading
            time.sleep(0.5)
        raise RuntimeError(f"llama-server did not answer /health within {STARTUP_S} s: {self.log_tail()}")

    def log_tail(self) -> str:
        self.log.flush()
        text = Path(self.log.name).read_bytes().decode("utf-8", errors="replace").strip().splitlines()
        return text[-1] if text else "(no output)"

    def complete(self, ids: list[int], max_tokens: int) -> tuple[list[int], float, float]:
        """(generated token ids, seconds of prompt + generation, seconds of the prompt) of one greedy answer, as
        the server's own timings report them."""
        body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0, "top_k": 1, "cache_prompt": False}
        body |= {"return_tokens": True, "stream": False}
        req = urllib.request.Request(
            f"{self.url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
                out = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"llama-server answered {e.code}: {e.read()[:300]!r}") from e
        t = out["timings"]
        return list(out["tokens"]), (t["prompt_ms"] + t["predicted_ms"]) / 1e3, t["prompt_ms"] / 1e3

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
