"""Re-created (written here) from torch's test_fully_shard_frozen.py, _state_dict.py, _init.py and
_mixed_precision.py, issue 32. Same conventions as tests/workers/fsdp2_upstream_train.py."""

from __future__ import annotations

import copy
import itertools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tests.workers.upstream_common import (
    all_dtensors,
    average_grads,
    blocks_of,
    ddp_parity,
    fully_shard,
    impl,
    local,
    loss_diff,
    mlp,
    raises,
    sharded_diff,
    transformer,
)


def mixed_requires_grad_per_group(rank: int, world: int, mode: str, freeze_after_init: bool = False) -> dict[str, float]:
    """test_train_mixed_requires_grad_per_group: biases train, weights frozen (BitFit), in the same groups; reshard
    F/T/2 x AC (composable; compiled: reshard True without AC, as upstream's compile tests); 5 of 10 steps. `freeze_after_init`:
    the freeze comes after the calls. Upstream's reduce-scatter numel and autograd-function counts are FSDP2
    internals; the public equivalent checked: frozen parameters get no gradient."""
    out: dict[str, float] = {}
    for raf in (False, True, 2) if mode == "eager" else (True,):
        for ac in (False,) if mode == "compiled" else (False, True):

            def build():
                model = nn.Sequential(*(mlp(32) for _ in range(3)))
                if not freeze_after_init:
                    for name, p in model.named_parameters():
                        p.requires_grad_("bias" in name)
                return model

            def shard(model, raf=raf, ac=ac):
                for m in model:
                    if ac:
                        checkpoint(m)
                    fully_shard(m, reshard_after_forward=raf)
                fully_shard(model, reshard_after_forward=raf)

            def freeze(model):
                for name, p in model.named_parameters():
                    p.requires_grad_("bias" in name)

            inputs = [torch.randn(8, 32) for _ in range(5)]
            result = ddp_parity(
                build, shard, lambda s, inputs=inputs: inputs[s], mode, 5, rank, check_grads=False,
                after_shard=freeze if freeze_after_init else None,
            )
            out.update({f"{k}_{raf}_{ac}": v for k, v in result.items()})
    return out


def mixed_requires_grad_freeze_after_init(rank: int, world: int) -> dict[str, float]:
    return mixed_requires_grad_per_group(rank, world, "eager", freeze_after_init=True)


def mixed_requires_grad_across_groups(rank: int, world: int) -> dict[str, float]:
    """test_train_mixed_requires_grad_across_groups: six linears each its own call, the first frozen after the calls,
    a no_grad step, optionally unfrozen for the last step; reshard F/T/2; losses equal DDP's."""
    out: dict[str, float] = {}
    for raf in (False, True, 2):
        for unfreeze in (False, True):
            torch.manual_seed(42)
            model = nn.Sequential(*itertools.chain.from_iterable((nn.Linear(32, 32), nn.ReLU()) for _ in range(6)))
            ref = copy.deepcopy(model)
            for m in model:
                if isinstance(m, nn.Linear):
                    fully_shard(m, reshard_after_forward=raf)
            opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
            for seq in (model, ref):
                for p in seq[0].parameters():  # upstream's loop freezes seq[i % 2] for even i: always seq[0]
                    p.requires_grad_(False)
            torch.manual_seed(42 + rank)
            inp = torch.randn(8, 32)
            diff = 0.0
            for step in range(3):
                losses = []
                for m, o in ((ref, ref_opt), (model, opt)):
                    if unfreeze and step == 2:
                        for p in model[0].parameters():
                            p.requires_grad_(True)
                    if step == 1:
                        with torch.no_grad():
                            losses.append(m(inp).sum())
                    else:
                        losses.append(m(inp).sum())
                        losses[-1].backward()
                        if m is ref:
                            average_grads(ref)
                        o.step()
                        o.zero_grad(set_to_none=step % 2 == 0)
                diff = max(diff, loss_diff(losses[0], losses[1]))
            out[f"loss_diff_{raf}_{unfreeze}"] = diff
    return out


def multi_forward_mixed_requires_grad(rank: int, world: int) -> dict[str, float]:
    """test_multi_forward_mixed_requires_grad: a frozen and a trained linear called three times, also under
    no_grad; each linear its own call; reshard T/F/2, 10 steps."""

    class MultiForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer_0, self.layer_no_grad, self.layer_with_grad = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 5)
            self.layer_no_grad.requires_grad_(False)

        def forward(self, x):
            x = self.layer_0(x)
            for _ in range(3):
                x = self.layer_no_grad(F.relu(self.layer_with_grad(x)))
                with torch.no_grad():
                    x += F.relu(self.layer_with_grad(x))
            return x

    out: dict[str, float] = {}
    for raf in (True, False, 2):

        def shard(model, raf=raf):
            for m in model.modules():
                if isinstance(m, nn.Linear):
                    fully_shard(m, reshard_after_forward=raf)
            fully_shard(model, reshard_after_forward=raf)

        inputs = [torch.randn(8, 5) for _ in range(10)]
        result = ddp_parity(MultiForward, shard, lambda s, inputs=inputs: inputs[s], "eager", 10, rank, check_grads=False)
        out.update({f"{k}_{raf}": v for k, v in result.items()})
    return out


def _state_dict_save_load(model: nn.Module, rank: int) -> dict[str, float]:
    """upstream's _test_state_dict_save_load: state-dict values are DTensors sharing the parameters' local storage;
    loading new DTensors writes into that storage (same data pointer where the sharding is even)."""
    out = {"params_dtensors": all_dtensors(model.parameters())}
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1)
    ptrs = {n: p.to_local().data_ptr() for n, p in model.named_parameters()}
    sd = model.state_dict()
    out["keys"] = float(set(sd) == set(ptrs))
    out["shared_storage"] = float(
        all(isinstance(t, DTensor) and (ptrs[n] == 0 or t.to_local().data_ptr() == ptrs[n]) for n, t in sd.items())
    )
    model.load_state_dict({n: t.detach().clone().fill_(42 + rank) for n, t in sd.items()})
    out["loaded"] = float(all(torch.all(p.to_local() == 42 + rank) for p in model.parameters()))
    out["same_ptr_when_even"] = float(
        all(p.to_local().data_ptr() == ptrs[n] for n, p in model.named_parameters() if p.to_local().size(0) * p.device_mesh.size() == p.size(0))
    )
    return out


def dp_state_dict_save_load(rank: int, world: int, largest_dim: bool = False) -> dict[str, float]:
    """test_dp_state_dict_save_load, 1-D mesh: mlp_dim 2..5 (largest-dim placement: 16), reshard True, and False
    before and after a forward (the state dict is the sharded one either way)."""
    out: dict[str, float] = {}
    placement = (lambda p: Shard(p.shape.index(max(p.shape)))) if largest_dim else None
    for dim in (16,) if largest_dim else (2, 3, 4, 5):
        torch.manual_seed(42)
        base = nn.Sequential(mlp(dim), nn.Sequential(mlp(dim), nn.Linear(dim, dim)), mlp(dim))
        for raf in (True, False):
            model = copy.deepcopy(base)
            for m in model:
                fully_shard(m, reshard_after_forward=raf, shard_placement_fn=placement)
            fully_shard(model, reshard_after_forward=raf, shard_placement_fn=placement)
            out.update({f"{k}_{dim}_{raf}": v for k, v in _state_dict_save_load(model, rank).items()})
            if not raf:
                before = model.state_dict()
                model(torch.randn(2, dim))
                after = model.state_dict()
                out[f"resharded_{dim}"] = float(
                    set(before) == set(after) and all(torch.equal(local(before[k]), local(after[k])) for k in before)
                )
    return out


def dp_state_dict_largest_dim(rank: int, world: int) -> dict[str, float]:
    return dp_state_dict_save_load(rank, world, largest_dim=True)


def cached_state_dict(rank: int, world: int) -> dict[str, float]:
    """test_cached_state_dict (mutate_after_state_dict=False; True moves the model to CUDA): a state dict taken once
    keeps sharing the weight's storage through 5 steps."""
    out = {"shared": 1.0}
    for dim in (2, 3, 4, 5):
        torch.manual_seed(42)
        model = nn.Linear(dim, dim, bias=False)
        fully_shard(model, reshard_after_forward=True)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        sd = model.state_dict()
        same = [sd["weight"].to_local().untyped_storage().data_ptr() == model.weight.to_local().untyped_storage().data_ptr()]
        torch.manual_seed(42 + rank)
        inp = torch.rand(dim, dim)
        for _ in range(5):
            opt.zero_grad()
            model(inp).sum().backward()
            opt.step()
            same.append(sd["weight"].to_local().untyped_storage().data_ptr() == model.weight.to_local().untyped_storage().data_ptr())
        out["shared"] = min(out["shared"], float(all(same)))
    return out


def dp_state_dict_cpu_offload(rank: int, world: int) -> dict[str, float]:
    """test_dp_state_dict_cpu_offload (pin_memory=False; CPU): a meta model with CPUOffloadPolicy loads DTensor
    pieces with assign=True and strict=False, runs a forward, and its state dict is on CPU."""
    out: dict[str, float] = {}
    for cpu_sd in (True, False):
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
        policy = impl().CPUOffloadPolicy(pin_memory=False)
        for m in model:
            fully_shard(m, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
        pieces = []
        for name, dtensor in model.named_parameters():
            sharded = distribute_tensor(torch.randn(dtensor.size()), dtensor.device_mesh, dtensor.placements)
            pieces.append({name: sharded.cpu() if cpu_sd else sharded})
        for piece in pieces:
            model.load_state_dict(piece, assign=True, strict=False)
        model(torch.rand(4, 4)).sum()
        out[f"cpu_{cpu_sd}"] = float(all(t.device.type == "cpu" for t in model.state_dict().values()))
    return out


def shard_tensor_parameters(rank: int, world: int) -> dict[str, float]:
    """test_shard_tensor_parameters: odd sizes (uneven shards), also a shared in_proj: DTensors on the world mesh,
    same size and stride, Shard(0), local tensor = torch.chunk's block."""
    out: dict[str, float] = {}
    for shared in (False, True):
        model = nn.Sequential(*(mlp(3, dim_multiplier=3) for _ in range(3)))
        if shared:
            model[0].in_proj = model[1].in_proj
        orig = [p.detach().clone() for p in model.parameters()]
        fully_shard(model)
        params = list(model.parameters())
        ok = len(params) == len(orig)
        for o, p in zip(orig, params):
            chunks = torch.chunk(o, world, dim=0)
            block = chunks[rank] if rank < len(chunks) else o[:0]
            ok = ok and isinstance(p, DTensor) and p.size() == o.size() and p.stride() == o.stride()
            ok = ok and tuple(p.placements) == (Shard(0),) and torch.equal(p.to_local(), block)
        out[f"shared_{shared}"] = float(ok)
    return out


def init_errors(rank: int, world: int) -> dict[str, float]:
    """test_raise_scalar_parameter and test_invalid_mesh_ndim: the error FSDP2 raises (its text naming the scalar
    parameter)."""
    model = nn.Sequential(*(mlp(3, dim_multiplier=3) for _ in range(3)))
    model.register_parameter("scalar_p", nn.Parameter(torch.tensor(1.0)))
    out = {"scalar": raises(lambda: (fully_shard(model), list(model.parameters())), ValueError, "scalar_p")}
    mesh = init_device_mesh("cpu", (world, 1, 1))
    m3 = mlp(8)
    out["mesh_ndim"] = raises(lambda: (fully_shard(m3, mesh=mesh), list(m3.parameters())), ValueError)
    return out


def invalid_shard_dim(rank: int, world: int) -> dict[str, float]:
    """test_invalid_shard_dim: Shard(1) for a 1-D bias is an AssertionError."""
    bad = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8))
    return {"raised": raises(lambda: (fully_shard(bad, shard_placement_fn=lambda p: Shard(1)), list(bad.parameters())), AssertionError)}


def reset_sharded_param_in_lazy_init(rank: int, world: int) -> dict[str, float]:
    """test_reset_sharded_param_in_lazy_init: a meta model; layers materialized with to_empty; the root's own
    parameter replaced by a new nn.Parameter before the first forward; forward and backward run."""

    class MyModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer1, self.layer2 = nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False)
            self.weight_norm = nn.Parameter(torch.empty(3))

        def forward(self, inp):
            return self.layer2(self.layer1(inp)).sum() + self.weight_norm.sum()

    with torch.device("meta"):
        model = MyModel()
    for m in (model.layer1, model.layer2, model):
        fully_shard(m)
    model.layer1.to_empty(device="cpu")
    model.layer2.to_empty(device="cpu")
    with torch.no_grad():
        norm = torch.linalg.norm(model.layer1.weight, dim=1) + torch.linalg.norm(model.layer2.weight, dim=1)
    model.weight_norm = nn.Parameter(norm)
    model(torch.randn(3, 3)).sum().backward()
    return {"ran": 1.0}


def meta_device_1d_init(rank: int, world: int) -> dict[str, float]:
    """test_meta_device_1d_init: mlp_dim 8, 3, 1 (even, uneven, empty local shard) x default and bf16 policies; the
    model stays on meta through the calls; to_empty, then reset_parameters() writes every parameter and buffer;
    one step runs. Also the calls made under a meta-device context."""
    out: dict[str, float] = {}
    mesh = init_device_mesh("cpu", (world,))
    policy = impl().MixedPrecisionPolicy
    cases = [(d, p) for d in (8, 3, 1) for p in (policy(), policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))]
    for i, (dim, mp) in enumerate(cases + [(8, None)]):
        with torch.device("meta"):
            model = nn.Sequential(mlp(dim, dim_multiplier=1, with_buffer=True, bias=False), mlp(dim, dim_multiplier=1, bias=False))
            if mp is None:
                for m in (model[0], model[1], model):
                    fully_shard(m)
        if mp is not None:
            for m in (model[0], model[1], model):
                fully_shard(m, mesh=mesh, mp_policy=mp)
        on_meta = all(p.device.type == "meta" for p in model.parameters())
        model.to_empty(device="cpu")
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        for t in itertools.chain(model.parameters(), model.buffers()):
            t.detach().fill_(1337)
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        written = all(
            not torch.all(local(p) == 1337) for p in itertools.chain(model.parameters(), model.buffers()) if local(p).numel()
        )
        model(torch.randn(4, dim)).sum().backward()
        opt.step()
        out[f"case_{i}"] = float(on_meta and written)
    return out


def invalid_meta_device_init(rank: int, world: int) -> dict[str, float]:
    """test_invalid_meta_device_init: a forward with parameters still on meta raises a RuntimeError naming them."""
    with torch.device("meta"):
        model = nn.Sequential(mlp(8, with_buffer=True), mlp(8))
        for m in (model[0], model[1], model):
            fully_shard(m)
    return {"raised": raises(lambda: model(torch.randn(4, 8)), RuntimeError, "0.in_proj.weight")}


def rank0_broadcast_meta_device_init(rank: int, world: int) -> dict[str, float]:
    """test_rank0_broadcast_meta_device_init: rank 0's full state dict broadcast and distributed into a meta
    model's DTensors, loaded with assign=True; equal to a model sharded from the same weights, one forward and
    backward equal."""
    torch.manual_seed(42)
    ref, args = transformer(dropout_p=0.0)
    for p in ref.parameters():
        torch.distributed.broadcast(p.detach(), src=0)
    full_sd = {k: v.clone() for k, v in ref.state_dict().items()}
    with torch.device("meta"):
        model, _ = transformer(dropout_p=0.0)

    for m in [*blocks_of(model), model]:
        fully_shard(m)
    for m in [*blocks_of(ref), ref]:
        fully_shard(m)
    meta_sd = model.state_dict()
    sharded = {}
    for name, meta in meta_sd.items():
        whole = full_sd[name].clone() if rank == 0 else torch.empty(meta.size(), dtype=meta.dtype)
        torch.distributed.broadcast(whole, src=0)
        sharded[name] = nn.Parameter(distribute_tensor(whole, meta.device_mesh, meta.placements))
    model.load_state_dict(sharded, assign=True)
    out = {"dtensors": all_dtensors(model.parameters()), "param_diff": sharded_diff(ref, model)}
    inp = torch.randint(0, args.vocab_size, (2, 16))
    loss, ref_loss = model(inp).sum(), ref(inp).sum()
    loss.backward()
    ref_loss.backward()
    out["loss_diff"] = loss_diff(loss, ref_loss)
    out["grad_diff"] = max((local(p.grad) - local(q.grad)).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return out


def old_import_training(rank: int, world: int) -> dict[str, float]:
    """test_old_import_training: bf16 compute, three calls, FSDPModule instances, a step runs."""
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    policy = impl().MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for m in (model[0], model[1], model):
        fully_shard(m, mp_policy=policy)
    out = {"fsdp_modules": float(all(isinstance(m, impl().FSDPModule) for m in (model[0], model[1], model)))}
    model(torch.randn(8, 16)).sum().backward()
    out["grads"] = float(all(p.grad is not None for p in model.parameters()))
    return out

