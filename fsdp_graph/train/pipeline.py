"""The main job's pipeline parallelism (`--pp N`): the Llama split into N stages, each sharded over its dp group of
a (pp, dp) mesh and compiled on its own, run by a torch.distributed.pipelining schedule through
`fsdp_graph.PipelineStage`.

A stage module keeps the whole model's parameter names (`blocks` is a ModuleDict keyed by the global block index,
as torchtitan does), so its state dict uses the names of the unsplit model.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fsdp_graph
from fsdp_graph.train.llama import Llama, LlamaBlock, LlamaConfig, RMSNorm, Rotary

SCHEDULES = ("1f1b", "gpipe")


class LlamaStage(nn.Module):
    """Blocks [start, stop) of `Llama(cfg)`, with the token embedding on the first stage and the final norm and head
    on the last. `forward` maps token ids (first stage) or hidden states to hidden states or logits (last stage).
    The head is never tied to the embedding: they live on different stages."""

    def __init__(self, cfg: LlamaConfig, stage: int, stages: int):
        super().__init__()
        if cfg.layers < stages:
            raise ValueError(f"--pp {stages}: the model has {cfg.layers} blocks, fewer than the stages")
        self.cfg = replace(cfg, tied=False)
        self.first, self.last = stage == 0, stage == stages - 1
        start, stop = stage * cfg.layers // stages, (stage + 1) * cfg.layers // stages
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim) if self.first else None
        self.rope = Rotary(cfg.head_dim, cfg.seq, cfg.rope_theta)
        self.blocks = nn.ModuleDict({str(i): LlamaBlock(cfg) for i in range(start, stop)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps) if self.last else None
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False) if self.last else None
        for block in self.blocks.values():
            block.attention.wo.init_std = block.feed_forward.w2.init_std = cfg.init_std / (2 * cfg.layers) ** 0.5
        for module in self.modules():
            self.init_module(module)

    def init_module(self, module: nn.Module) -> None:
        """Llama's initialisation of `module`'s own parameters and buffers (the meta-device `param_init_fn`)."""
        Llama.init_module(self, module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        cos, sin = self.rope(x.shape[1])
        for block in self.blocks.values():
            x = block(x, cos, sin)
        return x if self.output is None else self.output(self.norm(x))


def llama_stage_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The schedule's loss: mean next-token cross entropy in fp32, as `llama.llama_loss`."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


@dataclass
class PipelineRun:
    """This rank's stage of the job: its sharded module, the schedule, and where its loss comes from."""

    model: LlamaStage
    schedule: object
    pp_group: dist.ProcessGroup
    dp: int  # pipelines (data-parallel replicas of the whole pipeline)
    dp_rank: int

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """One pipelined forward and backward of this pipeline's batch; the mean loss on the last stage, else 0
        (summed over the world, the losses of the dp pipelines)."""
        inputs, targets = batch
        if self.model.first:
            self.schedule.step(inputs)
            return torch.zeros((), device=inputs.device)
        if self.model.last:
            losses: list[torch.Tensor] = []
            self.schedule.step(target=targets, losses=losses)
            return torch.stack([loss.detach() for loss in losses]).mean()
        self.schedule.step()
        return torch.zeros((), device=inputs.device)


def check_args(args: argparse.Namespace, world: int) -> str | None:
    """Why `--pp` cannot run with these options (None: it can)."""
    if world % args.pp:
        return f"--pp {args.pp} does not divide the {world} ranks"
    if fsdp_graph.ShardingStrategy[args.strategy].is_hybrid:
        return f"--pp with {args.strategy}: use FULL_SHARD, SHARD_GRAD_OP or NO_SHARD (a (pp, dp) mesh)"
    if args.batch % args.microbatches:
        return f"--microbatches {args.microbatches} does not divide --batch {args.batch}"
    return None


def build_pipeline(
    args: argparse.Namespace,
    world: int,
    device: torch.device,
    shard_kwargs: dict,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    backend,
) -> tuple[LlamaConfig, PipelineRun, torch.optim.Optimizer]:
    """This rank's stage: built on meta, sharded over `mesh["dp"]` (materialised one block at a time), compiled
    with `backend` (None: eager), wrapped in `fsdp_graph.PipelineStage` and scheduled."""
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_graph.train.llama import PRESETS, preset

    mesh = init_device_mesh(device.type, (args.pp, world // args.pp), mesh_dim_names=("pp", "dp"))
    stage_index = mesh["pp"].get_local_rank()
    cfg = replace(preset(args.preset, seq=max(args.seq, PRESETS[args.preset].seq)), tied=False)
    torch.manual_seed(args.seed)
    with torch.device("meta"):
        model = LlamaStage(cfg, stage_index, args.pp)
    fsdp_graph.fully_shard(
        model,
        mesh["dp"],
        wrap=fsdp_graph.ModuleWrapPolicy({LlamaBlock}),
        param_init_fn=model.init_module,
        device=device,
        **shard_kwargs,
    )
    opt = make_optimizer(model)
    run_model = torch.compile(model, backend=backend, fullgraph=True) if backend else model
    stage = fsdp_graph.PipelineStage(run_model, stage_index, args.pp, device, group=mesh["pp"].get_group())
    cls = {"1f1b": pipelining.Schedule1F1B, "gpipe": pipelining.ScheduleGPipe}[args.pp_schedule]
    schedule = cls(stage, args.microbatches, loss_fn=llama_stage_loss)
    dp = mesh["dp"]
    return cfg, PipelineRun(model, schedule, mesh["pp"].get_group(), dp.size(), dp.get_local_rank()), opt
