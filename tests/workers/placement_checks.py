"""Rank-side checks of tests/numerics/test_placements.py (issue 35): per-parameter placements and meshes through
`fsdp_graph.fsdp2`, against torch's FSDP2 on the same model, calls and meshes. Each check's result is a dict of
floats under "name[mode]" (an exception is recorded as `error`, so one failing check does not hide the others)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from tests.workers.placements import MoEModel, shard_moe_fsdp2

MODES = ("eager", "compiled")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _sum_reductions(module: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def _runner(model: nn.Module, mode: str, out: dict[str, float]):
    import fsdp_graph

    if mode == "eager":
        return model
    torch._dynamo.reset()
    backend = fsdp_graph.make_backend(inductor=mode == "inductor")
    compiled = torch.compile(model, backend=backend, fullgraph=True)

    def run(*args):
        result = compiled(*args)
        out["graphs"] = float(backend.dynamo_graphs)
        return result

    return run


def _worst(pairs) -> float:
    worst = 0.0
    for mine, theirs in pairs:
        if mine.shape != theirs.shape:
            return float("inf")
        if mine.numel():
            worst = max(worst, (mine.double() - theirs.double()).abs().max().item())
    return worst


def fsdp2_parity(build, shard, rank: int, world: int, mode: str, steps: int = 4, dim: int = 8) -> dict[str, float]:
    """`shard(model, fully_shard)` with fsdp_graph's `fsdp2.fully_shard` and with torch's, on copies of one model; SGD
    with momentum on each rank's batch: the largest loss, gradient and parameter differences (local tensors, which
    the same placements make comparable), whether every parameter has torch's placements and mesh, and whether
    parameters and gradients are contiguous (`test_shard_placement_fn_contiguous_params_grads`)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_graph import fsdp2

    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    shard(model, fsdp2.fully_shard)
    shard(ref, torch_fully_shard)
    _sum_reductions(ref)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    out = {"loss_diff": 0.0, "grad_diff": 0.0, "param_diff": 0.0, "contiguous": 1.0}
    run = _runner(model, mode, out)
    gen = torch.Generator().manual_seed(1)
    mine, theirs = dict(model.named_parameters()), dict(ref.named_parameters())
    initial = {n: _local(p).detach().clone() for n, p in mine.items()}
    out["same_placements"] = float(
        mine.keys() == theirs.keys()
        and all(
            mine[n].placements == theirs[n].placements and mine[n].device_mesh == theirs[n].device_mesh for n in mine
        )
    )
    for _ in range(steps):
        x = torch.randn(world * 4, dim, generator=gen).chunk(world)[rank]
        loss, ref_loss = run(x).float().pow(2).mean(), ref(x).float().pow(2).mean()
        loss.backward()
        ref_loss.backward()
        out["loss_diff"] = max(out["loss_diff"], abs(loss.item() - ref_loss.item()))
        out["grad_diff"] = max(out["grad_diff"], _worst((_local(mine[n].grad), _local(theirs[n].grad)) for n in mine))
        out["contiguous"] = min(
            out["contiguous"],
            float(all(_local(p).is_contiguous() and _local(p.grad).is_contiguous() for p in mine.values())),
        )
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        out["param_diff"] = max(out["param_diff"], _worst((_local(mine[n]), _local(theirs[n])) for n in mine))
    out["moved"] = float(any(not torch.equal(_local(p), initial[n]) for n, p in mine.items()))
    sd, ref_sd = model.state_dict(), ref.state_dict()
    out["state_dict_specs"] = float(
        sd.keys() == ref_sd.keys()
        and all(v.placements == ref_sd[k].placements and v.device_mesh == ref_sd[k].device_mesh for k, v in sd.items())
    )
    out["state_dict_diff"] = _worst((v.to_local(), ref_sd[k].to_local()) for k, v in sd.items())
    return out


def _checks(table: dict, rank: int, world: int, modes: tuple[str, ...], *args) -> dict[str, dict[str, float]]:
    """Every check of `table` in every mode, each result under "name[mode]"; an exception is recorded as the check's
    `error` (every check raises alike on every rank), so one failing check does not hide the others."""
    import time
    import traceback

    results = {}
    for name, (check, check_modes) in table.items():
        for mode in check_modes or modes:
            start, cpu = time.perf_counter(), time.process_time()
            try:
                results[f"{name}[{mode}]"] = check(rank, world, mode, *args)
            except Exception:
                results[f"{name}[{mode}]"] = {"error": traceback.format_exc()}
            results[f"{name}[{mode}]"]["seconds"] = time.perf_counter() - start  # wall and CPU: what a check costs
            results[f"{name}[{mode}]"]["cpu_seconds"] = time.process_time() - cpu
    return results


def titan_dims(**degrees) -> object:
    """torchtitan's own `ParallelDims` with its meshes built on CPU (its module picks the device type at import;
    `partial_dtensor` is its legacy mesh layout with a flattened `fsdp` dimension)."""
    from tests.workers import titan

    titan._import_models()
    import torchtitan.distributed.parallel_dims as parallel_dims

    parallel_dims.device_type = "cpu"
    world = torch.distributed.get_world_size()
    sizes = {"dp_replicate": 1, "dp_shard": -1, "cp": 1, "tp": 1, "pp": 1, "ep": 1, **degrees}
    dims = parallel_dims.ParallelDims(**sizes, world_size=world, spmd_backend="partial_dtensor")
    dims.build_mesh()
    return dims


def _largest_dim_model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8))


def _largest_dim(param: nn.Parameter) -> Shard:
    return Shard(param.shape.index(max(param.shape)))


def _largest_dim_check(rank: int, world: int, mode: str, mesh=None) -> dict[str, float]:
    """test_fully_shard_training.py::test_train_parity_single_group_shard_largest_dim (and
    test_shard_placement_fn_contiguous_params_grads): every parameter sharded on its largest dim."""
    mesh = mesh or init_device_mesh("cpu", (world,))
    out = fsdp2_parity(
        _largest_dim_model,
        lambda m, fully_shard: fully_shard(m, mesh=mesh, shard_placement_fn=_largest_dim),
        rank,
        world,
        mode,
        dim=32,
    )
    out["shard_1"] = float(_largest_dim_model()[0].weight.shape == (16, 32))  # sanity: largest dim is 1
    return out


def _per_call_policies_check(rank: int, world: int, mode: str) -> dict[str, float]:
    """Calls that differ in mixed precision and CPU offload (FSDP2's per-call settings), over torchtitan's
    `ParallelDims` "fsdp" mesh (an `_unflatten`ed view of its world mesh: issue 35's refusal, for a dense model)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    mesh = titan_dims().get_mesh("fsdp")

    def shard(model: MoEModel, fully_shard) -> None:
        bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(model.layers[0], mesh=mesh, mp_policy=bf16)
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32)  # casts the bf16 activations back
        fully_shard(model.layers[1], mesh=mesh, mp_policy=fp32, offload_policy=CPUOffloadPolicy(pin_memory=False))
        fully_shard(model, mesh=mesh)

    return fsdp2_parity(MoEModel, shard, rank, world, mode)


def _dcp_two_ranks(rank: int, world: int, mode: str, path: str) -> dict[str, float]:
    """DCP checkpoints with `Shard(1)` parameters move both ways between fsdp_graph and torch's FSDP2 (sharded on dim 0
    there), and one is left in `path` with its full tensors for the 4-rank load."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_graph import fsdp2

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(3)
    ours = fsdp2.fully_shard(_largest_dim_model(), mesh=mesh, shard_placement_fn=_largest_dim)
    full = {k: v.full_tensor() for k, v in ours.state_dict().items()}
    dcp.save(ours.state_dict(), checkpoint_id=os.path.join(path, "ours"))
    if rank == 0:
        torch.save(full, os.path.join(path, "full.pt"))
    theirs = torch_fully_shard(_largest_dim_model(), mesh=mesh)  # Shard(0): another layout
    sd = theirs.state_dict()
    dcp.load(sd, checkpoint_id=os.path.join(path, "ours"))
    theirs.load_state_dict(sd)
    out = {"into_fsdp2": _worst((v.full_tensor(), full[k]) for k, v in theirs.state_dict().items())}
    torch.manual_seed(4)
    theirs = torch_fully_shard(_largest_dim_model(), mesh=mesh, shard_placement_fn=_largest_dim)
    dcp.save(theirs.state_dict(), checkpoint_id=os.path.join(path, "theirs"))
    theirs_full = {k: v.full_tensor() for k, v in theirs.state_dict().items()}
    ours = fsdp2.fully_shard(_largest_dim_model(), mesh=mesh, shard_placement_fn=_largest_dim)
    sd = ours.state_dict()
    dcp.load(sd, checkpoint_id=os.path.join(path, "theirs"))
    ours.load_state_dict(sd)
    out["from_fsdp2"] = _worst((v.full_tensor(), theirs_full[k]) for k, v in ours.state_dict().items())
    out["shard_1_saved"] = float(ours.state_dict()["0.weight"].placements == (Shard(1),))
    # On two meshes at 2 ranks (ep 2: efsdp is 1 rank), for the 4-rank spawn to load on its own two meshes.
    dims = titan_dims(ep=2)
    torch.manual_seed(7)
    two = shard_moe_fsdp2(MoEModel(num_experts=2), fsdp2.fully_shard, dims.get_mesh("fsdp"), dims.get_mesh("efsdp"))
    dcp.save(two.state_dict(), checkpoint_id=os.path.join(path, "two_meshes"))
    two_full = {k: v.full_tensor() for k, v in two.state_dict().items()}
    if rank == 0:
        torch.save(two_full, os.path.join(path, "two_meshes_full.pt"))
    return out


def _state_dict_save_load(rank: int, world: int, mode: str, mesh=None) -> dict[str, float]:
    """test_fully_shard_state_dict.py::test_dp_state_dict_save_load with `use_shard_placement_fn=True` (mlp_dim 16,
    each parameter on its largest dim; HSDP at 4 ranks): state-dict values are DTensors sharing the parameters'
    storage; a state dict of new DTensors loads into the parameters in place; with reshard_after_forward=False the
    state dict after a forward equals the one before."""
    from fsdp_graph import fsdp2
    from tests.workers.fsdp2_upstream import MLP

    mesh = mesh or init_device_mesh("cpu", (world,))
    torch.manual_seed(42)
    base = nn.Sequential(MLP(16), nn.Sequential(MLP(16), nn.Linear(16, 16)), MLP(16))
    out = {"dtensors": 1.0, "shares_storage": 1.0, "loaded": 1.0, "kept_storage": 1.0, "after_forward": 1.0}
    for reshard in (True, False):
        model = copy.deepcopy(base)
        for module in model:
            fsdp2.fully_shard(module, mesh=mesh, shard_placement_fn=_largest_dim, reshard_after_forward=reshard)
        fsdp2.fully_shard(model, mesh=mesh, shard_placement_fn=_largest_dim, reshard_after_forward=reshard)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for p in params.values():
                p.fill_(1.0)
        pointers = {n: p.to_local().data_ptr() for n, p in params.items()}
        sd = model.state_dict()
        out["dtensors"] = min(out["dtensors"], float(sd.keys() == params.keys()))
        out["shares_storage"] = min(
            out["shares_storage"],
            float(all(v.to_local().data_ptr() == pointers[k] for k, v in sd.items() if pointers[k])),
        )
        model.load_state_dict({k: v.detach().clone().fill_(42.0 + rank) for k, v in sd.items()})
        out["loaded"] = min(out["loaded"], float(all(torch.all(p.to_local() == 42.0 + rank) for p in params.values())))
        out["kept_storage"] = min(
            out["kept_storage"], float(all(p.to_local().data_ptr() == pointers[n] for n, p in params.items()))
        )
        before = {k: v.full_tensor() for k, v in model.state_dict().items()}
        model(torch.randn(2, 16))
        after = model.state_dict()
        out["after_forward"] = min(
            out["after_forward"], float(all(torch.equal(after[k].full_tensor(), v) for k, v in before.items()))
        )
    out["shard_dims"] = float({p.placements[-1].dim for p in params.values()} == {0, 1})
    return out


TWO_RANKS = {
    "largest_dim": (_largest_dim_check, ("eager", "compiled", "inductor")),
    "per_call_policies": (_per_call_policies_check, None),
}


def placement_checks_2(rank: int, world: int, path: str) -> dict[str, dict[str, float]]:
    results = _checks(TWO_RANKS, rank, world, MODES)
    results.update(_checks({"state_dict_save_load": (_state_dict_save_load, ("eager",))}, rank, world, MODES))
    results.update(_checks({"dcp": (_dcp_two_ranks, ("eager",))}, rank, world, MODES, path))
    return results


def _two_meshes_check(rank: int, world: int, mode: str) -> dict[str, float]:
    """torchtitan's EP meshes (ParallelDims: fsdp over 4 ranks, efsdp over 2, ep 2): each block's 2 experts on efsdp
    with `Shard(1)` (torchtitan's choice when efsdp x ep = 4 > 2 experts) through `ShardPlacementResult`, the rest
    on fsdp. Without EP's token dispatch each ep group trains its own experts, identically in both."""
    dims = titan_dims(ep=2)
    fsdp_mesh, efsdp_mesh = dims.get_mesh("fsdp"), dims.get_mesh("efsdp")
    return fsdp2_parity(
        lambda: MoEModel(num_experts=2),
        lambda m, fs: shard_moe_fsdp2(m, fs, fsdp_mesh, efsdp_mesh, expert_dim=Shard(1)),
        rank,
        world,
        mode,
    )


def _uneven_experts_check(rank: int, world: int, mode: str) -> dict[str, float]:
    """Experts whose count does not divide the 4 ranks, placed as torchtitan places them without EP: 3 experts with
    `Shard(1)` (more ranks than experts), 6 experts with `Shard(0)` (row blocks 2, 2, 2 and an empty one)."""
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for experts in (3, 6):

        def shard(model, fully_shard, experts=experts):
            return shard_moe_fsdp2(model, fully_shard, mesh, expert_dim=Shard(1) if world > experts else Shard(0))

        result = fsdp2_parity(lambda e=experts: MoEModel(num_experts=e, depth=1), shard, rank, world, mode)
        out.update({f"{k}_{experts}": v for k, v in result.items()})
    return out


def _hsdp_titan_check(rank: int, world: int, mode: str) -> dict[str, float]:
    """HSDP over torchtitan's (dp_replicate, fsdp) mesh, experts `Shard(1)`: `(Replicate(), Shard(1))`."""
    mesh = titan_dims(dp_replicate=2).get_mesh(["dp_replicate", "fsdp"])
    return fsdp2_parity(
        lambda: MoEModel(num_experts=3, depth=1),
        lambda m, fs: shard_moe_fsdp2(m, fs, mesh, expert_dim=Shard(1)),
        rank,
        world,
        mode,
    )


def _per_call_mesh_check(rank: int, world: int, mode: str) -> dict[str, float]:
    """A call on its own mesh (efsdp, 2 ranks) in bf16, the others on fsdp (4 ranks)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dims = titan_dims(ep=2)
    fsdp_mesh, efsdp_mesh = dims.get_mesh("fsdp"), dims.get_mesh("efsdp")

    def shard(model: MoEModel, fully_shard) -> None:
        bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(model.layers[0], mesh=efsdp_mesh, mp_policy=bf16)
        fully_shard(model.layers[1], mesh=fsdp_mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
        fully_shard(model, mesh=fsdp_mesh)

    return fsdp2_parity(MoEModel, shard, rank, world, mode)


def _dcp_four_ranks(rank: int, world: int, mode: str, path: str) -> dict[str, float]:
    """The 2-rank `Shard(1)` checkpoint loads at 4 ranks (Shard(0) and Shard(1) layouts), so does the 2-rank two-mesh
    one (efsdp 1 rank there, 2 here); a model on two meshes saves and loads with torch's FSDP2 on the same meshes,
    both ways."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_graph import fsdp2

    full = torch.load(os.path.join(path, "full.pt"))
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, fn in (("rows", None), ("largest", _largest_dim)):
        model = fsdp2.fully_shard(_largest_dim_model(), mesh=mesh, shard_placement_fn=fn)
        sd = model.state_dict()
        dcp.load(sd, checkpoint_id=os.path.join(path, "ours"))
        model.load_state_dict(sd)
        out[f"world_2_to_4_{name}"] = _worst((v.full_tensor(), full[k]) for k, v in model.state_dict().items())
    dims = titan_dims(ep=2)
    fsdp_mesh, efsdp_mesh = dims.get_mesh("fsdp"), dims.get_mesh("efsdp")
    two_full = torch.load(os.path.join(path, "two_meshes_full.pt"))
    model = shard_moe_fsdp2(MoEModel(num_experts=2), fsdp2.fully_shard, fsdp_mesh, efsdp_mesh)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=os.path.join(path, "two_meshes"))
    model.load_state_dict(sd)
    out["two_meshes_world_2_to_4"] = _worst((v.full_tensor(), two_full[k]) for k, v in model.state_dict().items())

    def build(fully_shard, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return shard_moe_fsdp2(MoEModel(num_experts=2), fully_shard, fsdp_mesh, efsdp_mesh, expert_dim=Shard(1))

    for direction, (saver, loader) in {
        "into_fsdp2": (fsdp2.fully_shard, torch_fully_shard),
        "from_fsdp2": (torch_fully_shard, fsdp2.fully_shard),
    }.items():
        saved = build(saver, 5)
        where = os.path.join(path, f"two_meshes_{direction}")
        dcp.save(saved.state_dict(), checkpoint_id=where)
        expected = {k: v.full_tensor() for k, v in saved.state_dict().items()}
        loaded = build(loader, 6)
        sd = loaded.state_dict()
        dcp.load(sd, checkpoint_id=where)
        loaded.load_state_dict(sd)
        out[direction] = _worst((v.full_tensor(), expected[k]) for k, v in loaded.state_dict().items())
        out[f"{direction}_meshes"] = float(
            all(v.device_mesh == saved.state_dict()[k].device_mesh for k, v in loaded.state_dict().items())
        )
    return out


# Compiled where the graph differs from the 2-rank checks' (two meshes' collectives, uneven Shard(1) copies); the
# HSDP and per-call mesh checks test groups and settings, which the eager path takes from the same state.
FOUR_RANKS = {
    "two_meshes": (_two_meshes_check, None),
    "uneven_experts": (_uneven_experts_check, None),
    "hsdp_titan": (_hsdp_titan_check, ("eager",)),
    "per_call_mesh": (_per_call_mesh_check, ("eager",)),
}


def _hsdp_state_dict_save_load(rank: int, world: int, mode: str) -> dict[str, float]:
    hsdp = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    return _state_dict_save_load(rank, world, mode, hsdp)


def placement_checks_4(rank: int, world: int, path: str) -> dict[str, dict[str, float]]:
    results = _checks(FOUR_RANKS, rank, world, MODES)
    results.update(_checks({"state_dict_save_load": (_hsdp_state_dict_save_load, ("eager",))}, rank, world, MODES))
    results.update(_checks({"dcp": (_dcp_four_ranks, ("eager",))}, rank, world, MODES, path))
    return results
