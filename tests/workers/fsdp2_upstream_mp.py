"""Re-created (written here) from torch's test_fully_shard_mixed_precision.py, issue 32 (upstream instantiates
these for accelerators only; the dtypes checked are the same on CPU with gloo). Same conventions as
tests/workers/fsdp2_upstream_train.py."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from tests.workers.upstream_common import average_grads, fully_shard, impl, loss_diff, mlp, sharded_diff


def float16_on_one_submodule(rank: int, world: int, with_output_dtype: bool = False) -> dict[str, float]:
    """test_float16_on_one_submodule, subtests 1-2 (fp16 on c2; the user's module owns the cast) or 3 (fp16 on c1
    with output_dtype fp32): the dtype each module's forward sees."""
    from torch.testing._internal.common_distributed import SaveForwardInputsModel

    policy = impl().MixedPrecisionPolicy
    x = torch.zeros(2, 100)
    out: dict[str, float] = {}
    if not with_output_dtype:
        for cast, expected_c2 in ((False, torch.float16), (True, torch.float32)):
            seen: dict = {}
            model = SaveForwardInputsModel(seen, cast_forward_inputs=cast)
            fully_shard(model.c2, mp_policy=policy(param_dtype=torch.float16, cast_forward_inputs=not cast))
            fully_shard(model)
            model(x).sum().backward()
            out[f"cast_{cast}"] = float(
                seen[model].dtype == torch.float32 and seen[model.c1].dtype == torch.float32 and seen[model.c2].dtype == expected_c2
            )
        return out
    seen = {}
    model = SaveForwardInputsModel(seen, cast_forward_inputs=False)
    fully_shard(model.c1, mp_policy=policy(param_dtype=torch.float16, output_dtype=torch.float32))
    fully_shard(model)
    model(x).sum().backward()
    out["output_dtype"] = float(seen[model.c1].dtype == torch.float16 and seen[model.c2].dtype == torch.float32)
    return out


def float16_output_dtype(rank: int, world: int) -> dict[str, float]:
    return float16_on_one_submodule(rank, world, with_output_dtype=True)


def submodules_with_external_inputs(rank: int, world: int) -> dict[str, float]:
    """test_submodules_with_external_inputs: an input made inside the root is cast by the submodule's call only
    where its cast_forward_inputs is on."""
    policy = impl().MixedPrecisionPolicy
    out: dict[str, float] = {}
    seen: dict = {}
    for enable in (False, True):
        seen.clear()

        class Inner(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.l = nn.Linear(100, 100)

            def forward(self, x, y):
                seen["x"], seen["y"] = x, y
                return self.l(x)

        class Outer(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.l1, self.l2 = nn.Linear(100, 100), Inner()

            def forward(self, x):
                seen["model"] = x
                return self.l2(self.l1(x), torch.ones(2, 100))

        model = Outer()
        fully_shard(model.l2, mp_policy=policy(param_dtype=torch.float16, cast_forward_inputs=enable))
        fully_shard(model, mp_policy=policy(param_dtype=torch.float16))
        model(torch.zeros(2, 100)).sum().backward()
        out[f"enable_{enable}"] = float(
            seen["model"].dtype == torch.float16 and seen["x"].dtype == torch.float16
            and seen["y"].dtype == (torch.float16 if enable else torch.float32)
        )
    return out


def norm_modules(rank: int, world: int) -> dict[str, float]:
    """test_norm_modules_fp16 / _bf16, the parts torch's FSDP2 passes on CPU: LayerNorm, and BatchNorm2d with its
    buffers cast down, each its own call; the output is in the compute dtype and backward runs. (On CPU, BatchNorm1d
    and BatchNorm2d with fp32 buffers raise a dtype mismatch under FSDP2 too; the last part needs output_dtype.)"""
    out: dict[str, float] = {}
    for dtype in (torch.float16, torch.bfloat16):
        policy = impl().MixedPrecisionPolicy(param_dtype=dtype)
        builds = [
            (lambda: nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 32)), (4, 32), False),
            (lambda: nn.Sequential(nn.Conv2d(1, 5, 3), nn.BatchNorm2d(5), nn.Conv2d(5, 4, 3)), (3, 1, 9, 9), True),
        ]
        for i, (build, shape, cast_buffers) in enumerate(builds):
            model = build()
            for m in (model[0], model[1], model[2], model):
                fully_shard(m, mp_policy=policy)
            if cast_buffers:
                model[1].running_mean = model[1].running_mean.to(dtype)
                model[1].running_var = model[1].running_var.to(dtype)
            z = model(torch.randn(shape))
            z.sum().backward()
            out[f"{dtype}_{i}"] = float(z.dtype == dtype)
    return out


def grad_acc_with_reduce_dtype(rank: int, world: int) -> dict[str, float]:
    """test_grad_acc_with_reduce_dtype: bf16 compute, fp32 reduction, 4 micro-batches without sync but the last;
    against a bf16 compute copy whose gradients accumulate into an fp32 reference (upstream's emulation); loss dtype
    bf16 and equal losses; 5 of 10 steps, reshard T/F."""
    out: dict[str, float] = {}
    policy = impl().MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for raf in (True, False):
        torch.manual_seed(42)
        model = nn.Sequential(*(mlp(16) for _ in range(3)))
        ref = copy.deepcopy(model)
        ref_compute = copy.deepcopy(ref).to(torch.bfloat16)
        for m in model:
            fully_shard(m, reshard_after_forward=raf, mp_policy=policy)
        fully_shard(model, reshard_after_forward=raf, mp_policy=policy)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
        torch.manual_seed(42 + rank + 1)
        inp = torch.randn(8, 16, dtype=torch.bfloat16)
        worst = {"loss_diff": 0.0, "bf16_loss": 1.0, "grad_diff": 0.0}
        for step in range(5):
            for i, micro in enumerate(torch.chunk(inp, 4)):
                last = i == 3
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_backward(last or raf)
                losses = [ref_compute(micro).sum(), model(micro).sum()]
                worst["bf16_loss"] = min(worst["bf16_loss"], float(all(loss.dtype == torch.bfloat16 for loss in losses)))
                for loss in losses:
                    loss.backward()
                worst["loss_diff"] = max(worst["loss_diff"], loss_diff(losses[0], losses[1]))
                for p, pc in zip(ref.parameters(), ref_compute.parameters()):
                    p.grad = pc.grad.float() if p.grad is None else p.grad + pc.grad
                    pc.grad = None
                if last:
                    average_grads(ref)
            worst["grad_diff"] = max(worst["grad_diff"], sharded_diff(ref, model, grads=True))
            for o in (ref_opt, opt):
                o.step()
                o.zero_grad(set_to_none=step % 2 == 0)
            for p, pc in zip(ref.parameters(), ref_compute.parameters()):
                pc.detach().copy_(p)
        out.update({f"{k}_{raf}": v for k, v in worst.items()})
    return out
