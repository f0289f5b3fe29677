"""llama.cpp's server as a peer in `swiftdecode bench`: plain decoding and each of its draft-free speculative
types (`--spec-type`), on the same GGUF file, threads, prompt token ids and token budget, greedy.

One `llama-server` process per method, started before the method's first prompt and stopped when the bench
ends (model loading excluded, as for our methods). Each prompt is one `/completion` request carrying the prompt's
token ids (llama.cpp reads the vocabulary from the same GGUF, so it reads exactly our prompt) with
`cache_prompt` off (every prompt read from scratch, as our bench does); the answer's token ids come back with it.
Time is the server's own `timings` (prompt + generation ms), so HTTP and JSON are not counted against it. In
`--concurrency N` mode the same server runs N parallel slots (`-np N`) and the replay goes through its
OpenAI-compatible `/v1/completions`, as it does through ours; each replay gets a fresh process (`restart`), as
ours gets an empty prefix cache, so no replay reuses the prompts or n-gram pools of the one before it.
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

from swiftdecode.apps.bench.peers import CONTEXT, NO_REPACK

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
        self.args = [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "--host", "127.0.0.1"]
        self.args += ["-np", str(parallel), "-c", str(CONTEXT * parallel), "--no-webui"]
        if spec_type is not None:
            self.args += ["--spec-type", spec_type]
        self.log = tempfile.NamedTemporaryFile(prefix="swiftdecode-llama-server-", suffix=".log", delete=False)
        self.repack, self.proc = True, None  # repack: its weights repacked for its fastest kernels (the default)
        try:
            self._launch()
        except BaseException:
            self.close()
            raise

    def _launch(self) -> None:
        """Start the server on a free port and wait until it answers; where a signal kills it on the way, once
        more with --no-repack (see peers.NO_REPACK), and from then on."""
        for repack in (True, False) if self.repack else (False,):
            self.repack, port = repack, free_port()
            self.url = f"http://127.0.0.1:{port}"
            cmd = [*self.args, "--port", str(port), *([] if repack else [NO_REPACK])]
            self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            if self._wait_ready():
                return
            if repack:
                print("swiftdecode bench: llama-server was killed at start; retrying with --no-repack", file=sys.stderr)
        raise RuntimeError(f"llama-server was killed by a signal at start: {self.log_tail()}")

    def restart(self) -> str:
        """A fresh process (nothing kept from earlier requests: cached prompts, n-gram pools); its URL."""
        self._stop()
        self._launch()
        return self.url

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

    def _stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def close(self) -> None:
        self._stop()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
