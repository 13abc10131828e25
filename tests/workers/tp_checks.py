"""Checks of the tensor-parallel x FSDP parity worker (`tensor_parallel.tp_fsdp_parity`) after training: what the
optimizer holds (DTensor views aliasing the flat shards), the gradients, and the model and optimizer state dicts."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp_graph
from tests.workers.training import _bf16_reference_loss


def _max_abs(t: torch.Tensor) -> float:
    return t.abs().max().item() if t.numel() else 0.0


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a parameter, gradient or optimizer state: a DTensor's local tensor (every view of a
    tp model with the rows layout), a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def expected_local(ref_param: torch.Tensor, where: tuple, dp_rank: int, dp: int) -> torch.Tensor:
    """What a rank's optimizer view should hold: the reference parameter's tensor-parallel piece, then its dp row
    block (torch.chunk on dim 0, as the rows layout), or with the flat layout its slice of the flat shard.
    `where`: (tp spec or None, flat parameter state, slot)."""
    spec, state, slot = where
    value = ref_param.detach()
    if spec is not None and isinstance(spec.placements[0], Shard):
        value = value.chunk(spec.mesh.size(), dim=spec.placements[0].dim)[spec.mesh.get_local_rank()]
    if state.layout.kind == "flat":
        return state.layout.local_piece(value, slot)
    rows = value.chunk(dp, dim=0)
    return rows[dp_rank] if dp_rank < len(rows) else value[:0]


def _view_spec_is_expected(p: DTensor, entry: DTensor, tp: bool) -> bool:
    """A tp parameter's view has its state-dict entry's spec; another parameter's view is its entry (on fully_shard's
    mesh) followed by Replicate() on tp."""
    if tp:
        return p.placements == entry.placements and p.device_mesh == entry.device_mesh
    names = (*entry.device_mesh.mesh_dim_names, "tp")
    return tuple(p.placements) == (*entry.placements, Replicate()) and p.device_mesh.mesh_dim_names == names


def _view_checks(model: nn.Module, ref: nn.Module, specs: dict) -> dict[str, float]:
    """What the optimizer holds: how many parameters are DTensors, whether they all share one mesh, whether each
    one's local tensor lies inside its flat shard (so its in-place update is the shard's), whether its spec is the
    expected one (`_view_spec_is_expected`), and the max |full_tensor() - reference| over them."""
    params, state = dict(model.named_parameters()), model.state_dict()
    dtensors = {n: p for n, p in params.items() if isinstance(p, DTensor)}
    aliased = []
    for name, p in dtensors.items():
        shard, local = specs[name][1].flat_shard, p.to_local()
        offset = (local.data_ptr() - shard.data_ptr()) // local.element_size()
        same_storage = local.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()
        # An empty row block (the head's 1 row on dp rank 1) has no data pointer (0): its storage is the shard's.
        in_range = local.numel() == 0 or (0 <= offset and offset + local.numel() <= shard.numel())
        aliased.append(same_storage and in_range)
    ref_params = dict(ref.named_parameters())
    return {
        "dtensor_views": float(len(dtensors)),
        "one_mesh": float(len(dtensors) == len(params) and len({p.device_mesh for p in dtensors.values()}) == 1),
        "aliased": float(all(aliased)),
        "view_specs": float(
            all(_view_spec_is_expected(p, state[n], specs[n][0] is not None) for n, p in dtensors.items())
        ),
        "full_diff": max(
            (_max_abs(p.full_tensor() - ref_params[n].detach()) for n, p in dtensors.items()), default=0.0
        ),
    }


def _grad_checks(model, run, ref, batch, data_parts: int, data_rank: int, mp: bool) -> dict[str, float]:
    """One more backward (no step): a tp view's `.grad` is a DTensor with its spec whose full tensor is the
    reference's gradient; a second backward adds into the same gradient objects; zero_grad() sets them to None."""
    x, y = batch
    local_x, local_y = x.chunk(data_parts)[data_rank], y.chunk(data_parts)[data_rank]
    ref.zero_grad()
    if mp:
        _bf16_reference_loss(ref, lambda call, b: nn.functional.mse_loss(call(b[0]).float(), b[1]), (x, y))
    else:
        nn.functional.mse_loss(ref(x), y).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    params = dict(model.named_parameters())
    nn.functional.mse_loss(run(local_x).float(), local_y).backward()
    grads = {n: p.grad for n, p in params.items()}
    first = {n: _local(g).clone() for n, g in grads.items()}
    out = {
        "grad_specs": float(
            all(
                isinstance(g, DTensor) == isinstance(params[n], DTensor)
                and (not isinstance(g, DTensor) or (g.placements, g.shape) == (params[n].placements, params[n].shape))
                for n, g in grads.items()
            )
        ),
        "grad_full_diff": max(
            (_max_abs(g.full_tensor() - ref_grads[n]) for n, g in grads.items() if isinstance(g, DTensor)), default=0.0
        ),
    }
    nn.functional.mse_loss(run(local_x).float(), local_y).backward()
    out["grad_accumulated"] = float(
        all(params[n].grad is g and torch.allclose(_local(g), 2 * first[n], atol=1e-6) for n, g in grads.items())
    )
    model.zero_grad()
    out["grads_zeroed"] = float(all(p.grad is None for p in model.parameters()))
    ref.zero_grad()
    return out


def _state_dict_checks(
    model: nn.Module,
    ref: nn.Module,
    specs: dict,
    dp_rank: int,
    dp: int,
    dp_names: tuple[str, ...],
    sequence_parallel: bool = False,
) -> dict[str, float]:
    """The sharded state dict (DTensors on the (dp, tp) mesh for tp parameters, on dp for the others; HSDP: on
    (replicate, shard, tp) and (replicate, shard)) holds the reference's values; the full state dict too; loading a
    full and a sharded state dict restores the views."""
    from torch.distributed.tensor.placement_types import _StridedShard

    out: dict[str, float] = {}
    ref_values = {n: p.detach() for n, p in ref.named_parameters()}
    state = model.state_dict()
    out["sd_diff"] = max(_max_abs(state[n].full_tensor() - v) for n, v in ref_values.items())
    expected = {  # name suffix: tp dim or none, placements after HYBRID's Replicate
        "q.weight": (("tp",), (_StridedShard(0, split_factor=2), Shard(0))),
        "q.bias": (("tp",), (_StridedShard(0, split_factor=2), Shard(0))),
        "o.weight": (("tp",), (Shard(0), Shard(1))),
        "o.bias": (("tp",), (Shard(0), Replicate())),
        "norm1.weight": ((("tp",), (Shard(0), Replicate())) if sequence_parallel else ((), (Shard(0),))),
        "head.weight": ((), (Shard(0),)),
    }
    if sequence_parallel:
        expected["inp.weight"] = (("tp",), (Shard(0), Shard(1)))
    replicas = (Replicate(),) * (len(dp_names) - 1)
    checked = [
        tuple(state[n].placements) == (*replicas, *placements)
        and state[n].device_mesh.mesh_dim_names == (*dp_names, *names)
        for suffix, (names, placements) in expected.items()
        for n in state
        if n.endswith(suffix)
    ]
    out["sd_placements"] = float(len(checked) == 2 * 5 + 1 + sequence_parallel and all(checked))
    full = fsdp_graph.full_state_dict(model)
    out["full_sd_diff"] = max(_max_abs(full[n] - v) for n, v in ref_values.items())
    saved = {
        n: DTensor.from_local(v.to_local().clone(), v.device_mesh, v.placements, shape=v.shape, stride=v.stride())
        for n, v in state.items()
        if isinstance(v, DTensor)
    }
    params = dict(model.named_parameters())
    for source, key in ((full, "load_full_diff"), (saved, "load_sharded_diff")):
        with torch.no_grad():
            for p in params.values():
                p.zero_()
        model.load_state_dict(source, strict=False)
        out[key] = max(
            _max_abs(_local(params[n]).detach() - expected_local(p, specs[n], dp_rank, dp))
            for n, p in ref.named_parameters()
        )
    return out


def _optim_state_dict_checks(model, ref, opt, ref_opt, specs: dict, dp_rank: int, dp: int) -> dict[str, float]:
    """The optimizer state dict's per-element states (SGD's momentum buffers, AdamW's exp_avg and exp_avg_sq) are
    DTensors of the reference's, and load back (as DTensors with their parameter's spec where it is one); the
    optimizer steps again after the load."""
    keys = [k for k, v in next(iter(ref_opt.state.values())).items() if v.dim() > 0]
    ref_states = {(n, k): ref_opt.state[p][k] for n, p in ref.named_parameters() for k in keys}
    saved = fsdp_graph.optim_state_dict(model, opt)
    out = {"osd_diff": max(_max_abs(saved["state"][n][k].full_tensor() - v) for (n, k), v in ref_states.items())}
    for entry in saved["state"].values():
        for key in keys:
            value = entry[key]
            entry[key] = DTensor.from_local(
                value.to_local().clone(), value.device_mesh, value.placements, shape=value.shape, stride=value.stride()
            )
    params = dict(model.named_parameters())
    for p in params.values():
        for key in keys:
            opt.state[p][key].zero_()
    fsdp_graph.load_optim_state_dict(model, opt, saved)
    out["load_osd_diff"] = max(
        _max_abs(_local(opt.state[params[n]][k]) - expected_local(v, specs[n], dp_rank, dp))
        for (n, k), v in ref_states.items()
    )
    out["osd_state_types"] = float(
        all(isinstance(opt.state[p][k], DTensor) == isinstance(p, DTensor) for p in params.values() for k in keys)
    )
    for p in params.values():
        p.grad = torch.zeros_like(p)
    opt.step()  # steps the loaded states (DTensors like their parameters, or all plain) again
    opt.zero_grad()
    return out
