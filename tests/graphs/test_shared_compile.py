"""A rank waiting for another rank's compile (issue 36) never waits forever: the compiling rank's error, its silence
or the job's timeout ends the wait with an error naming it (one process, an in-memory store)."""

import json
import threading
import time

import pytest
import torch
import torch.distributed as dist

from fsdp_graph.compiler.shared_compile import CompileSharing, SharedCompileError

BASE = "fsdp_graph/compile/test/key"


def test_the_compiling_ranks_error_ends_the_wait_at_once():
    store = dist.HashStore()
    sharing = CompileSharing(timeout_s=60, stale_s=60)
    with pytest.raises(RuntimeError, match="boom"):
        sharing._compile_for_all(store, BASE, "key", lambda: (_ for _ in ()).throw(RuntimeError("boom")), dict)
    start = time.monotonic()
    with pytest.raises(SharedCompileError, match=r"rank 1, which compiles graph 7 .* failed: RuntimeError: boom"):
        sharing._wait_for(store, BASE, 1, "graph 7")
    assert time.monotonic() - start < 5


def test_a_silent_compiling_rank_ends_the_wait():
    """No heartbeat (its process ended without a word): the waiting rank gives up after `stale_s`."""
    start = time.monotonic()
    with pytest.raises(SharedCompileError, match=r"rank 3, which compiles graph 0 .* no sign of life"):
        CompileSharing(timeout_s=60, stale_s=0.5)._wait_for(dist.HashStore(), BASE, 3, "graph 0")
    assert time.monotonic() - start < 5


def test_a_live_compiling_rank_is_waited_for_until_the_jobs_timeout():
    store, stop = dist.HashStore(), threading.Event()

    def beat():
        while not stop.wait(0.05):
            store.add(f"{BASE}/alive", 1)

    thread = threading.Thread(target=beat)
    thread.start()
    start = time.monotonic()
    try:
        with pytest.raises(SharedCompileError, match=r"did not finish within the job's timeout \(1 s"):
            CompileSharing(timeout_s=1, stale_s=0.5)._wait_for(store, BASE, 2, "graph 0")
    finally:
        stop.set()
        thread.join()
    assert 1 <= time.monotonic() - start < 5


def test_published_files_are_fetched():
    """The waiting rank takes the entries, the reports and the kernel libraries it lacks."""
    from fsdp_graph.compiler.compiled_files import machine_id

    store = dist.HashStore()
    store.set(f"{BASE}/artifacts", b"entries")
    store.set(f"{BASE}/kernel/0", b"library")
    meta = {"torch": torch.__version__, "machine": machine_id(), "kernels": ["zz/cnotthere.main.so"]}
    published = {"reports": {"rank": 0, "reports": [{"stage": "fw"}]}}
    store.set(f"{BASE}/meta", json.dumps({**meta, "artifacts": True, **published}))
    files, meta = CompileSharing(timeout_s=5)._wait_for(store, BASE, 0, "graph 0")
    assert (files.artifacts, files.kernels, meta["reports"]) == (
        b"entries",
        {"zz/cnotthere.main.so": b"library"},
        published["reports"],
    )
