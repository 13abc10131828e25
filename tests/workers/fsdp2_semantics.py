"""Rank-side checks of what `fsdp_graph.fsdp2` now supports instead of refusing (issue 32), each against torch's own
FSDP2 on the same code: requires_grad changed after the calls, `load_state_dict(assign=True)` into a model sharded on
meta (torchtune's and accelerate's loading, written here with torch only), `MixedPrecisionPolicy(output_dtype=...)`
and a meta-device model with `CPUOffloadPolicy`. One spawn runs every check, eager and compiled; each result is a
dict of floats under its name (an exception is recorded as `error`, so one failing check does not hide the others).
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

import fsdp_graph
from fsdp_graph import fsdp2
from fsdp_graph.fsdp2 import CPUOffloadPolicy, MixedPrecisionPolicy
from tests.workers.fsdp2_upstream import mlp_stack

MODES = ("eager", "compiled")
Shard = Callable[..., object]  # fully_shard: torch's or fsdp_graph.fsdp2's


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor, whether a DTensor or a plain one (FSDP2 leaves a root's parameters unsharded after a
    forward without backward when it does not reshard after forward)."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def _sum_reductions(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def _runner(model: nn.Module, mode: str, out: dict[str, float]) -> Callable[..., torch.Tensor]:
    if mode == "eager":
        return model
    torch._dynamo.reset()  # every check's models are new: no recompile limit carried over
    backend = fsdp_graph.make_backend(inductor=False)
    compiled = torch.compile(model, backend=backend, fullgraph=True)

    def run(*args, **kwargs):
        result = compiled(*args, **kwargs)
        out["graphs"] = float(backend.dynamo_graphs)
        return result

    return run


class Pair:
    """The same model sharded by fsdp_graph.fsdp2 (`ours`, run eager or compiled) and by torch's FSDP2 (`theirs`),
    trained side by side with SGD and momentum; `out` collects the largest differences."""

    def __init__(self, build: Callable[[], nn.Module], shard: Callable[[nn.Module, Shard], None], mode: str) -> None:
        torch.manual_seed(0)
        self.ours = build()
        self.theirs = copy.deepcopy(self.ours)
        shard(self.ours, fsdp2.fully_shard)
        shard(self.theirs, torch_fully_shard)
        _sum_reductions(self.theirs)
        self.opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (self.ours, self.theirs)]
        self.out: dict[str, float] = {"loss_diff": 0.0, "param_diff": 0.0, "grad_diff": 0.0, "same_grads": 1.0}
        self.run = _runner(self.ours, mode, self.out)

    def step(self, x: torch.Tensor, backward: bool = True, set_to_none: bool = True) -> None:
        losses = []
        for run in (self.run, self.theirs):
            if not backward:
                with torch.no_grad():
                    losses.append(run(x).float().pow(2).mean())
                continue
            loss = run(x).float().pow(2).mean()
            loss.backward()
            losses.append(loss)
        self.out["loss_diff"] = max(self.out["loss_diff"], abs(losses[0].item() - losses[1].item()))
        if backward:
            self.compare_grads()
            for opt in self.opts:
                opt.step()
                opt.zero_grad(set_to_none=set_to_none)
        self.compare_params()

    def compare_grads(self) -> None:
        theirs = dict(self.theirs.named_parameters())
        for name, p in self.ours.named_parameters():
            q = theirs[name]
            if (p.grad is None) != (q.grad is None):  # a frozen parameter gets no gradient, as FSDP2's
                self.out["same_grads"] = 0.0
            elif p.grad is not None:
                self.out["grad_diff"] = max(self.out["grad_diff"], (full(p.grad) - full(q.grad)).abs().max().item())

    def compare_params(self) -> None:
        theirs = dict(self.theirs.named_parameters())
        worst = max((full(p) - full(theirs[n])).abs().max().item() for n, p in self.ours.named_parameters())
        self.out["param_diff"] = max(self.out["param_diff"], worst)


def _each_linear(model: nn.Module, shard: Shard, **options) -> None:
    for module in model.modules():
        if isinstance(module, nn.Linear):
            shard(module, **options)


def _frozen_across_groups(rank: int, world: int, mode: str) -> dict[str, float]:
    """test_fully_shard_frozen.py::test_train_mixed_requires_grad_across_groups: six linears each called on their
    own (no root call), every other one frozen after the calls, a step under no_grad, the last step unfrozen
    (fine-tuning); for reshard_after_forward True and False (compiled: True)."""
    out: dict[str, float] = {}

    def build() -> nn.Sequential:
        return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(32, 32), nn.ReLU())])

    def set_requires_grad(model: nn.Sequential, requires_grad: bool) -> None:
        for linear in list(model)[0::4]:  # linears 0, 2, 4
            linear.requires_grad_(requires_grad)

    for reshard in (True, False) if mode == "eager" else (True,):  # compiled: the same mechanism, 6 s of compiling
        pair = Pair(build, lambda m, shard, r=reshard: _each_linear(m, shard, reshard_after_forward=r), mode)
        for model in (pair.ours, pair.theirs):
            set_requires_grad(model, False)
        torch.manual_seed(42 + rank)
        x = torch.randn(8, 32)
        for step in range(4):
            if step == 3:
                for model in (pair.ours, pair.theirs):
                    set_requires_grad(model, True)
            pair.step(x, backward=step != 1, set_to_none=step % 2 == 0)
        out.update({f"{k}_{reshard}": v for k, v in pair.out.items()})
    return out


def _frozen_in_group(rank: int, world: int, mode: str) -> dict[str, float]:
    """test_fully_shard_frozen.py::test_train_mixed_requires_grad_per_group with freeze_after_init: trainable and
    frozen parameters in one flat parameter (BitFit: biases only), then everything unfrozen, a weight frozen before
    the calls (in a flat parameter of its own) too; and the same in-projection frozen in every block before the
    first (compiled) step, then unfrozen in one block only (whose forward may be another block's reused body)."""
    out: dict[str, float] = {}

    def shard(model: nn.Sequential, fully_shard: Shard) -> None:
        for block in model:
            fully_shard(block)
        fully_shard(model)

    gen = torch.Generator().manual_seed(1)

    def batch() -> torch.Tensor:
        return torch.randn(world * 4, 8, generator=gen).chunk(world)[rank]

    def frozen_first() -> nn.Sequential:
        model = mlp_stack()
        model[2].out_proj.weight.requires_grad_(False)  # before the calls: a flat parameter of its own
        return model

    pair = Pair(frozen_first, shard, mode)
    pair.step(batch())
    for model in (pair.ours, pair.theirs):  # BitFit after the calls: biases only
        for name, p in model.named_parameters():
            p.requires_grad_("bias" in name)
    pair.step(batch(), set_to_none=False)
    for model in (pair.ours, pair.theirs):  # everything unfrozen, the weight frozen before the calls too
        model.requires_grad_(True)
    pair.step(batch())
    out.update({f"{k}_bitfit": v for k, v in pair.out.items()})

    pair = Pair(mlp_stack, shard, mode)
    for model in (pair.ours, pair.theirs):  # frozen alike in every block after the calls
        for block in model:
            block.in_proj.weight.requires_grad_(False)
    pair.step(batch())
    for model in (pair.ours, pair.theirs):  # unfrozen in one block only
        model[1].in_proj.weight.requires_grad_(True)
    pair.step(batch())
    out.update({f"{k}_one_block": v for k, v in pair.out.items()})
    return out


class RopeLM(nn.Module):
    """A small LM as torchtune and Hugging Face build them: tied embedding and head, blocks, a final norm and a
    non-persistent buffer (a rotary table) that the state dict does not hold."""

    def __init__(self, vocab: int = 16, dim: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = mlp_stack(dim, depth)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("rope", torch.empty(dim), persistent=False)
        self.tie_weights()
        self.rope_init()

    def tie_weights(self) -> None:
        self.head.weight = self.embed.weight

    def rope_init(self) -> None:
        self.rope = torch.arange(self.rope.numel(), dtype=torch.float32) / 8  # on the default device, as torchtune's

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(tokens) + self.rope)))


def _tokens(rank: int, world: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 16, (world * 2, 6), generator=gen).chunk(world)[rank]


def _torchtune_load(model: nn.Module, full_sd: dict[str, torch.Tensor]):
    """torchtune 0.6.1's `training.load_from_full_model_state_dict` (its path without NF4 and without torch's
    `set_model_state_dict`): the model's sharded state dict names each key's mesh and placements; each full tensor
    is cast to that dtype, distributed, wrapped in an nn.Parameter and loaded with assign=True."""
    meta_sd = model.state_dict()
    sharded = {}
    for name, value in full_sd.items():
        spec = meta_sd[name]
        sharded[name] = nn.Parameter(distribute_tensor(value.to(spec.dtype), spec.device_mesh, spec.placements))
    return model.load_state_dict(sharded, strict=True, assign=True)


def _assign_torchtune(rank: int, world: int, mode: str) -> dict[str, float]:
    """torchtune's full_finetune_distributed: the model built on meta, each block then the model sharded, the rotary
    buffers made (`rope_init`), the checkpoint loaded with `_torchtune_load`; the loaded weights must be exactly the
    checkpoint's (a full round trip), and training continue as FSDP2's after the same flow."""
    torch.manual_seed(3)
    checkpoint = RopeLM().state_dict()
    out: dict[str, float] = {}

    def build() -> nn.Module:
        with torch.device("meta"):
            return RopeLM()

    def shard(model: RopeLM, fully_shard: Shard) -> None:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        with torch.device("cpu"):  # torchtune: `with self._device: m.rope_init()`
            model.rope_init()
        out[f"keys_{fully_shard is torch_fully_shard}"] = float(not any(_torchtune_load(model, checkpoint)))

    pair = Pair(build, shard, mode)
    loaded = {k: full(v) for k, v in pair.ours.state_dict().items()}
    out["round_trip_diff"] = max((loaded[k] - v).abs().max().item() for k, v in checkpoint.items())
    out["same_keys"] = float(sorted(loaded) == sorted(checkpoint))
    out["tied"] = float(pair.ours.head.weight is pair.ours.embed.weight)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        pair.step(_tokens(rank, world, gen))
    return {**out, **pair.out}


def _accelerate_load(model: nn.Module, full_sd: dict[str, torch.Tensor], cpu_offload: bool) -> None:
    """accelerate 1.15.0's `fsdp2_load_full_state_dict`: rank 0 broadcasts each full parameter (the others receive
    into empty tensors), each rank distributes it as the sharded state dict says, casts it to the parameter's dtype,
    makes it contiguous (and moves it to the CPU under CPU offload), and the whole dict is loaded with assign=True."""
    sharded = {}
    for name, spec in model.state_dict().items():
        mesh = spec.device_mesh
        if dist.get_rank() == 0:
            value = full_sd[name].detach().to(mesh.device_type)
        else:
            value = torch.empty(spec.size(), device=mesh.device_type, dtype=spec.dtype)
        dist.broadcast(value, src=0, group=dist.group.WORLD)
        local = distribute_tensor(value, mesh, spec.placements).to(dtype=model.get_parameter(name).dtype).contiguous()
        sharded[name] = local.to("cpu") if cpu_offload else local
    model.load_state_dict(sharded, assign=True)


def _assign_accelerate(rank: int, world: int, mode: str) -> dict[str, float]:
    """accelerate's `fsdp2_prepare_model` with `cpu_ram_efficient_loading` and bf16 (its policy for
    `mixed_precision="bf16"`: param, reduce and output dtype bf16): the state dict taken, the model moved to meta and re-tied, the blocks called, then the
    tail [norm, embedding, head] (tied) as one call without resharding, then the root; `_accelerate_load`, the
    non-persistent buffers registered again and the weights tied again. Rank 0 alone holds the real weights."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.bfloat16)
    out: dict[str, float] = {}
    checkpoint: dict[str, dict[str, torch.Tensor]] = {}

    def build() -> nn.Module:
        torch.manual_seed(4 if rank == 0 else 100 + rank)  # only rank 0's weights are the checkpoint's
        return RopeLM()

    def shard(model: RopeLM, fully_shard: Shard) -> None:
        original = {k: v.clone() for k, v in model.state_dict().items()}
        checkpoint[str(fully_shard is torch_fully_shard)] = original
        buffers = {"rope": model.rope.clone()}
        model.to(torch.device("meta"))
        model.tie_weights()
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard([model.norm, model.embed, model.head], mp_policy=policy, reshard_after_forward=False)
        fully_shard(model, mp_policy=policy)
        _accelerate_load(model, original, cpu_offload=False)
        for name, value in buffers.items():
            model.register_buffer(name, value, persistent=False)
        model.tie_weights()

    pair = Pair(build, shard, mode)
    given = {k: v.clone() for k, v in checkpoint["False"].items()}
    dist.broadcast_object_list(obj := [given], src=0)
    loaded = {k: full(v) for k, v in pair.ours.state_dict().items()}
    out["round_trip_diff"] = max((loaded[k] - v).abs().max().item() for k, v in obj[0].items())
    gen = torch.Generator().manual_seed(2)
    out["output_dtype_same"] = 1.0
    for _ in range(3):
        x = _tokens(rank, world, gen)
        mine, theirs = pair.run(x), pair.theirs(x)
        out["output_dtype_same"] = min(out["output_dtype_same"], float(mine.dtype == theirs.dtype == torch.bfloat16))
        pair.step(x)
    return {**out, **pair.out}


def _meta_offload(rank: int, world: int, mode: str) -> dict[str, float]:
    """test_fully_shard_state_dict.py::test_dp_state_dict_cpu_offload: two linears built on meta, called with
    CPUOffloadPolicy, loaded one parameter at a time (assign=True, strict=False) with some parameters still on meta;
    then a forward, a state dict on the CPU, and training as FSDP2's. Then the other meta flow: `to_empty()` and an
    init that writes every parameter."""
    out: dict[str, float] = {}
    torch.manual_seed(5)
    values = {f"{i}.weight": torch.randn(4, 4) for i in range(2)}

    def build() -> nn.Module:
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))

    def by_pieces(model: nn.Module, fully_shard: Shard) -> None:
        for module in model:
            fully_shard(module, offload_policy=CPUOffloadPolicy(pin_memory=False))
        fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
        for name, p in model.named_parameters():
            piece = {name: distribute_tensor(values[name], p.device_mesh, p.placements)}
            model.load_state_dict(piece, assign=True, strict=False)

    def by_init(model: nn.Module, fully_shard: Shard) -> None:
        for module in model:
            fully_shard(module, offload_policy=CPUOffloadPolicy(pin_memory=False))
        fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
        model.to_empty(device="cpu")
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(distribute_tensor(values[name], p.device_mesh, p.placements))

    gen = torch.Generator().manual_seed(6)
    for flow, shard in (("pieces", by_pieces), ("init", by_init)):
        pair = Pair(build, shard, mode)
        out[f"cpu_{flow}"] = float(all(v.device.type == "cpu" for v in pair.ours.state_dict().values()))
        out[f"loaded_{flow}"] = max((full(p) - values[n]).abs().max().item() for n, p in pair.ours.named_parameters())
        for _ in range(3):
            pair.step(torch.randn(world * 4, 4, generator=gen).chunk(world)[rank])
        out.update({f"{k}_{flow}": v for k, v in pair.out.items()})
    return out


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.c(self.b(x))


def _unreached_in_flat_param(rank: int, world: int, mode: str) -> dict[str, float]:
    """Issue 32: parameters of one flat parameter (`a`, `b` and `c` in the root's unit; `c` also called on its own)
    the loss reaches in some steps only: both outputs in the loss, then only `a`'s (compiled: the other output still
    gets zeros from autograd), with zero_grad(set_to_none=False) before one of them (its zeros must stay as they
    are). Gradients None where FSDP2's are, values, parameters after SGD with momentum: as FSDP2's."""
    pair = Pair(_TwoHeads, lambda m, shard: (shard(m.c), shard(m)), mode)
    torch.manual_seed(42 + rank)
    for step in range(5):
        x = torch.randn(4, 16)
        for run in (pair.run, pair.theirs):
            first, second = run(x)
            (first.pow(2).mean() + (second.pow(2).mean() if step < 2 else 0)).backward()
        pair.compare_grads()
        for opt in pair.opts:
            opt.step()
            opt.zero_grad(set_to_none=step != 2)
        pair.compare_params()
    return pair.out


CHECKS: dict[str, Callable[[int, int, str], dict[str, float]]] = {
    "unreached_in_flat_param": _unreached_in_flat_param,
    "frozen_across_groups": _frozen_across_groups,
    "frozen_in_group": _frozen_in_group,
    "assign_torchtune": _assign_torchtune,
    "assign_accelerate": _assign_accelerate,
    "meta_offload": _meta_offload,
}


def semantics_checks(rank: int, world: int, names: tuple[str, ...] | None = None) -> dict[str, dict[str, float | str]]:
    results: dict[str, dict[str, float | str]] = {}
    for mode in MODES:
        for name, check in CHECKS.items():
            if names is None or name in names:
                results[f"{name}[{mode}]"] = _recorded(check, rank, world, mode)
    return results


def _recorded(check: Callable[..., dict[str, float]], *args) -> dict[str, float | str]:
    try:
        return check(*args)
    except Exception:  # recorded for the test that owns this check
        return {"error": traceback.format_exc(limit=8)}
    finally:
        fsdp2.calls._PENDING.clear()  # a failed check's calls must not shard with the next check's
