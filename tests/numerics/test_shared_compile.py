"""One compile per job (issue 36): the first rank to reach a graph compiles it, the ranks with the same graph load
its cache entries and kernel libraries (Inductor, gloo ranks); and restarts skip compiling: a checkpoint carries
them to a job resumed on an empty cache."""

import os
import tempfile
from unittest import mock

import pytest
import torch

from fsdp_graph.train.launch import spawn
from tests.workers.shared_compile import one_compile_per_graph, resume_from_compiled


def _check_one_compiler(phase: list[dict], inductor: bool = True) -> None:
    """Exactly one rank of `phase` (the ranks sharing one graph) ran AOT autograd, Inductor and the C++ compiler
    (eager kernels: AOT autograd, and no Inductor); the others ran none of them and loaded its files, kernel
    libraries included."""
    compilers = [p for p in phase if p.get("compiled")]
    assert len(compilers) == 1, phase
    owner = compilers[0]
    assert owner["aot"] == 1, owner
    if inductor:
        assert owner["inductor"] == 2 and owner["libraries"] > 0, owner  # forward and backward
    else:
        assert (owner["inductor"], owner["libraries"]) == (0, 0), owner
    assert set(owner["seconds"]) == {"compiling"} and owner["seconds"]["compiling"] > 0, owner
    for p in phase:
        assert p["max_diff"] < 1e-6, p
        if p is not owner:
            assert (p["inductor"], p["aot"], p["libraries"], p.get("loaded")) == (0, 0, 0, 1), p
            assert not inductor or p.get("kernels", 0) > 0 or p.get("shared_dir"), p
            # it loaded the compile stack before it waited (`warm_up.load_compile_stack`), not after
            assert set(p["seconds"]) == {"preparing", "waiting", "loading"} and p["seconds"]["loading"] > 0, p
        # every rank reports the graph's collectives: a loading rank the compiling rank's report, marked so
        assert [r[:3] for r in p["reports"]] == [r[:3] for r in owner["reports"]], (p, owner)
        assert [r[3] for r in p["reports"]] == [p is not owner] * len(owner["reports"]), p
    assert [r[0] for r in owner["reports"]] == ["fw", "bw"], owner


@pytest.mark.parametrize("world", [2, 4])
def test_one_rank_compiles_each_distinct_graph(world, tmp_path):
    """2 ranks sharing one Inductor cache directory (one machine), 4 ranks with one each (a machine each). Uneven
    shards (rows 13 and 11 over 2 or 4 ranks), the same code on every rank, and parity with one process. With 4
    ranks, then HYBRID_SHARD over (2, 2): every rank's shard and replica groups are its own, the graph is one under
    their rank-independent names (`groups.rank_independent_name`), so one rank compiles for all four; then each pair
    of ranks shards a model of its own width over its own group: two graphs, one compiler per pair.
    With 2 ranks the run then saves a checkpoint with its compiled artifacts and trains a third step: resumed in
    fresh processes on an empty cache (a new machine), that step runs no AOT autograd, no Inductor and no C++
    compiler (not even torch's ISA probes), and gives the same loss and parameters bit for bit."""
    shared = world == 2
    checkpoint = str(tmp_path / "ckpt") if shared else None
    with mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="fsdp_graph_share_")}):
        results = spawn(one_compile_per_graph, world, (not shared, checkpoint))
    phases = list(zip(*results))
    if shared:  # the kernel libraries are in the directory the ranks share: nothing to install
        for p in phases[0]:
            p["shared_dir"] = True
    _check_one_compiler(list(phases[0]))
    if world == 4:
        _check_one_compiler(list(phases[1]))
        pairs = phases[2]
        for pair in (0, 1):
            _check_one_compiler([p for p in pairs if p["pair"] == pair])
    if checkpoint is None:
        return
    empty = tmp_path / "empty_cache"
    with mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": str(empty)}):
        resumed = spawn(resume_from_compiled, world, (checkpoint,))
    compiled = [(r["inductor"], r["aot"], r["libraries"]) for r in resumed]  # Inductor, AOT autograd, g++ runs
    assert compiled == [(0, 0, 0)] * world, compiled
    for before, after in zip(phases[0], resumed):
        assert after["hits"][0] >= 1 and after["hits"][1] >= 2, after  # AOT autograd's entry, forward and backward
        assert after["restored"].get("graphs", 0) >= 1, after
        assert after["loss"] == before["loss"]
        for name, value in before["params"].items():
            assert torch.equal(after["params"][name], value), name
    assert sum(r["restored"].get("kernels", 0) for r in resumed) > 0  # by whichever rank got there first
    assert any(empty.rglob("*.main.so"))


def test_eager_kernels_compile_once_per_graph():
    """`make_backend(inductor=False)` on 4 ranks with a cache directory each (a machine each): AOT autograd's cache
    keeps the lowered graphs, so one rank per distinct graph partitions and runs the passes, the others load its
    entry (FULL_SHARD; HYBRID_SHARD over 2 x 2; a model per pair of ranks), with parity and its reports. Then the
    first model again with a new backend: every rank's cache serves it, no rank runs AOT autograd, and the reports
    are the ones its passes made."""
    with mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="fsdp_graph_share_")}):
        results = spawn(one_compile_per_graph, 4, (True, None, False))
    phases = list(zip(*results))
    _check_one_compiler(list(phases[0]), inductor=False)
    _check_one_compiler(list(phases[1]), inductor=False)
    for pair in (0, 1):
        _check_one_compiler([p for p in phases[2] if p["pair"] == pair], inductor=False)
    first = [r[:3] for r in phases[0][0]["reports"]]
    for again in phases[3]:
        assert again["max_diff"] < 1e-6 and (again["aot"], again["inductor"]) == (0, 0), again
        assert again["reports"] == [(*r, True) for r in first], again
