"""Which parameters of a flat shard got a gradient in a backward (issue 32).

FSDP2 leaves `.grad` None on a parameter that no backward op reached (an output the loss does not use, a module of a
group that did not run), and an optimizer then leaves it alone (SGD with momentum or weight decay would otherwise
still move it). A flat shard's reduced gradient cannot say so: autograd fills the unreached parameters' part with
zeros, and a compiled graph, one autograd node, even materializes zeros for outputs the loss never reached. So each
backward records, on the flat shard, where in the gathered flat parameter a read that received a gradient starts
(`None`: a read of all of it); the gradient hook (`grads.install_grad_hook`) then hands out only those parameters.

- Eager: every parameter read in forward gets a tensor hook (`track_read`), which fires only when autograd computes
  that read's gradient.
- Compiled: `compiler.grad_outputs` hooks each graph output that requires grad with the reads that flow into it
  (`passes.grad_reads`, from the graph); a hook fires only when the loss reaches that output.
A flat shard with no record (armed by no read since its last gradient) hands out every parameter, as before.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

_READS = "_fsdp_grad_reads"  # flat shard attribute: positions whose reads got a gradient since the last hand-out


def arm(flat_shard: torch.Tensor) -> set[int | None]:
    """Start (or keep) recording `flat_shard`'s reads: its next gradient hands out only parameters recorded."""
    return flat_shard.__dict__.setdefault(_READS, set())


def take(flat_shard: torch.Tensor) -> set[int | None] | None:
    """The positions recorded since the last call (None: nothing armed the record, so hand out every parameter)."""
    return flat_shard.__dict__.pop(_READS, None)


def on_gradient(targets: Iterable[tuple[torch.Tensor, Iterable[int | None]]]):
    """A tensor hook recording `targets` (flat shard, positions read) when it fires; the gradient is unchanged."""
    refs = [(weakref.ref(shard), tuple(positions)) for shard, positions in targets]

    def record(grad: torch.Tensor | None) -> None:
        if grad is None:  # an output of a node that ran, without a gradient of its own (its hooks still run)
            return
        for ref, positions in refs:
            shard = ref()
            if shard is not None:
                arm(shard).update(positions)

    return record


def track_read(flat_shard: torch.Tensor, position: int, param: torch.Tensor) -> None:
    """An eager forward read `param` (starting at `position` of the gathered flat): record it if it gets a
    gradient."""
    if param.requires_grad and flat_shard.requires_grad:
        arm(flat_shard)
        param.register_hook(on_gradient([(flat_shard, (position,))]))
