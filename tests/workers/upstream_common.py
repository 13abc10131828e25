"""Shared pieces of the re-created FSDP2 tests (tests/workers/fsdp2_upstream*.py): the models torch's tests use
(torch's own test models, shipped in torch.testing._internal), a DDP-style reference, sharded parity checked through
public means (`full_tensor()`), and the switch that runs every check on torch's FSDP2 instead (`USE_TORCH_FSDP2`),
which is how the checks were confirmed to pass on torch's FSDP2 on CPU with gloo."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

import fsdp_graph
from fsdp_graph import fsdp2


def impl():
    """The `fully_shard` module under test: fsdp_graph's, or torch's FSDP2 when a validation run switched it."""
    return torch.distributed.fsdp if USE_TORCH_FSDP2 else fsdp2


USE_TORCH_FSDP2 = False


def fully_shard(module, **options):
    return impl().fully_shard(module, **options)


def transformer(**overrides):
    """torch's test Transformer (torch.testing._internal.distributed._tensor.common_dtensor), as upstream builds it."""
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    args = ModelArgs(**overrides)
    return Transformer(args), args


def blocks_of(model: nn.Module) -> list[nn.Module]:
    from torch.testing._internal.distributed._tensor.common_dtensor import TransformerBlock

    return [m for m in model.modules() if isinstance(m, TransformerBlock)]


def mlp(dim: int, **kwargs) -> nn.Module:
    from torch.testing._internal.common_fsdp import MLP

    return MLP(dim, **kwargs)


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter's or gradient's whole value (a collective for DTensors: call on every rank)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def average_grads(model: nn.Module) -> None:
    """DDP's gradient reduction on a replicated reference model."""
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)


def sharded_diff(ref: nn.Module, model: nn.Module, grads: bool = False) -> float:
    """check_sharded_parity through public means, as upstream checks it: each rank compares its own shards of the
    sharded model's parameters (or gradients) with the same pieces of the reference's, matched by name, and returns
    the largest difference, relative to the reference's largest magnitude where that exceeds 1 (summed losses give
    large gradients; torch's assertEqual tolerates relative error too). The ranks' pieces cover every element, and
    every rank's result is asserted on; a whole reference needs no collective (a `full_tensor()` per parameter made
    this check a fifth of the re-created tests' time), a sharded one is gathered."""
    wrapped = "_checkpoint_wrapped_module."  # checkpoint_wrapper's prefix (upstream: prefixes_to_ignore)
    params = {name.replace(wrapped, ""): p for name, p in model.named_parameters()}
    worst = 0.0
    for name, ref_param in ref.named_parameters():
        mine = params[name.replace(wrapped, "")]
        a, b = (ref_param.grad, mine.grad) if grads else (ref_param, mine)
        if a is None or b is None:
            if (a is None) != (b is None):
                return float("inf")
            continue
        a, b = a.detach(), b.detach()
        if isinstance(a, DTensor) and not _alike(a, b):  # a sharded reference laid out otherwise: compare whole
            a, b = a.full_tensor(), full(b)
        if a.shape != b.shape:
            return float("inf")
        if a.numel():
            scale = max(1.0, full(a).abs().max().item())
            a, b = _own_piece(a, b), local(b)
            if a.shape != b.shape:  # a local shard laid out otherwise than its DTensor says
                return float("inf")
            if b.numel():
                worst = max(worst, (a.double() - b.double()).abs().max().item() / scale)
    return worst


def _alike(a: DTensor, b: torch.Tensor) -> bool:
    return isinstance(b, DTensor) and a.device_mesh == b.device_mesh and a.placements == b.placements


def _own_piece(reference: torch.Tensor, sharded: torch.Tensor) -> torch.Tensor:
    """The piece of `reference` (a whole tensor, or a DTensor laid out as `sharded`) that this rank holds of
    `sharded` (split locally: `src_data_rank=None` moves nothing)."""
    if isinstance(reference, DTensor) or not isinstance(sharded, DTensor):
        return local(reference)
    return distribute_tensor(reference, sharded.device_mesh, sharded.placements, src_data_rank=None).to_local()


def loss_diff(ref: torch.Tensor | float, mine: torch.Tensor | float) -> float:
    """|ref - mine| relative to |ref| where that exceeds 1."""
    ref, mine = (float(v.detach()) if isinstance(v, torch.Tensor) else float(v) for v in (ref, mine))
    return abs(ref - mine) / max(1.0, abs(ref))


def compiled(model: nn.Module, mode: str, out: dict[str, float]) -> Callable:
    """`model` itself (eager) or compiled by fsdp_backend (fullgraph, inductor=False); `out["graphs"]` counts."""
    if mode == "eager":
        return model
    torch._dynamo.reset()
    backend = fsdp_graph.make_backend(inductor=False)
    compiled_model = torch.compile(model, backend=backend, fullgraph=True)

    def run(*args, **kwargs):
        result = compiled_model(*args, **kwargs)
        out["graphs"] = float(backend.dynamo_graphs)
        return result

    return run


def ddp_parity(
    build: Callable[[], nn.Module],
    shard: Callable[[nn.Module], object],
    inputs: Callable[[int], object],
    mode: str,
    steps: int,
    rank: int,
    loss: Callable[[object], torch.Tensor] = lambda out: out.sum(),
    set_to_none: Callable[[int], bool] = lambda step: step % 2 == 0,
    check_grads: bool = True,
    after_shard: Callable[[nn.Module], None] | None = None,
) -> dict[str, float]:
    """Upstream's training loop against `replicate` (DDP): the same input on a replicated reference whose gradients
    are averaged over the ranks; SGD with momentum (the project's rule; upstream uses Adam). `after_shard` runs on
    both models once the calls are made. Returns the largest loss, gradient and parameter differences over the steps
    (parameters after each optimizer step)."""
    torch.manual_seed(42)
    model = build()
    ref = copy.deepcopy(model)
    shard(model)
    if after_shard is not None:
        after_shard(model)
        after_shard(ref)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
    out = {"loss_diff": 0.0, "grad_diff": 0.0, "param_diff": sharded_diff(ref, model)}
    run = compiled(model, mode, out)
    torch.manual_seed(42 + rank + 1)
    for step in range(steps):
        x = inputs(step)
        for o in (opt, ref_opt):
            o.zero_grad(set_to_none=set_to_none(step))
        args = x if isinstance(x, tuple) else (x,)
        ref_loss, mine = loss(ref(*args)), loss(run(*args))
        ref_loss.backward()
        mine.backward()
        average_grads(ref)
        out["loss_diff"] = max(out["loss_diff"], loss_diff(ref_loss, mine))
        if check_grads:
            out["grad_diff"] = max(out["grad_diff"], sharded_diff(ref, model, grads=True))
        for o in (opt, ref_opt):
            o.step()
        out["param_diff"] = max(out["param_diff"], sharded_diff(ref, model))
    out["dtensors"] = float(all(isinstance(p, DTensor) for p in model.parameters()))
    return out


def all_dtensors(params: Iterable[nn.Parameter]) -> float:
    params = list(params)
    return float(bool(params) and all(isinstance(p, DTensor) for p in params))


def no_dtensors(params: Iterable[nn.Parameter]) -> float:
    params = list(params)
    return float(bool(params) and not any(isinstance(p, DTensor) for p in params))


def raises(fn: Callable[[], object], error: type[BaseException], *fragments: str) -> float:
    """1.0 when `fn` raises `error` with every fragment in its message."""
    try:
        fn()
    except error as caught:
        return float(all(f in str(caught) for f in fragments))
    except Exception:
        return 0.0
    return 0.0
