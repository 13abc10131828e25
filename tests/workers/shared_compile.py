"""Rank-side workers for one compile per job (issue 36): which ranks ran Inductor and the C++ compiler, and parity."""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_graph
from tests.workers.models import OddMLP


class CompilerRuns:
    """Counts, in this process, the graphs Inductor generated code for (its FX graph cache misses), the graphs AOT
    autograd traced (its cache misses) and the C++ libraries built (`CppBuilder.build` calls making a `.so`)."""

    def __init__(self):
        from torch._inductor import cpp_builder

        self.libraries = 0
        build = cpp_builder.CppBuilder.build

        def counted(builder, *args, **kwargs):
            if builder.get_target_file_path().endswith(".so"):
                self.libraries += 1
            return build(builder, *args, **kwargs)

        cpp_builder.CppBuilder.build = counted

    def take(self) -> dict[str, int]:
        """The counts since the last call."""
        from torch._dynamo.utils import counters

        out = {
            "inductor": counters["inductor"]["fxgraph_cache_miss"],
            "aot": counters["aot_autograd"]["autograd_cache_miss"],
            "libraries": self.libraries,
        }
        counters.clear()
        self.libraries = 0
        return out


def _train(
    model: nn.Module, mesh, rank_in_group: int, group_size: int, seed: int
) -> tuple[fsdp_graph.FSDPBackend, float]:
    """Two SGD-with-momentum steps of `model` sharded over `mesh` (Inductor), against one process on the group's
    whole batch: (the backend, the largest parameter difference)."""
    ref = copy.deepcopy(model)
    fsdp_graph.fully_shard(model, mesh)
    backend = fsdp_graph.make_backend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2):
        x, y = torch.randn(2 * group_size, 7, generator=gen), torch.randn(2 * group_size, 5, generator=gen)
        nn.functional.mse_loss(
            compiled(x.chunk(group_size)[rank_in_group]), y.chunk(group_size)[rank_in_group]
        ).backward()
        nn.functional.mse_loss(ref(x), y).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    full = fsdp_graph.full_state_dict(model)
    return backend, max((full[n] - p).abs().max().item() for n, p in ref.named_parameters())


def copy_vec_isa_verdict(source: str, target: str) -> None:
    """The vector-ISA verdict `fsdp_graph.compiler.vec_isa` recorded in the Inductor cache `source`, if any, copied
    into `target`: a fresh cache directory then skips torch's per-machine probe (seconds of child processes per
    rank), which these tests are not about."""
    records = Path(source) / "fsdp_graph"
    for record in records.glob("vec_isa_*.json") if records.is_dir() else ():
        (Path(target) / "fsdp_graph").mkdir(parents=True, exist_ok=True)
        shutil.copy(record, Path(target) / "fsdp_graph" / record.name)


def one_compile_per_graph(rank: int, world: int, own_cache: bool) -> list[dict]:
    """Each phase trains a model with uneven shards (OddMLP's 13 and 11 rows) and reports what this rank compiled:
    the world sharding one model (one graph for every rank), then, with 4 ranks, each pair of consecutive ranks
    sharding its own model over its own group (one graph per pair: the groups' names are in the graph).
    `own_cache`: this rank gets an Inductor cache directory of its own, as on a machine of its own."""
    if own_cache:
        fresh = tempfile.mkdtemp(prefix=f"fsdp_graph_rank{rank}_")
        copy_vec_isa_verdict(os.environ["TORCHINDUCTOR_CACHE_DIR"], fresh)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = fresh
    runs = CompilerRuns()
    phases = []
    torch.manual_seed(0)
    backend, diff = _train(OddMLP(), None, rank, world, 10)
    phases.append({"max_diff": diff, **runs.take(), **backend.sharing.stats})
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pair", "dp"))
        pair = mesh["pair"].get_local_rank()
        torch.manual_seed(1)
        backend, diff = _train(OddMLP(), mesh["dp"], mesh["dp"].get_local_rank(), 2, 20 + pair)
        phases.append({"max_diff": diff, "pair": pair, **runs.take(), **backend.sharing.stats})
    return phases
