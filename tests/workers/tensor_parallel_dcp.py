"""Rank-side workers for DCP checkpoints of tensor parallel x FSDP models (issue 14) across data-parallel sizes:
written on (dp=2, tp=2), read on (dp=1, tp=2) and by plain FSDP without tensor parallelism."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import fsdp_graph
from tests.workers.checkpointing import _full_optim_state
from tests.workers.tensor_parallel import TinyTransformer, tp_plan


def _sharded(world: int, tp: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, int, int]:
    """TinyTransformer(seed) with the Colwise/Rowwise plan on tp (tp > 1) and fully_shard over dp = world // tp,
    or plain fully_shard over the world (tp == 1); SGD with momentum; (model, optimizer, dp rank, dp size)."""
    torch.manual_seed(seed)
    model = TinyTransformer()
    if tp > 1:
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan())
        fsdp_graph.fully_shard(model, mesh["dp"])
        dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        fsdp_graph.fully_shard(model, mesh["dp"])
        dp_rank, dp = mesh.get_local_rank(), world
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), dp_rank, dp


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, dp_rank: int, dp: int) -> None:
    """The same global batch per step at every dp size; each dp rank takes its part."""
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, 8, generator=gen), torch.randn(8, 6, 1, generator=gen)
        nn.functional.mse_loss(model(x.chunk(dp)[dp_rank]), y.chunk(dp)[dp_rank]).backward()
        opt.step()
        opt.zero_grad()


def tp_dcp_phase(rank: int, world: int, phase: str, path: str, tp: int) -> dict:
    """ "save": 2 steps on (dp=world // tp, tp), `save_checkpoint`, then a third step. "load": a differently
    seeded model at this (world, tp) `load_checkpoint`s it, then takes the third step. Returns the full parameters
    and optimizer state at the checkpoint and the full parameters after the third step."""
    model, opt, dp_rank, dp = _sharded(world, tp, seed=0 if phase == "save" else 5)
    if phase == "save":
        _train(model, opt, range(2), dp_rank, dp)
        fsdp_graph.save_checkpoint(path, model, opt)
    else:
        fsdp_graph.load_checkpoint(path, model, opt)
    at_checkpoint = {"params": fsdp_graph.full_state_dict(model), "optim": _full_optim_state(model, opt)}
    _train(model, opt, range(2, 3), dp_rank, dp)
    return {**at_checkpoint, "after_step": fsdp_graph.full_state_dict(model)}
