"""Rank-side workers for one compile per job (issue 36): which ranks ran Inductor and the C++ compiler, and parity."""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch._dynamo.utils import counters
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


def _batches(seed: int, group_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(2 * group_size, 7, generator=gen), torch.randn(2 * group_size, 5, generator=gen)


def _sharded_step(compiled, opt, batch, rank_in_group: int, group_size: int) -> float:
    x, y = batch
    loss = nn.functional.mse_loss(compiled(x.chunk(group_size)[rank_in_group]), y.chunk(group_size)[rank_in_group])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _train(
    model: nn.Module,
    mesh,
    rank_in_group: int,
    group_size: int,
    seed: int,
    checkpoint: str | None = None,
    strategy: fsdp_graph.ShardingStrategy = fsdp_graph.ShardingStrategy.FULL_SHARD,
    inductor: bool = True,
) -> tuple[fsdp_graph.FSDPBackend, float, dict]:
    """Two SGD-with-momentum steps of `model` sharded over `mesh` (Inductor, or eager kernels), against one process
    on the group's whole batch: (the backend, the largest parameter difference, {}). With `checkpoint`: then
    `save_checkpoint(compiled=backend)` there and a third step, whose loss and parameters the dict holds."""
    ref = copy.deepcopy(model)
    fsdp_graph.fully_shard(model, mesh, strategy=strategy)
    backend = fsdp_graph.make_backend(inductor=inductor)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref))
    batches = _batches(seed, group_size)
    for _ in range(2):
        batch = next(batches)
        _sharded_step(compiled, opt, batch, rank_in_group, group_size)
        nn.functional.mse_loss(ref(batch[0]), batch[1]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = fsdp_graph.full_state_dict(model)
    diff = max((full[n] - p).abs().max().item() for n, p in ref.named_parameters())
    if checkpoint is None:
        return backend, diff, {}
    fsdp_graph.save_checkpoint(checkpoint, model, opt, compiled=backend)
    loss = _sharded_step(compiled, opt, next(batches), rank_in_group, group_size)
    return backend, diff, {"loss": loss, "params": fsdp_graph.full_state_dict(model)}


def resume_from_compiled(rank: int, world: int, checkpoint: str) -> dict:
    """The third step of `one_compile_per_graph`'s first phase, in fresh processes: `load_checkpoint(compiled=
    backend)` then the step; its loss and parameters, and what this process compiled and installed."""
    runs = CompilerRuns()
    torch.manual_seed(0)
    model = fsdp_graph.fully_shard(OddMLP())
    backend = fsdp_graph.make_backend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    fsdp_graph.load_checkpoint(checkpoint, model, opt, compiled=backend)
    batches = _batches(10, world)
    next(batches), next(batches)
    loss = _sharded_step(compiled, opt, next(batches), rank, world)
    hits = counters["aot_autograd"]["autograd_cache_hit"], counters["inductor"]["fxgraph_cache_hit"]
    return {
        "loss": loss,
        "params": fsdp_graph.full_state_dict(model),
        "hits": hits,
        "restored": dict(backend.restored),
        **runs.take(),
    }


def _phase(backend, diff: float, runs: CompilerRuns, **extra) -> dict:
    """What one phase of `one_compile_per_graph` reports: its parity, what this rank compiled and installed, the
    sharing's seconds per phase and the graphs' reports."""
    sharing, reports = backend.sharing, _reports(backend)
    return {
        "max_diff": diff,
        **runs.take(),
        **sharing.stats,
        **extra,
        "seconds": dict(sharing.seconds),
        "reports": reports,
    }


def _reports(backend) -> list[tuple]:
    return [(r.stage, dict(r.collectives.counts), r.fingerprint, r.loaded_from is not None) for r in backend.reports]


def one_compile_per_graph(
    rank: int, world: int, own_cache: bool, checkpoint: str | None = None, inductor: bool = True
) -> list[dict]:
    """Each phase trains a model with uneven shards (OddMLP's 13 and 11 rows) and reports what this rank compiled:
    the world sharding one model (one graph for every rank), then, with 4 ranks, HYBRID_SHARD over (2, 2) (every
    rank's shard and replica groups differ, their rank-independent names do not: one graph for every rank), then
    each pair of consecutive ranks sharding a model of its own width over its own group (one graph per pair).
    `own_cache`: this rank gets an Inductor cache directory of its own, as on a machine of its own. `checkpoint`:
    the first phase then saves a checkpoint with its compiled artifacts there and trains one more step
    (`resume_from_compiled` repeats that step). `inductor=False`: eager kernels, and a last phase trains the first
    phase's model again with a new backend (every rank's cache then holds the graph)."""
    if own_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"fsdp_graph_rank{rank}_")
    runs = CompilerRuns()
    phases = []
    torch.manual_seed(0)
    backend, diff, after = _train(OddMLP(), None, rank, world, 10, checkpoint, inductor=inductor)
    phases.append(_phase(backend, diff, runs, **after))
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pair", "dp"))
        torch.manual_seed(1)
        hybrid = fsdp_graph.ShardingStrategy.HYBRID_SHARD
        backend, diff, _ = _train(OddMLP(), mesh, rank, world, 20, strategy=hybrid, inductor=inductor)
        phases.append(_phase(backend, diff, runs))
        pair = mesh["pair"].get_local_rank()
        torch.manual_seed(2)
        model = OddMLP((7, 13 + 2 * pair, 11, 5))
        backend, diff, _ = _train(model, mesh["dp"], mesh["dp"].get_local_rank(), 2, 30 + pair, inductor=inductor)
        phases.append(_phase(backend, diff, runs, pair=pair))
    if not inductor:
        torch.manual_seed(0)
        backend, diff, _ = _train(OddMLP(), None, rank, world, 10, inductor=False)
        phases.append(_phase(backend, diff, runs))
    return phases
