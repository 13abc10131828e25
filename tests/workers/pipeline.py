"""Rank-side worker for pipeline parallelism (issue 14): stages sharded over the dp dimension of a (pp, dp) mesh,
run by torch.distributed.pipelining schedules through `fsdp_graph.PipelineStage`."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed import pipelining
from torch.distributed.device_mesh import init_device_mesh

import fsdp_graph
from fsdp_graph.planning.measure import executed_collectives
from fsdp_graph.runtime.unit import flat_params

DIM = 32
BLOCKS = 4  # two per stage
MICROBATCHES = 4
MICRO_ROWS = 2


class Blocks(nn.Module):
    """`blocks[start:stop]` of the whole model (tanh MLP blocks; each a unit), with the head on the last stage."""

    def __init__(self, count: int, head: bool):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(count))
        self.head = nn.Linear(DIM, 1) if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x if self.head is None else self.head(x)


def split(model: Blocks, stage: int, stages: int) -> tuple[Blocks, dict[str, str]]:
    """Stage `stage`'s part of `model` (a copy) and the names of its parameters in `model`."""
    per = len(model.blocks) // stages
    part = Blocks(per, head=stage == stages - 1)
    part.load_state_dict({k: v for k, v in _stage_state(model, stage, per).items() if k in part.state_dict()})
    names = {n: _whole_name(n, stage * per) for n, _ in part.named_parameters()}
    return part, names


def _stage_state(model: Blocks, stage: int, per: int) -> dict[str, torch.Tensor]:
    state = {}
    for name, value in model.state_dict().items():
        if name.startswith("blocks."):
            index = int(name.split(".")[1])
            if stage * per <= index < (stage + 1) * per:
                state[name.replace(f"blocks.{index}.", f"blocks.{index - stage * per}.", 1)] = value
        else:
            state[name] = value
    return state


def _whole_name(name: str, offset: int) -> str:
    if not name.startswith("blocks."):
        return name
    index = int(name.split(".")[1])
    return name.replace(f"blocks.{index}.", f"blocks.{index + offset}.", 1)


SCHEDULES = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}


def pipeline_parity(rank: int, world: int, phases: tuple[str, ...], steps: int) -> dict:
    """(pp=2, dp=2) on 4 ranks: pipeline p (dp coordinate) trains on its half of each global batch, stage s (pp
    coordinate) owns blocks [2s, 2s+2) (+ the head on the last stage), sharded over its dp group and compiled with
    eager kernels. Each phase runs `steps` steps of one schedule ("gpipe", "1f1b"; "torch" = torch's own
    PipelineStage under GPipe; "eager" = GPipe on the uncompiled module) with 4 microbatches, on the same model and optimizer; a single-process model trains
    on the whole batches beside it. Per phase: the largest parameter difference, and the collectives of one step
    after the first."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    stage, stages = mesh["pp"].get_local_rank(), mesh["pp"].size()
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    torch.manual_seed(0)
    ref = Blocks(BLOCKS, head=True)
    model, names = split(ref, stage, stages)
    fsdp_graph.fully_shard(model, mesh["dp"])
    backend = fsdp_graph.make_backend(inductor=False, verify_timeout_s=60)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    gen = torch.Generator().manual_seed(7)
    rows = MICROBATCHES * MICRO_ROWS * dp_size
    out: dict = {"stage": stage, "units": sum(s.flat_shard.requires_grad for s in flat_params(model))}
    out["lone_recompiles"] = 0
    for phase in phases:
        stage_cls = pipelining.PipelineStage if phase == "torch" else fsdp_graph.PipelineStage
        module = model if phase == "eager" else compiled
        pp_stage = stage_cls(module, stage, stages, torch.device("cpu"), group=mesh["pp"].get_group())
        schedule = SCHEDULES.get(phase, pipelining.ScheduleGPipe)(
            pp_stage, MICROBATCHES, loss_fn=nn.functional.mse_loss
        )
        for step in range(steps):
            x, y = torch.randn(rows, DIM, generator=gen), torch.randn(rows, 1, generator=gen)
            mine = x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]

            def run(mine: tuple = mine, schedule=schedule) -> None:
                if stage == 0:
                    schedule.step(mine[0])
                else:
                    schedule.step(target=mine[1])

            if phase == "gpipe" and step == 2 and rank == world - 1:
                torch._dynamo.reset()  # a recompile on this rank alone (the same collectives): the check passes it
                out["lone_recompiles"] = 1
            if step == 1:
                seen = executed_collectives(run)
                out[f"{phase}_reduce_scatters"] = seen.counts["all_to_all"] + seen.counts["reduce_scatter"]
                out[f"{phase}_all_gathers"] = seen.counts["all_gather"]
                out[f"{phase}_all_reduces"] = seen.counts["all_reduce"]
            else:
                run()
            nn.functional.mse_loss(ref(x), y).backward()
            if phase == "1f1b":
                _clip_both([model], ref, mesh, out)
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        full = {n: v.full_tensor() for n, v in model.state_dict().items()}
        whole = dict(ref.named_parameters())
        out[f"{phase}_max_diff"] = max((full[n] - whole[names[n]]).abs().max().item() for n in names)
        out[f"{phase}_graphs"] = backend.dynamo_graphs
    out["pending"] = any(s.unsynced is not None and s.unsynced.grad is not None for s in flat_params(model))
    out["sync_after"] = model.__dict__["_fsdp_root"].requires_gradient_sync
    return out


MULTI_SCHEDULES = {"interleaved": pipelining.ScheduleInterleaved1F1B, "looped_bfs": pipelining.ScheduleLoopedBFS}


def multi_stage_parity(rank: int, world: int, phases: tuple[str, ...], steps: int) -> dict:
    """Two stages per rank: 4 stages of one block each (the head on the last) on a (pp=2, dp=2) mesh, stage i on
    pp rank i % 2; each stage module sharded over the dp group and compiled on its own. Same checks as
    `pipeline_parity`, for schedules with several local stages."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    pp_rank, stages = mesh["pp"].get_local_rank(), 2 * mesh["pp"].size()
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    torch.manual_seed(0)
    ref = Blocks(BLOCKS, head=True)
    backend = fsdp_graph.make_backend(inductor=False, verify_timeout_s=60)
    local = []  # (stage index, sharded module, compiled module, names in ref)
    for index in (pp_rank, pp_rank + mesh["pp"].size()):
        model, names = split(ref, index, stages)
        fsdp_graph.fully_shard(model, mesh["dp"])
        local.append((index, model, torch.compile(model, backend=backend, fullgraph=True), names))
    params = [p for _, model, _, _ in local for p in model.parameters()]
    opt, ref_opt = (
        torch.optim.SGD(params, lr=0.1, momentum=0.9),
        torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9),
    )
    gen = torch.Generator().manual_seed(7)
    rows = MICROBATCHES * MICRO_ROWS * dp_size
    units = sum(s.flat_shard.requires_grad for _, model, _, _ in local for s in flat_params(model))
    out: dict = {"units": units}
    for phase in phases:
        pp_stages = [
            fsdp_graph.PipelineStage(compiled, index, stages, torch.device("cpu"), group=mesh["pp"].get_group())
            for index, _, compiled, _ in local
        ]
        schedule = MULTI_SCHEDULES[phase](pp_stages, MICROBATCHES, loss_fn=nn.functional.mse_loss)
        for step in range(steps):
            x, y = torch.randn(rows, DIM, generator=gen), torch.randn(rows, 1, generator=gen)
            mine = x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]

            def run(mine: tuple = mine, schedule=schedule) -> None:
                schedule.step(*(mine[:1] if pp_rank == 0 else ()), target=mine[1] if pp_rank == 1 else None)

            if step == 1:
                seen = executed_collectives(run)
                out[f"{phase}_reduce_scatters"] = seen.counts["all_to_all"] + seen.counts["reduce_scatter"]
            else:
                run()
            nn.functional.mse_loss(ref(x), y).backward()
            if phase == "interleaved":
                _clip_both([model for _, model, _, _ in local], ref, mesh, out)
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        whole = dict(ref.named_parameters())
        diff = 0.0
        for _, model, _, names in local:
            full = {n: v.full_tensor() for n, v in model.state_dict().items()}
            diff = max(diff, max((full[n] - whole[names[n]]).abs().max().item() for n in names))
        out[f"{phase}_max_diff"] = diff
        out[f"{phase}_graphs"] = backend.dynamo_graphs
    return out


CLIP = 0.05  # below the gradient norms of this model and data: every step clips


def _clip_both(models: list[nn.Module], ref: nn.Module, mesh, out: dict) -> None:
    """fsdp_graph.clip_grad_norm_ over this rank's stages and the pp group vs torch's on the whole model."""
    norm = fsdp_graph.clip_grad_norm_(models, CLIP, pp_group=mesh["pp"].get_group())
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
    out["clip_norm_diff"] = max(out.get("clip_norm_diff", 0.0), (norm - ref_norm).abs().item())
    out["clipped"] = min(out.get("clipped", 1.0), float(ref_norm > CLIP))


def pipeline_checks(rank: int, world: int, steps: int) -> dict:
    """Both workers in one spawn: GPipe, 1F1B, torch's own stage and the eager module; then Interleaved 1F1B and
    looped BFS."""
    single = pipeline_parity(rank, world, ("gpipe", "1f1b", "torch", "eager"), steps)
    multi = multi_stage_parity(rank, world, ("interleaved", "looped_bfs"), steps)
    return {"single": single, "multi": multi}
