"""A sharded model is freed when its user drops it: parameters, flat shards and modules, after eager and compiled
steps, and with tensor-parallel blocks. Before, every `fully_shard` model lived as long as the process (a view's
`requires_grad` callback held its flat parameter through the view's `__dict__`, a cycle through a tensor the
collector cannot see), and the last compiled one through a trace record of block reuse's: a job that built an
evaluation copy, or a sweep of models, kept every shard's memory."""

import gc
import weakref

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import fsdp_graph
from fsdp_graph.runtime.unit import flat_params
from tests.workers.tensor_parallel import TinyTransformer, tp_plan


def _train_and_drop(mode: str) -> list[weakref.ref]:
    model = TinyTransformer()  # two blocks of one structure: with block reuse (the default) they share a body
    if mode == "tensor_parallel":  # the views are DTensors (`ShardedDTensor`), with the same callback
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan())
        fsdp_graph.fully_shard(model, mesh["dp"])
    else:
        fsdp_graph.fully_shard(model)
    run = model
    if mode == "compiled":
        run = torch.compile(model, backend=fsdp_graph.make_backend(inductor=False), fullgraph=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        run(torch.randn(4, 6, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    model.blocks[0].up.weight.requires_grad_(False)  # the callback that used to hold the flat parameter runs
    watched = [weakref.ref(model), weakref.ref(model.blocks[1]), weakref.ref(model.head.weight)]
    watched += [weakref.ref(state.flat_shard) for state in flat_params(model)]
    return watched


@pytest.mark.parametrize("mode", ["eager", "compiled", "tensor_parallel"])
def test_a_dropped_model_is_freed(fake_pg, mode):
    watched = _train_and_drop(mode)
    torch._dynamo.reset()  # Dynamo's compiled code holds the model it guards on until then
    gc.collect()
    alive = [ref() for ref in watched if ref() is not None]
    assert not alive, [type(obj).__name__ for obj in alive]
