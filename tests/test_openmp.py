"""The OpenMP pool hand-over (kernels/openmp.py): the thread that loaded the model frees its pool, and a worker
thread then decodes exactly what the main thread decodes."""

from __future__ import annotations

import threading

from swiftdecode import Generator
from swiftdecode.kernels.openmp import release_thread_pool


def test_release_then_decode_on_another_thread(smollm):
    gen = Generator(*smollm, method="swift")
    prompt = "List five colours, one per line."
    here = gen.generate(prompt, chat=True, max_new_tokens=32).token_ids
    assert release_thread_pool()  # torch's libgomp is loaded and has omp_pause_resource_all
    there = []
    worker = threading.Thread(target=lambda: there.append(gen.generate(prompt, chat=True, max_new_tokens=32)))
    worker.start()
    worker.join()
    assert there[0].token_ids == here
    assert gen.generate(prompt, chat=True, max_new_tokens=32).token_ids == here  # the main thread's pool rebuilt
