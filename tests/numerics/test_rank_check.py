"""Ranks compare each compiled graph's collectives on its first call (2 gloo ranks, eager kernels)."""

import dataclasses

import pytest

from fsdp_graph.compiler import rank_check
from fsdp_graph.train.launch import RankFailedError, spawn
from tests.numerics.test_strategies import FP32_TOL
from tests.workers.training import Case, CaseResult, run_case

# Rank 1 buckets every unit's collectives into one; rank 0 issues one per unit: the sequences differ.
DIVERGENT_BUCKET_BYTES = 1 << 20


def train_counting_exchanges(rank: int, world: int, case: Case) -> tuple[CaseResult, int]:
    exchanges = 0
    gather = rank_check._gather_digests

    def counted(*args, **kwargs):
        nonlocal exchanges
        exchanges += 1
        return gather(*args, **kwargs)

    rank_check._gather_digests = counted
    return run_case(case, rank, world), exchanges


def train_divergent(rank: int, world: int, verify: bool, differs: str = "bucket_bytes") -> str:
    """Rank 1 compiles with another bucket size (forward and backward differ) or strategy (the backward differs);
    returns the error this rank raised."""
    case = Case("gpt", "sgd", verify_collectives=verify)
    if rank == 1 and differs == "bucket_bytes":
        case = dataclasses.replace(case, bucket_bytes=DIVERGENT_BUCKET_BYTES)
    elif rank == 1:
        case = dataclasses.replace(case, strategy="SHARD_GRAD_OP")
    try:
        run_case(case, rank, world)
    except rank_check.CollectiveMismatchError as error:
        return str(error)
    return "trained"


def test_matching_ranks_train_and_check_once():
    (result, exchanges), _ = spawn(train_counting_exchanges, 2, (Case("gpt", "sgd", steps=4),))
    assert result.max_param_diff < FP32_TOL and result.param_change > 1e-3, result
    # One 32-byte all-gather for the one compiled graph (its forward and backward), on the first call only.
    assert result.dynamo_graphs == 1 and exchanges == 1
    assert [r.stage for r in result.reports] == ["fw", "bw"] and all(r.fingerprint for r in result.reports)


def test_divergent_rank_raises_on_every_rank():
    messages = spawn(train_divergent, 2, (True,), timeout_s=120)
    assert messages[0] == messages[1], messages  # every rank names the same difference
    assert "graph 'fw 0' collective #1 (3 vs 1 collectives): rank 0 all_gather_into_tensor(" in messages[0]
    assert " vs rank 1 all_gather_into_tensor(" in messages[0] and "verify_collectives=False" in messages[0]


def test_rank_diverging_in_the_backward_only_raises_before_it_runs():
    """SHARD_GRAD_OP on rank 1 keeps the gathered weights for the backward: the same forward, a backward without
    re-gathers. The backward is compiled with the forward, so the first forward names it."""
    messages = spawn(train_divergent, 2, (True, "strategy"), timeout_s=120)
    assert messages[0] == messages[1], messages
    assert "graph 'bw 0' collective #1 (6 vs 3 collectives): rank 0 all_gather_into_tensor(" in messages[0]
    assert " vs rank 1 all_to_all_single(" in messages[0], messages[0]


def test_divergent_rank_without_the_check_fails_elsewhere():
    """What the check prevents: unchecked, the mismatched collectives fail inside the graph (or hang until the
    launcher's timeout), never with a message naming the graph."""
    with pytest.raises(RankFailedError) as failed:
        spawn(train_divergent, 2, (False,), timeout_s=60)
    assert "collective #" not in str(failed.value)
