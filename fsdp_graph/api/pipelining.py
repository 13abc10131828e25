"""Pipeline parallelism: a `torch.distributed.pipelining` stage whose module is sharded by `fully_shard` (issue 14).

torch's `PipelineStage` special-cases torch's own FSDP and DDP modules to reduce gradients once per step rather
than once per microbatch; a module sharded by fsdp_graph is neither, so with torch's stage every microbatch's
backward would reduce-scatter. `fsdp_graph.PipelineStage` is torch's stage with that one difference:

- every forward of the stage runs with gradient sync off (`set_requires_gradient_sync(module, False)`), so every
  microbatch's backward adds its unreduced gradient to the unit's accumulator and communicates nothing. The sync
  flag must be set at FORWARD time: under torch.compile it selects the graph (and so its backward) when the
  forward runs, and GPipe and 1F1B run later microbatches' forwards before earlier ones' backwards;
- after the schedule's last backward of the step (`last_backward`, which the schedule computes per stage), one
  eager reduce-scatter per unit reduces the accumulation (`reduce_accumulated`) and `.grad` is handed out; then
  torch's stage scales it by the number of microbatches (`scale_grads`), as for its own FSDP.

So a step issues one reduction per unit, whatever the number of microbatches, and the compiled stage runs one
graph (the no-sync variant) for every microbatch. Zero-bubble schedules, which split a backward into an input and
a weight half, are refused: the compiled backward is one graph that cannot be split.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed import pipelining

from fsdp_graph.api.sync import reduce_accumulated, set_requires_gradient_sync


def sharded_module(submodule: nn.Module) -> nn.Module:
    """The module `fully_shard` was called on: `submodule` itself or, for a `torch.compile` wrapper, its original."""
    module = submodule._orig_mod if isinstance(submodule, torch._dynamo.eval_frame.OptimizedModule) else submodule
    if "_fsdp_root" not in module.__dict__:
        raise ValueError(
            f"fsdp_graph.PipelineStage: the stage module ({type(module).__name__}) is not sharded; call "
            'fsdp_graph.fully_shard(stage_module, world_mesh["dp"]) on it (then torch.compile it, optionally), or use '
            "torch.distributed.pipelining.PipelineStage for a module fsdp_graph does not shard."
        )
    return module


class PipelineStage(pipelining.PipelineStage):
    """`torch.distributed.pipelining.PipelineStage` (same arguments) for a module sharded by `fsdp_graph.fully_shard`
    (and compiled with the fsdp backend, or not): gradients are reduced once per step, after the stage's last
    backward, instead of once per microbatch. Pass `group=world_mesh["pp"].get_group()` on a (pp, dp) mesh."""

    def __init__(self, submodule: nn.Module, *args: Any, **kwargs: Any) -> None:
        self._fsdp_module = sharded_module(submodule)
        if kwargs.get("dw_builder") is not None:
            raise NotImplementedError(
                "fsdp_graph.PipelineStage: dw_builder (a separate weight-gradient pass) is not supported: the stage's "
                "backward reduces gradients as one graph."
            )
        super().__init__(submodule, *args, **kwargs)
        # Off already for the schedule's first-step shape inference, which runs forward outside
        # forward_maybe_with_nosync: the same graph variant as every microbatch, and no accumulation (it asks
        # autograd for input gradients only).
        set_requires_gradient_sync(self._fsdp_module, False)

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        set_requires_gradient_sync(self._fsdp_module, False)
        return super().forward_maybe_with_nosync(*args, **kwargs)

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]] | None]:
        if backward_type != "full":
            raise NotImplementedError(
                f"fsdp_graph.PipelineStage: a split backward ({backward_type!r} only) is not supported, so neither "
                "are the zero-bubble schedules (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, "
                "ScheduleDualPipeV): the compiled backward computes input and weight gradients in one graph. Use "
                "ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B or ScheduleLoopedBFS."
            )
        result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if last_backward:
            reduce_accumulated(self._fsdp_module)
            set_requires_gradient_sync(self._fsdp_module, True)  # outside the schedule the module behaves as usual
        return result
