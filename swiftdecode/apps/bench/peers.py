"""llama.cpp as a peer in `swiftdecode bench`: its plain decoding (`llama-completion`) and its n-gram lookup
speculation (`llama-lookup`) on the same GGUF file, threads, prompt and token budget, greedy.

The binaries are not a dependency: they are found through $SWIFTDECODE_LLAMA_CPP (a folder), the folder that
`../shared/tools/llama-cpp-peer.sh` builds (~/.cache/llama-cpp-peer), or PATH. Time is llama.cpp's own
prompt + decode time (model loading excluded, as for our methods); the output text is re-tokenized with the
model's tokenizer for counting and for the agreement with `ar` (llama.cpp's numerics are its own).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

BINARIES = {"llama.cpp": "llama-completion", "llama.cpp-lookup": "llama-lookup"}
HOW_TO = (
    "llama.cpp binaries not found: build them with ../shared/tools/llama-cpp-peer.sh (or pip download the "
    "llama-cpp-python==0.3.36 sdist and build vendor/llama.cpp) and set SWIFTDECODE_LLAMA_CPP to their folder"
)
CONTEXT = 4096  # tokens of context a llama.cpp peer gets (per slot on llama-server): room for any bench prompt
# On a 2-vCPU Intel Xeon (Emerald Rapids) whose hypervisor reports AMX but does not enable its tile state,
# llama.cpp's repacked weights go to ggml's AMX kernel, whose first `ldtilecfg` kills the process (SIGSEGV).
# A peer killed by a signal is run once more with its weights as they are in the file.
NO_REPACK = "--no-repack"
_PERF = re.compile(r"(prompt eval|eval) time =\s*([\d.]+) ms")
_LOOKUP = re.compile(r"(encoded|decoded)\s+\d+ tokens in\s+([\d.]+) seconds")


def find_binary(name: str) -> Path | None:
    """The llama.cpp executable `name` (e.g. BINARIES[method], "llama-server"), or None."""
    folders = [os.environ.get("SWIFTDECODE_LLAMA_CPP")]
    folders += [str(p) for p in sorted(Path.home().glob(".cache/llama-cpp-peer/*/vendor/llama.cpp/build/bin"))]
    for folder in filter(None, folders):
        path = Path(folder) / name
        if path.is_file() and os.access(path, os.X_OK):
            return path
    found = shutil.which(name)
    return Path(found) if found else None


def run_peer(
    method: str, binary: Path, gguf: Path, prompt: str, max_new_tokens: int, threads: int
) -> tuple[str, float, float]:
    """(generated text, seconds of prompt + decode, seconds of the prompt alone, as llama.cpp reports them) for one
    greedy generation."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt)
    try:
        cmd = [str(binary), "-m", str(gguf), "-bf", f.name, "-n", str(max_new_tokens), "--temp", "0"]
        cmd += ["-t", str(threads), "-c", str(CONTEXT)]
        if method == "llama.cpp":
            cmd += ["-no-cnv", "--no-display-prompt", "--no-warmup"]
        proc = subprocess.run(cmd, capture_output=True, timeout=600)  # bytes: a token may split a character
        if proc.returncode < 0:  # killed by a signal: see NO_REPACK
            proc = subprocess.run([*cmd, NO_REPACK], capture_output=True, timeout=600)
    finally:
        os.unlink(f.name)
    text, err = (out.decode("utf-8", errors="replace") for out in (proc.stdout, proc.stderr))
    if proc.returncode != 0:
        tail = (err.strip().splitlines() or ["?"])[-1]
        raise RuntimeError(f"{binary.name} failed ({proc.returncode}): {tail}")
    if method == "llama.cpp":
        times = {what: float(ms) / 1000 for what, ms in _PERF.findall(err)}
        prompt_s = times.get("prompt eval", 0.0)
    else:
        times = {what: float(s) for what, s in _LOOKUP.findall(err)}
        prompt_s = times.get("encoded", 0.0)
        text = text.split(prompt, 1)[-1] if prompt in text else text  # llama-lookup echoes the prompt
    return text, sum(times.values()), prompt_s
