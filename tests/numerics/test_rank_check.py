"""Ranks compare each compiled graph's collectives on its first call (2 gloo ranks, eager kernels)."""

import dataclasses
import time

import pytest

from fsdp_graph.compiler import rank_check
from fsdp_graph.train.launch import RankFailedError, spawn
from tests.numerics.test_strategies import FP32_TOL
from tests.workers.training import Case, CaseResult, run_case, run_cases

# Rank 1 buckets every unit's collectives into one; rank 0 issues one per unit: the sequences differ.
DIVERGENT_BUCKET_BYTES = 1 << 20
# Above the ranks' compile skew at the first graph, where every rank waits for the others; the wait costs the suite no
# CPU and these tests run beside the rank tests (tests/conftest.py), on a machine busier than alone.
LONE_TIMEOUT_S = 30.0


class CountingStore:
    """The default store, counting the operations the rank check sends to it."""

    def __init__(self, store):
        self.store, self.ops = store, 0

    def __getattr__(self, name: str):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.ops += 1
            return method(*args, **kwargs)

        return counted


def train_counting_store_ops(rank: int, world: int, cases: list[Case]) -> tuple[list[CaseResult], list[int]]:
    """`cases`, and the store operations of each compiled graph's check on this rank."""
    store = CountingStore(rank_check._default_store())
    rank_check._default_store = lambda: store
    per_check = []
    verify = rank_check.RankAgreement.verify

    def counted(self, graphs):
        before = store.ops
        try:
            return verify(self, graphs)
        finally:
            per_check.append(store.ops - before)

    rank_check.RankAgreement.verify = counted
    return run_cases(rank, world, cases), per_check


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


def test_lone_recompile_with_the_same_collectives_trains_like_one_process():
    """Rank 1 alone gets a shorter sequence at step 3 and recompiles: the same collectives, so its check passes
    without waiting for rank 0 (which compiles nothing then); training matches one process, and bit for bit the
    same run unchecked. The check talks to the store, never through a collective rank 0 would have to join (it
    did: gloo aborted rank 1)."""
    case = Case("gpt", "sgd", steps=4, lone_recompile="shorter")
    unchecked = dataclasses.replace(case, verify_collectives=False)
    ([first, first_unchecked], first_ops), ([lone, lone_unchecked], lone_ops) = spawn(
        train_counting_store_ops, 2, ([case, unchecked],)
    )
    for result, same in ((first, first_unchecked), (lone, lone_unchecked)):
        assert result.max_param_diff < FP32_TOL and result.param_change > 1e-3, result
        assert (result.losses, result.max_param_diff) == (same.losses, same.max_param_diff)
    assert first.dynamo_graphs == 1 and lone.dynamo_graphs == 2
    assert [r.stage for r in lone.reports] == ["fw", "bw", "fw", "bw"] and all(r.fingerprint for r in lone.reports)
    # The first graph: the mismatch check, publish or compare, count in, wait, read the result (5 ops), plus one
    # for the rank that published the lists and one for the rank that completed the count; the recompile: the
    # mismatch check alone. Constant in the world size: no operation per peer.
    assert first_ops[0] + lone_ops[0] == 12 and max(first_ops[0], lone_ops[0]) <= 7, (first_ops, lone_ops)
    assert first_ops[1:] == [] and lone_ops[1:] == [1], (first_ops, lone_ops)


def test_lone_recompile_with_other_collectives_fails_every_rank_clearly():
    """Rank 1 alone enters no_sync at step 3: its recompiled backward reduces nothing. It waits for rank 0 to
    compile the same, which never comes (rank 0 runs its graph and waits in its first gather), and raises after
    `verify_timeout_s`; rank 0's gather fails when rank 1's process ends, and it raises the mismatch rank 1
    recorded in the store: the same text, no native abort, no hang. (The launcher may still end rank 0 after it
    raised: its teardown can outlast the launcher's 2 s grace on a loaded machine.)"""
    case = Case("gpt", "sgd", steps=4, lone_recompile="no_sync", verify_timeout_s=LONE_TIMEOUT_S)
    start = time.monotonic()
    with pytest.raises(RankFailedError) as failed:
        spawn(run_cases, 2, ([case],), timeout_s=300)
    error = failed.value
    assert error.signal is None and error.rank == 1, error
    last = {rank: text.strip().splitlines()[-1] for _, rank, text in error.failures}
    assert last[0] == last[1], last
    assert last[1].startswith(
        "fsdp_graph.compiler.rank_check.CollectiveMismatchError: fsdp_graph: ranks compiled different collectives"
    )
    assert "rank 1 compiled 'fw 1' and 'bw 1', whose collectives only 1 of the 2 ranks of its group " in last[1]
    assert (
        f"compiled within {LONE_TIMEOUT_S:g} s; against the last graph they agreed on, graph 'bw 0' (rank 1: "
        in last[1]
    )
    assert time.monotonic() - start < 120, "the failure took longer than spawning, compiling and the timeout"


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
