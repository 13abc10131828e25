"""What the optimizer step and gradient clipping cost per rank: their state, their temporaries, their time.

`explain()` plans the forward and backward from their graphs; the step after them runs torch's optimizers,
whose memory traffic and temporaries are fixed by their implementation (torch/optim/adam.py, sgd.py): counted
here per element of the rank's shards, fp32 master parameters, gradients and states.

- AdamW, fused (`torch._fused_adamw_`): reads parameter, gradient and the two moments, writes three: 28 bytes.
  foreach (torch's default on GPUs): eight foreach ops (decay, lerp, mul, addcmul, sqrt into a new list, div,
  add, addcdiv): 84 bytes, and the sqrt's list, one fp32 element per element, alive for the last four.
  for-loop: the same traffic, the same ops one tensor at a time. Adam without decay skips the first op (76).
- SGD with momentum: foreach mul and add into the buffer, add into the parameter, 32 bytes (44 with weight decay,
  whose foreach add makes a gradient-sized list); fused 20 bytes. Without momentum, one add: 12 bytes, no state.
- Gradient clipping (`fsdp_graph.clip_grad_norm_`, torch's `clip_grad_norm_`): one norm read of each gradient and a
  foreach multiply, 12 bytes, plus one scalar all-reduce over the shard group.

Time: bytes over the memory rate plus a kernel overhead per launch (a foreach op launches once per 36 tensors or
21M elements, whichever needs more; a for-loop op once per tensor).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from passes.hardware import Hardware

_FOREACH_TENSORS = 36  # tensors per multi_tensor_apply launch at depth 4 (p, g, m, v)
_FOREACH_ELEMENTS = 320 * 65536  # chunks of 65536 elements, 320 blocks per launch


@dataclass(frozen=True)
class OptimizerModel:
    """Per element of the rank's shards (fp32): state tensors kept, bytes the step reads and writes, full-size
    fp32 temporaries alive at once, and its ops (each a launch per tensor, or per foreach batch)."""

    name: str
    implementation: str  # "fused", "foreach" or "for-loop"
    states: int
    step_bytes: int
    temporaries: int
    ops: int
    clip: bool = False

    def state_bytes(self, elements: int) -> int:
        return 4 * self.states * elements

    def temporary_bytes(self, elements: int) -> int:
        return 4 * self.temporaries * elements

    def seconds(self, tensor_elements: Sequence[int], hardware: Hardware, shard_ranks: int = 1) -> float:
        """The step (and clipping) over parameters of `tensor_elements` elements each (this rank's shards)."""
        elements = sum(tensor_elements)
        moved = (self.step_bytes + (12 if self.clip else 0)) * elements
        ops = self.ops + (2 if self.clip else 0)
        if self.implementation == "fused":
            launches = ops * max(1, math.ceil(elements / _FOREACH_ELEMENTS))
        elif self.implementation == "foreach":
            launches = ops * max(
                math.ceil(len(tensor_elements) / _FOREACH_TENSORS), math.ceil(elements / _FOREACH_ELEMENTS)
            )
        else:
            launches = ops * len(tensor_elements)
        seconds = moved / hardware.memory_rate() + launches * hardware.kernel_overhead_s
        if self.clip and shard_ranks > 1:  # the norm's scalar all-reduce: latency only, a tree (log steps)
            seconds += 2 * math.ceil(math.log2(shard_ranks)) * (hardware.inter_latency_s or hardware.link_latency_s)
        return seconds


def _adam(implementation: str, decay: bool, clip: bool, name: str) -> OptimizerModel:
    if implementation == "fused":
        return OptimizerModel(name, "fused", 2, 28, 0, 1, clip)
    return OptimizerModel(name, implementation, 2, 84 if decay else 76, 1, 8 if decay else 7, clip)


def _sgd(implementation: str, momentum: bool, decay: bool, clip: bool) -> OptimizerModel:
    if not momentum:
        return OptimizerModel("sgd", implementation, 0, 12 + (12 if decay else 0), int(decay), 1 + decay, clip)
    if implementation == "fused":
        return OptimizerModel("sgd-momentum", "fused", 1, 20, 0, 1, clip)
    return OptimizerModel("sgd-momentum", implementation, 1, 32 + (12 if decay else 0), int(decay), 3 + decay, clip)


SPECS = ("adamw", "adam", "sgd", "sgd-momentum")
IMPLEMENTATIONS = ("foreach", "fused", "for-loop")


def optimizer_model(spec: str | torch.optim.Optimizer | OptimizerModel, clip: bool = False) -> OptimizerModel:
    """The model of an optimizer: a `torch.optim` instance (AdamW, Adam, SGD; its `fused`, `foreach`, `momentum`
    and `weight_decay`), or a name: "adamw", "adam", "sgd", "sgd-momentum", optionally with "-fused", "-foreach"
    or "-for-loop" (default foreach, torch's default on GPUs). `clip` adds gradient-norm clipping."""
    if isinstance(spec, OptimizerModel):
        return spec if spec.clip == clip else OptimizerModel(**{**spec.__dict__, "clip": clip})
    if isinstance(spec, torch.optim.Optimizer):
        return _from_instance(spec, clip)
    name, implementation = spec, "foreach"
    for impl in IMPLEMENTATIONS:
        if spec.endswith("-" + impl):
            name, implementation = spec[: -len(impl) - 1], impl
    if name not in SPECS:
        raise ValueError(
            f"optimizer {spec!r}: use a torch.optim.AdamW/Adam/SGD instance or one of {', '.join(SPECS)}, "
            f"optionally ending in {', '.join('-' + i for i in IMPLEMENTATIONS)}"
        )
    if name in ("adamw", "adam"):
        return _adam(implementation, name == "adamw", clip, name)
    return _sgd(implementation, name == "sgd-momentum", False, clip)


def _from_instance(optimizer: torch.optim.Optimizer, clip: bool) -> OptimizerModel:
    defaults = optimizer.defaults
    implementation = (
        "fused" if defaults.get("fused") else ("for-loop" if defaults.get("foreach") is False else "foreach")
    )
    decay = any(group.get("weight_decay", 0) for group in optimizer.param_groups)
    if isinstance(optimizer, torch.optim.AdamW):
        return _adam(implementation, decay, clip, "adamw")
    if isinstance(optimizer, torch.optim.Adam):
        return _adam(implementation, decay or bool(defaults.get("decoupled_weight_decay")), clip, "adam")
    if isinstance(optimizer, torch.optim.SGD):
        return _sgd(implementation, bool(defaults.get("momentum")), decay, clip)
    raise ValueError(
        f"explain(optimizer=...): {type(optimizer).__name__} is not modelled; pass AdamW, Adam or SGD, or a "
        "fsdp_graph.planning.optimizer.OptimizerModel of your own"
    )
