"""The launcher every multi-rank test relies on: a failing rank ends the run with its own error, no hang."""

import time

import pytest
import torch.distributed as dist

from fsdp_graph.train.launch import RankFailedError, spawn


def _fails_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 would wait here forever if the failure did not end it


def _returns_rank(rank: int, world: int) -> int:
    return rank * 10


def test_results_come_back_per_rank():
    assert spawn(_returns_rank, 3) == [0, 10, 20]


def test_failure_on_one_rank_ends_all_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="^rank 1 failed first:\n(.|\n)*ValueError: boom on rank 1") as info:
        spawn(_fails_on_rank_1, 2, timeout_s=60)
    assert info.value.rank == 1
    assert time.monotonic() - start < 30
