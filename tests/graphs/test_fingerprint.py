"""`passes.collective_fingerprint` on a tiny model, and the runtime's first-call check around compiled graphs."""

import shutil

import pytest
import torch
import torch.fx as fx
from expecttest import assert_expected_inline
from torch._inductor.codecache import FxGraphCache

import fsdp_graph
from fsdp_graph.compiler import rank_check
from fsdp_graph.compiler.rank_check import GraphCollectives, first_difference
from fsdp_graph.ir import ALL_GATHER, WAIT
from passes import collective_fingerprint
from tests.graphs.capture import TwoBlock


def _compile_two_block(backend, steps: int = 1) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    # without shared block bodies (the default since issue 25): this checks each block's own nodes
    model = fsdp_graph.fully_shard(TwoBlock(dim=6), reuse_blocks=False)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for _ in range(steps):
        compiled(torch.randn(3, 6)).sum().backward()


def _text(backend) -> str:
    return "\n".join(f"{r.stage}: {line}" for r in backend.reports for line in r.fingerprint)


def test_fingerprint_of_two_block(fake_pg):
    backend = fsdp_graph.make_backend(inductor=False)
    _compile_two_block(backend)
    group = backend.reports[0].groups[0]
    assert [r.groups for r in backend.reports] == [(group,), (group,)]
    assert_expected_inline(
        _text(backend).replace(f"group={group},", "group=G,"),
        """\
fw: all_gather_into_tensor(group=G, group_size=4, 14 x float32 -> 56 x float32)
fw: all_gather_into_tensor(group=G, group_size=4, 14 x float32 -> 56 x float32)
fw: all_gather_into_tensor(group=G, group_size=4, 6 x float32 -> 24 x float32)
bw: all_gather_into_tensor(group=G, group_size=4, 6 x float32 -> 24 x float32)
bw: all_gather_into_tensor(group=G, group_size=4, 14 x float32 -> 56 x float32)
bw: reduce_scatter_tensor(group=G, reduce_op=sum, group_size=4, 24 x float32 -> 6 x float32)
bw: reduce_scatter_tensor(group=G, reduce_op=sum, group_size=4, 56 x float32 -> 14 x float32)
bw: reduce_scatter_tensor(group=G, reduce_op=sum, group_size=4, 56 x float32 -> 14 x float32)""",
    )


def test_bucketing_changes_the_fingerprint(fake_pg):
    plain, bucketed = (
        fsdp_graph.make_backend(inductor=False),
        fsdp_graph.make_backend(inductor=False, bucket_bytes=1 << 20),
    )
    _compile_two_block(plain)
    _compile_two_block(bucketed)
    lists = [[r.collectives_to_compare() for r in b.reports] for b in (plain, bucketed)]
    assert rank_check.digest(lists[0]) != rank_check.digest(lists[1])
    assert first_difference((0, 1), lists).startswith("graph 'fw 0' collective #1 (3 vs 1 collectives): rank 0 all_ga")


def test_fingerprint_without_collectives_is_empty():
    assert collective_fingerprint(fx.symbolic_trace(torch.nn.Linear(2, 2))) == []


def test_fingerprint_of_a_hand_built_graph():
    graph = fx.Graph()
    shard = graph.placeholder("shard")
    shard.meta["val"] = torch.empty(5, dtype=torch.bfloat16, device="meta")
    gathered = graph.call_function(ALL_GATHER, (shard, 2, "7"))
    gathered.meta["val"] = torch.empty(10, dtype=torch.bfloat16, device="meta")
    graph.output(graph.call_function(WAIT, (gathered,)))
    lines = collective_fingerprint(fx.GraphModule(torch.nn.Module(), graph))
    assert lines == ["all_gather_into_tensor(group=7, group_size=2, 5 x bfloat16 -> 10 x bfloat16)"]


def test_first_difference_names_graph_and_collective():
    a = [GraphCollectives("fw 0", ("x", "y"), ("0",)), GraphCollectives("bw 0", ("z",), ("0",))]
    assert first_difference((0, 1), (a, a)) is None
    b = [a[0], GraphCollectives("bw 0", ("z", "extra"), ("0",))]
    assert (
        first_difference((0, 1), (a, b))
        == "graph 'bw 0' collective #2 (1 vs 2 collectives): rank 0 nothing vs rank 1 extra"
    )
    assert first_difference((2, 3), (a, a[:1])) == "compiled graph #2: rank 2 has graph 'bw 0', rank 3 has no graph"
    renumbered = [GraphCollectives("fw 3", ("x", "w"), ("0",))]  # rank 1 compiled other graphs before this one
    assert first_difference((0, 1), (a[:1], renumbered)).startswith("graph 'fw 0' (rank 1: 'fw 3') collective #2")
    assert rank_check.digest(a[:1]) == rank_check.digest([GraphCollectives("fw 3", ("x", "y"), ("0",))])


@pytest.mark.parametrize("verify", [True, False])
def test_check_runs_once_per_compiled_graph(fake_pg, monkeypatch, verify):
    calls = []
    monkeypatch.setattr(rank_check.RankAgreement, "verify", lambda self, graphs: calls.append(list(graphs)))
    backend = fsdp_graph.make_backend(inductor=False, verify_collectives=verify)
    _compile_two_block(backend, steps=3)
    if not verify:
        assert calls == []
        return
    assert len(calls) == 1  # the first call only
    assert [(g.name, g.lines) for g in calls[0]] == [(f"{r.stage} 0", r.fingerprint) for r in backend.reports]


def test_bad_timeout_is_refused():
    with pytest.raises(ValueError, match="verify_timeout_s must be a positive number of seconds, got 0"):
        fsdp_graph.make_backend(verify_timeout_s=0)


@pytest.mark.slow
def test_cache_hit_takes_the_lists_from_the_store(fake_pg, monkeypatch, tmp_path):
    """On an AOTAutograd cache hit our passes do not run: the reports, and the lists checked, come from the store;
    without a stored entry the graph compiles again, uncached, so they are the passes' own (full Inductor)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    # A store of its own: an earlier test in this process may have compiled the same graph, and the store skips
    # writing a file for reports it already holds in memory.
    monkeypatch.setattr(rank_check, "STORE", rank_check.FingerprintStore())
    monkeypatch.setattr(fsdp_graph.compiler.backend, "STORE", rank_check.STORE)
    calls = []
    monkeypatch.setattr(rank_check.RankAgreement, "verify", lambda self, graphs: calls.append(list(graphs)))
    saved_keys = []
    save_graph = FxGraphCache._save_graph

    def save_recording_keys(key, *args, **kwargs):
        saved_keys.append(key)
        return save_graph(key, *args, **kwargs)

    monkeypatch.setattr(FxGraphCache, "_save_graph", save_recording_keys)
    first = fsdp_graph.make_backend()
    _compile_two_block(first)
    assert [r.stage for r in first.reports] == ["fw", "bw"] and len(saved_keys) == 2
    hit = fsdp_graph.make_backend()
    _compile_two_block(hit)
    assert calls[1] == calls[0]  # served by the cache, checked with the stored lists
    assert [(r.stage, r.code, r.loaded_from) for r in hit.reports] == [(r.stage, r.code, 0) for r in first.reports]
    assert [r.loaded_from for r in first.reports] == [None, None]

    monkeypatch.setattr(rank_check, "STORE", rank_check.FingerprintStore())
    monkeypatch.setattr(fsdp_graph.compiler.backend, "STORE", rank_check.STORE)
    for stored in (tmp_path / "fsdp_graph_reports").iterdir():
        stored.unlink()
    unstored = fsdp_graph.make_backend()
    _compile_two_block(unstored)
    assert [r.stage for r in unstored.reports] == ["fw", "bw"] and calls[2] == calls[0]

    # A partial hit: the forward compiles (the passes run), the backward is served by an FX graph entry that
    # another job sharing the cache wrote meanwhile. Its lists lacked the backward: two jobs sharing a cache
    # directory failed the check ("rank 0 has no graph, rank 2 has graph 'bw 0'")
    monkeypatch.setattr(rank_check, "STORE", rank_check.FingerprintStore())
    monkeypatch.setattr(fsdp_graph.compiler.backend, "STORE", rank_check.STORE)
    for stored in (tmp_path / "fsdp_graph_reports").iterdir():
        stored.unlink()
    shutil.rmtree(tmp_path / "aotautograd")
    shutil.rmtree(FxGraphCache._get_tmp_dir_for_key(saved_keys[0]))
    partial = fsdp_graph.make_backend()
    _compile_two_block(partial)
    assert [r.stage for r in partial.reports] == ["fw", "bw"] and calls[3] == calls[0]


def test_group_shapes_are_the_same_on_every_replica():
    """HYBRID's replicate groups [0, 2] and [1, 3] of a 2x2 mesh have other names on ranks 0 and 1 but one shape:
    comparing names made the ranks of a 2x2 HYBRID run disagree (CollectiveMismatchError on every rank)."""
    from fsdp_graph.compiler.rank_check import group_shape

    assert group_shape([0, 2]) == group_shape([1, 3]) == "2 ranks, stride 2"
    assert group_shape([0, 1]) == group_shape([2, 3]) == "2 ranks, stride 1"
    assert group_shape([5]) == "1 ranks, stride 1"
    assert group_shape([0, 1, 3]) != group_shape([0, 2, 3])
