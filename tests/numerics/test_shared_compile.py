"""One compile per job (issue 36): the first rank to reach a graph compiles it, the ranks with the same graph load
its cache entries and kernel libraries (Inductor, gloo ranks)."""

import os
import tempfile
from unittest import mock

import pytest

from fsdp_graph.train.launch import spawn
from tests.workers.shared_compile import copy_vec_isa_verdict, one_compile_per_graph


def _check_one_compiler(phase: list[dict]) -> None:
    """Exactly one rank of `phase` (the ranks sharing one graph) ran AOT autograd, Inductor and the C++ compiler;
    the others ran none of them and loaded its files, kernel libraries included."""
    compilers = [p for p in phase if p.get("compiled")]
    assert len(compilers) == 1, phase
    owner = compilers[0]
    assert owner["inductor"] == 2 and owner["aot"] == 1 and owner["libraries"] > 0, owner  # forward and backward
    for p in phase:
        assert p["max_diff"] < 1e-6, p
        if p is not owner:
            assert (p["inductor"], p["aot"], p["libraries"], p.get("loaded")) == (0, 0, 0, 1), p
            assert p.get("kernels", 0) > 0 or p.get("shared_dir"), p


@pytest.mark.parametrize("world", [2, 4])
def test_one_rank_compiles_each_distinct_graph(world):
    """2 ranks sharing one Inductor cache directory (one machine), 4 ranks with one each (a machine each). Uneven
    shards (rows 13 and 11 over 2 or 4 ranks), the same code on every rank, and parity with one process. With 4
    ranks, then, each pair of ranks shards a model over its own group: two graphs, one compiler per pair."""
    shared = world == 2
    fresh = tempfile.mkdtemp(prefix="fsdp_graph_share_")
    copy_vec_isa_verdict(os.environ["TORCHINDUCTOR_CACHE_DIR"], fresh)
    with mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": fresh}):
        results = spawn(one_compile_per_graph, world, (not shared,))
    phases = list(zip(*results))
    if shared:  # the kernel libraries are in the directory the ranks share: nothing to install
        for p in phases[0]:
            p["shared_dir"] = True
    _check_one_compiler(list(phases[0]))
    if world == 4:
        pairs = phases[1]
        for pair in (0, 1):
            _check_one_compiler([p for p in pairs if p["pair"] == pair])
