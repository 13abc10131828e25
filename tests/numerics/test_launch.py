"""The launcher every multi-rank test relies on: a failing rank ends the run with its own error, no hang."""

import ctypes
import gc
import sys
import time

import pytest
import torch.distributed as dist

from fsdp_graph.train.launch import GLOO_THREADS_ENV, START_METHOD_ENV, RankFailedError, spawn


def _fails_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 would wait here forever if the failure did not end it


def _read_address_zero() -> None:
    ctypes.string_at(0)


def _crashes_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        _read_address_zero()
    dist.barrier()


def _returns_rank(rank: int, world: int) -> int:
    return rank * 10


def _writes_to_both_streams(rank: int, world: int) -> tuple[int, int, bool]:
    print(f"rank {rank} to stdout", flush=True)
    print(f"rank {rank} to stderr", file=sys.stderr, flush=True)
    return rank, gc.get_freeze_count(), gc.isenabled()


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_ranks_write_to_the_callers_streams(method, monkeypatch, capfd):
    """Under spawn a rank inherits the caller's descriptors under their own numbers: re-pointing stdout at itself
    once closed it, and the main job's progress bar died on its first write (EBADF). Each rank starts with what it
    inherited or imported (torch: several hundred thousand objects) frozen out of the cyclic collector's scans, and
    the collector on."""
    monkeypatch.setenv(START_METHOD_ENV, method)
    results = spawn(_writes_to_both_streams, 2)
    assert [r[0] for r in results] == [0, 1]
    for _, frozen, collecting in results:
        assert frozen > 100_000 and collecting, (frozen, collecting)
    out, err = capfd.readouterr()
    for rank in range(2):
        assert f"rank {rank} to stdout" in out and f"rank {rank} to stderr" in err, (out, err)


def test_results_come_back_per_rank():
    assert spawn(_returns_rank, 3) == [0, 10, 20]


def test_failure_on_one_rank_ends_all_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="^rank 1 failed first:\n(.|\n)*ValueError: boom on rank 1") as info:
        spawn(_fails_on_rank_1, 2, timeout_s=60)
    assert info.value.rank == 1
    assert time.monotonic() - start < 30


def test_a_native_crash_is_reported_with_the_ranks_python_stack():
    """A SIGSEGV leaves no traceback; faulthandler's stack of the crashing rank says where it happened."""
    with pytest.raises(RankFailedError, match="^rank 1 failed first:\nthe process was killed by SIGSEGV") as info:
        spawn(_crashes_on_rank_1, 2, timeout_s=60)
    assert info.value.signal == "SIGSEGV", info.value
    message = str(info.value)
    stacks = message[message.index("Its Python stacks at the crash (faulthandler):") :]
    assert "_read_address_zero" in stacks and "_crashes_on_rank_1" in stacks, message


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_malformed_gloo_thread_count_fails_before_any_rank_starts(monkeypatch, value):
    monkeypatch.setenv(GLOO_THREADS_ENV, value)
    with pytest.raises(ValueError, match=f"^{GLOO_THREADS_ENV}='{value}': give the number of worker threads"):
        spawn(_returns_rank, 2)
