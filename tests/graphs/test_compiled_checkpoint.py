"""Compiled artifacts in a checkpoint (issue 36) that do not apply are ignored in one line (one process, no compile).
The resume that loads them instead of compiling: tests/numerics/test_shared_compile.py."""

import os
import warnings

import torch

import fsdp_graph
from fsdp_graph.compiler.compiled_files import CompiledFiles, machine_id
from tests.workers.models import OddMLP


class _OtherForward(OddMLP):
    """OddMLP's parameters (its checkpoint loads) with another forward: compiled code for OddMLP does not apply."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).relu()


def _warnings_of(path: str, model, backend, **kwargs) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fsdp_graph.load_checkpoint(path, model, compiled=backend, **kwargs)
    return [str(w.message) for w in caught]


def test_artifacts_for_other_options_or_another_model_or_damaged_are_ignored_in_one_line(tmp_path, one_rank):
    """One process, no compile: a backend holding an entry torch cannot load. Other backend options, another model
    (same parameters, another module class), the entry torch rejects, and a file whose bytes changed (with the
    load's own manifest check off) each give exactly one warning line saying why, and the weights still load."""
    path = str(tmp_path / "ckpt")
    torch.manual_seed(0)
    model = fsdp_graph.fully_shard(OddMLP())
    backend = fsdp_graph.make_backend()
    backend.compiled["graph"] = CompiledFiles(b"not an artifact", {}, machine_id())
    fsdp_graph.save_checkpoint(path, model, compiled=backend)

    cases = [
        (fsdp_graph.make_backend(bucket_bytes=4096), fsdp_graph.fully_shard(OddMLP()), "other backend options"),
        (fsdp_graph.make_backend(), fsdp_graph.fully_shard(_OtherForward()), "compiled for another model"),
        (fsdp_graph.make_backend(), fsdp_graph.fully_shard(OddMLP()), "partly ignored on rank 0: graph "),
    ]
    for load_backend, load_model, why in cases:
        lines = _warnings_of(path, load_model, load_backend)
        assert len(lines) == 1 and why in lines[0] and "\n" not in lines[0], (why, lines)
        assert load_backend.restored["graphs"] == 0, why
        for name, value in model.state_dict().items():
            assert torch.equal(load_model.state_dict()[name].full_tensor(), value.full_tensor()), (why, name)

    with open(os.path.join(path, "compiled", "graph_0.bin"), "r+b") as f:
        f.write(b"N")
    lines = _warnings_of(path, fsdp_graph.fully_shard(OddMLP()), fsdp_graph.make_backend(), verify_files=False)
    assert len(lines) == 1 and "graph_0.bin differs from checksums.json" in lines[0], lines
