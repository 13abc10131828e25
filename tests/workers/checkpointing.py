"""Rank-side workers for checkpoint tests: each phase runs in fresh processes."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import fsdp_graph
from fsdp_graph.state.optim import init_optimizer_state
from tests.workers.training import Case, build, shard_and_compile


def _model_and_optimizer(seed: int, mode: str = "aot", layout: str | None = None):
    torch.manual_seed(seed)
    model, loss_fn, make_batch = build("gpt")
    compiled, _ = shard_and_compile(model, Case("gpt", mode=mode, layout=layout))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, compiled, optimizer, loss_fn, make_batch


def _train(compiled, optimizer, loss_fn, make_batch, steps: range, rank: int, world: int) -> list[float]:
    losses = []
    for step in steps:
        full = make_batch(torch.Generator().manual_seed(step), 4 * world)
        loss = loss_fn(compiled, tuple(t.chunk(world)[rank] for t in full))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item())
    return losses


def _full_optim_state(model, optimizer) -> dict[str, torch.Tensor]:
    sd = fsdp_graph.optim_state_dict(model, optimizer)
    return {
        f"{fqn}/{k}": (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
        for fqn, st in sd["state"].items()
        for k, v in st.items()
    }


def resume_phase(rank: int, world: int, phase: str, path: str) -> dict:
    """ "straight": 6 steps. "first": 3 steps then save. "resume": a differently initialised model loads the
    checkpoint and trains steps 3..5. "resume_dcp": the same with torch's plain DCP recipe (a fresh optimizer's
    `optim_state_dict`, `dcp.load` into it, `load_optim_state_dict`) instead of `load_checkpoint`."""
    model, compiled, optimizer, loss_fn, make_batch = _model_and_optimizer(seed=0 if phase != "resume" else 99)
    if phase == "straight":
        losses = _train(compiled, optimizer, loss_fn, make_batch, range(6), rank, world)
    elif phase == "first":
        losses = _train(compiled, optimizer, loss_fn, make_batch, range(3), rank, world)
        fsdp_graph.save_checkpoint(path, model, optimizer)
    elif phase == "resume":
        fsdp_graph.load_checkpoint(path, model, optimizer)
        losses = _train(compiled, optimizer, loss_fn, make_batch, range(3, 6), rank, world)
    else:
        import torch.distributed.checkpoint as dcp

        state = {"model": model.state_dict(), "optim": fsdp_graph.optim_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        fsdp_graph.load_optim_state_dict(model, optimizer, state["optim"])
        losses = _train(compiled, optimizer, loss_fn, make_batch, range(3, 6), rank, world)
    return {"losses": losses, "params": fsdp_graph.full_state_dict(model), "optim": _full_optim_state(model, optimizer)}


def reshard_phase(rank: int, world: int, phase: str, path: str, layout: str | None = None) -> dict:
    """ "save": train 2 steps at this world size and save. "load": a fresh model and optimizer load it. `layout`:
    fully_shard's (None: its default)."""
    model, compiled, optimizer, loss_fn, make_batch = _model_and_optimizer(
        seed=0 if phase == "save" else 5, mode="eager", layout=layout
    )
    if phase == "save":
        _train(compiled, optimizer, loss_fn, make_batch, range(2), rank, world)
        fsdp_graph.save_checkpoint(path, model, optimizer)
    else:
        fsdp_graph.load_checkpoint(path, model, optimizer)
    return {"params": fsdp_graph.full_state_dict(model), "optim": _full_optim_state(model, optimizer)}


def fsdp2_interop(rank: int, world: int, direction: str, path: str, layout: str | None = None) -> float:
    """Max |difference| of full parameters after one side writes a DCP checkpoint and the other reads it (ours
    sharded with `layout`, None: fully_shard's default)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    torch.manual_seed(0)
    theirs, loss_fn, make_batch = build("gpt")
    for block in theirs.blocks:
        fsdp2_fully_shard(block)
    fsdp2_fully_shard(theirs)
    torch.manual_seed(7)
    ours, _, _ = build("gpt")
    fsdp_graph.fully_shard(ours, **({} if layout is None else {"layout": layout}))
    if direction == "fsdp2_to_ours":
        opt = torch.optim.SGD(theirs.parameters(), lr=0.1)
        batch = make_batch(torch.Generator().manual_seed(rank), 4)
        loss_fn(theirs, batch).backward()
        opt.step()
        dcp.save({"model": theirs.state_dict()}, checkpoint_id=path)
        fsdp_graph.load_checkpoint(path, ours, foreign=True)  # torch's DCP writes no checksums.json
    else:
        fsdp_graph.save_checkpoint(path, ours)
        state = {"model": theirs.state_dict()}
        dcp.load(state, checkpoint_id=path)
        theirs.load_state_dict(state["model"])
    full_ours = fsdp_graph.full_state_dict(ours)
    full_theirs = {k: v.full_tensor() for k, v in theirs.state_dict().items()}
    assert set(full_ours) == set(full_theirs), set(full_ours) ^ set(full_theirs)
    return max((full_ours[k] - full_theirs[k]).abs().max().item() for k in full_ours)


def interrupted_save(rank: int, world: int, path: str) -> dict:
    """A save that dies after writing its data but before publishing leaves the previous checkpoint intact."""
    import fsdp_graph.state.checkpoint as io

    model, compiled, optimizer, loss_fn, make_batch = _model_and_optimizer(seed=0, mode="eager")
    init_optimizer_state(optimizer)
    fsdp_graph.save_checkpoint(path, model, optimizer)
    saved = fsdp_graph.full_state_dict(model)
    _train(compiled, optimizer, loss_fn, make_batch, range(1), rank, world)

    def crash(staging, target):
        raise RuntimeError("killed while publishing")

    original, io._publish = io._publish, crash
    try:
        fsdp_graph.save_checkpoint(path, model, optimizer)
        raised = False
    except RuntimeError:
        raised = True  # every rank learns that rank 0 could not publish
    finally:
        io._publish = original
    dist.barrier()
    fresh, _, fresh_opt, _, _ = _model_and_optimizer(seed=3, mode="eager")
    fsdp_graph.load_checkpoint(path, fresh, fresh_opt)
    loaded = fsdp_graph.full_state_dict(fresh)
    try:
        fsdp_graph.load_checkpoint(path + ".tmp.missing", fresh)
        missing_raises = False
    except FileNotFoundError:
        missing_raises = True
    return {
        "raised": raised,
        "diff_to_first_save": max((loaded[k] - saved[k]).abs().max().item() for k in saved),
        "missing_raises": missing_raises,
        "damaged": _damaged_loads(path, fresh, fresh_opt),
    }


def _damaged_loads(path: str, model, optimizer) -> dict[str, str | None]:
    """The error every rank gets from `load_checkpoint` after rank 0 damages one shard file of the checkpoint:
    bytes flipped in place (same size), then truncated with the manifest removed (as in a checkpoint written by
    torch's FSDP2, which has none: loaded as foreign). None where the load went through."""
    shard = os.path.join(path, "__1_0.distcp")
    with open(shard, "rb") as f:
        intact = f.read()
    flipped = bytearray(intact)
    flipped[len(flipped) // 2 : len(flipped) // 2 + 16] = bytes(b ^ 0xFF for b in flipped[len(flipped) // 2 :][:16])
    errors: dict[str, str | None] = {}
    for case, content in (("flipped", bytes(flipped)), ("truncated_no_manifest", intact[: len(intact) // 2])):
        if dist.get_rank() == 0:
            with open(shard, "wb") as f:
                f.write(content)
            if case == "truncated_no_manifest":
                os.remove(os.path.join(path, "checksums.json"))
        dist.barrier()
        try:
            fsdp_graph.load_checkpoint(path, model, optimizer, foreign=case == "truncated_no_manifest")
            errors[case] = None
        except fsdp_graph.DamagedCheckpointError as e:
            errors[case] = str(e)
        dist.barrier()
    return errors
