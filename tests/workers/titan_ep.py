"""Rank-side worker: torchtitan 0.3.0's expert-parallel recipe (`parallelize_qwen3` with ep x efsdp) with
`fsdp_graph.fsdp2.fully_shard` in place of torch's, eager and compiled, against torchtitan with torch's FSDP2 + EP
(issue 35)."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_graph
import fsdp_graph.fsdp2
from fsdp_graph.api.groups import dtensor_group_name
from tests.workers import titan
from tests.workers.fsdp2_titan import _train


def _shard(model: nn.Module, dims, fully_shard) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="reuse_blocks")  # blocks holding DTensors are traced one by one
        titan.parallelize_ep(model, dims, fully_shard)
    for module in model.modules():
        if isinstance(module, torch.distributed.fsdp.FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def _routing(model: nn.Module) -> list[float]:
    """Tokens routed to each expert so far, over every MoE layer (torchtitan counts them in a buffer, in place)."""
    return [v for n, b in model.named_buffers() if n.endswith("tokens_per_expert_E") for v in b.tolist()]


def _train_counting(run, model, rank, world, steps) -> tuple[list[float], list[list[float]]]:
    """`_train`, one step at a time, with each step's routing (the counts it added)."""
    losses, routings, before = [], [], _routing(model)
    for _ in range(steps):
        losses += _train(run, model, rank, world, 1)
        after = _routing(model)
        routings.append([a - b for a, b in zip(after, before)])
        before = after
    return losses, routings


def ep_recipes(
    rank: int, world: int, ep: int, cases: dict[str, dict], checkpoint: tuple[str, str, tuple[int, ...]] | None = None
) -> dict[str, dict]:
    """`ep_parity` of each case (its keyword arguments; "replicate": HSDP's dp_replicate degree), on torchtitan's
    meshes (ep x efsdp). `checkpoint`
    (case, directory, EP degrees): `ep_checkpoints` with that case's trained models, under "checkpoint"."""
    dims = titan.ep_dims(world, ep)
    out, models = {}, {}
    for name, case in cases.items():
        case = dict(case)
        replicate = case.pop("replicate", 1)
        at = dims if replicate == 1 else titan.ep_dims(world, ep, replicate)
        out[name], models[name] = ep_parity(rank, world, at, **case)
    if checkpoint is not None:
        name, path, degrees = checkpoint
        ours, theirs = models[name]
        sizes = {k: cases[name].get(k) for k in ("layers", "expert_hidden", "experts", "top_k")}
        out["checkpoint"] = ep_checkpoints(world, dims, ours, theirs, sizes, path, degrees)
    return out


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}


def _worst(loaded: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> float:
    assert sorted(loaded) == sorted(saved), (sorted(loaded), sorted(saved))
    return max((loaded[k].float() - v.float()).abs().max().item() for k, v in saved.items() if v.numel())


def ep_checkpoints(world: int, dims, ours: nn.Module, theirs: nn.Module, sizes: dict, path: str, degrees) -> dict:
    """DCP checkpoints of torchtitan's EP recipe: ours (fsdp_graph.fsdp2, trained) saved at `dims`' EP degree loads
    into torchtitan + torch's FSDP2 + EP at that degree, and into ours at each EP degree in `degrees` (experts
    resharded: ep 1 is plain experts over the dense mesh); torch's FSDP2 + EP's checkpoint (`theirs`, trained) loads
    into ours. Each value: the largest difference of any full state-dict tensor from the saved one."""
    import os

    import torch.distributed.checkpoint as dcp

    saved, their_saved = _full(ours), _full(theirs)
    dcp.save(ours.state_dict(), checkpoint_id=os.path.join(path, "ours"))
    dcp.save(theirs.state_dict(), checkpoint_id=os.path.join(path, "theirs"))

    def load(fully_shard, at, source: str) -> nn.Module:
        model = titan.build_ep("debugmodel_moe", at, **sizes, seed=1)
        _shard(model, at, fully_shard)
        state = model.state_dict()
        dcp.load(state, checkpoint_id=os.path.join(path, source))
        model.load_state_dict(state)
        return model

    out = {"into_fsdp2": _worst(_full(load(torch.distributed.fsdp.fully_shard, dims, "ours")), saved)}
    out["from_fsdp2"] = _worst(_full(load(fsdp_graph.fsdp2.fully_shard, dims, "theirs")), their_saved)
    for degree in degrees:
        model = load(fsdp_graph.fsdp2.fully_shard, titan.ep_dims(world, degree), "ours")
        out[f"ep{degree}"] = _worst(_full(model), saved)
        experts = next(p for n, p in model.named_parameters() if "inner_experts" in n)
        out[f"ep{degree}_experts_on"] = experts.device_mesh.mesh_dim_names
    return out


def ep_parity(
    rank: int,
    world: int,
    dims,
    layers: int,
    expert_hidden: int,
    steps: int,
    experts: int | None = None,
    top_k: int | None = None,
    modes: tuple[str, ...] = ("eager", "compiled"),
) -> dict:
    """Losses, every weight (local tensor and DTensor placement) and every buffer after `steps` SGD-with-momentum
    steps of torchtitan's Qwen3 debugmodel_moe (`layers` layers, experts of hidden size `expert_hidden`; `experts`
    and `top_k`: see `titan.build_ep`) under torchtitan's ep x efsdp recipe on `dims`: with torch's FSDP2 (eager),
    against the same recipe with fsdp_graph.fsdp2's fully_shard in each of `modes`, "eager" and "compiled"
    (fullgraph, eager kernels). Returns them and (the last mode's model, the reference), trained."""
    sizes = dict(layers=layers, expert_hidden=expert_hidden, experts=experts, top_k=top_k)
    reference = titan.build_ep("debugmodel_moe", dims, **sizes)
    _shard(reference, dims, torch.distributed.fsdp.fully_shard)
    ref_losses, ref_routing = _train_counting(reference, reference, rank, world, steps)
    ref_params = dict(reference.named_parameters())
    ref_buffers = {n: b.clone() for n, b in reference.named_buffers()}
    out: dict = {"loss_moved": ref_losses[0] - ref_losses[-1]}
    out["routing_changed"] = float(any(a != b for a, b in zip(ref_routing, ref_routing[1:])))
    experts = [n for n, p in ref_params.items() if "inner_experts" in n]
    out["experts_on"] = sorted(
        {(ref_params[n].device_mesh.mesh_dim_names, str(ref_params[n].placements)) for n in experts}
    )
    for mode in modes:
        model = titan.build_ep("debugmodel_moe", dims, **sizes)
        _shard(model, dims, fsdp_graph.fsdp2.fully_shard)
        run, backend = model, None
        if mode == "compiled":
            backend = fsdp_graph.make_backend(inductor=False)
            run = torch.compile(model, backend=backend, fullgraph=True)
        losses, routing = _train_counting(run, model, rank, world, steps)
        params = dict(model.named_parameters())
        out[f"{mode}_loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
        out[f"{mode}_routing_same"] = float(routing == ref_routing)
        out[f"{mode}_same_names"] = float(sorted(params) == sorted(ref_params))
        out[f"{mode}_same_specs"] = float(
            all(
                params[n].device_mesh.mesh_dim_names == p.device_mesh.mesh_dim_names
                and params[n].placements == p.placements
                and params[n].shape == p.shape
                for n, p in ref_params.items()
            )
        )
        out[f"{mode}_weight_diff"] = max(
            (
                (params[n].to_local() - p.to_local()).abs().max().item()
                for n, p in ref_params.items()
                if p.to_local().numel()
            ),
            default=0.0,
        )  # an empty row block: 2 router rows over 4 ranks
        buffers = dict(model.named_buffers())
        out[f"{mode}_buffer_diff"] = max((buffers[n] - b).abs().max().item() for n, b in ref_buffers.items())
        if backend is not None:
            out["graphs"] = backend.dynamo_graphs
            # as the graphs name it: the alias of the ep group, the dimension of the experts' DTensor mesh
            ep_group = dtensor_group_name(dims.get_mesh("ep"), 0)
            # the model's own all-to-alls carry no fsdp unit; fully_shard's (gloo's reduce-scatters) do
            out["ep_all_to_alls"] = {
                r.stage: sum(1 for kind, unit in r.collectives.units if kind == "all_to_all" and unit == "?")
                for r in backend.reports
            }
            out["ep_group_in_graphs"] = {r.stage: ep_group in r.groups for r in backend.reports}
            # the lines the rank-agreement check compares across ranks (compiler/rank_check.py)
            out["ep_fingerprint"] = {
                r.stage: sum(line.startswith(f"all_to_all_single(group={ep_group},") for line in r.fingerprint)
                for r in backend.reports
            }
            # what explain() names each group of the graphs by (its bytes are reported per role)
            from fsdp_graph.planning.groups import group_roles
            from fsdp_graph.runtime.unit import flat_params

            groups = sorted({g for r in backend.reports for g in r.groups})
            out["group_roles"] = sorted(set(group_roles(flat_params(model), groups).values()))
    return out, (model, reference)
