"""`swiftdecode serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one Generator.

One model, one `Generator`, one worker thread decoding the running requests together. Modules: `protocol`
(the OpenAI wire format), `metrics` (Prometheus), `worker` (queue and batch), `app` (FastAPI routes), `cli`.
The Generator's layer-skip search state is shared by all requests.
"""

from __future__ import annotations

from importlib import import_module


def __getattr__(name: str):
    """`create_app` is imported on first use, so `swiftdecode --help` does not pay for FastAPI."""
    if name == "create_app":
        return import_module("swiftdecode.apps.server.app").create_app
    raise AttributeError(name)
