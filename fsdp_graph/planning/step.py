"""The parts of a training step `explain()` adds around the compiled forward and backward: the optimizer step,
gradient clipping, and what the CUDA caching allocator reserves over two steps.

`StepExtras` is computed from a plan's memory estimate (`passes.memory`) and its shards; `ExplainReport` holds
one and folds it into its step time and peak memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_graph.planning.optimizer import OptimizerModel
from passes.allocator import CachingAllocator
from passes.hardware import Hardware
from passes.memory import MemoryEstimate, allocation_events


@dataclass(frozen=True)
class StepExtras:
    """The optimizer (None: not planned) over this rank's parameter shards (`param_elements`, one entry per
    original parameter's shard; `shard_ranks` the shard group, over which clipping reduces its norm), and the
    allocator the device runs (`expandable_segments`, PYTORCH_CUDA_ALLOC_CONF)."""

    optimizer: OptimizerModel | None = None
    param_elements: tuple[int, ...] = ()
    shard_ranks: int = 1
    expandable_segments: bool = False

    def optimizer_seconds(self, hardware: Hardware) -> float:
        if self.optimizer is None:
            return 0.0
        return self.optimizer.seconds(self.param_elements, hardware, self.shard_ranks)

    def state_bytes(self) -> int:
        return 0 if self.optimizer is None else self.optimizer.state_bytes(sum(self.param_elements))

    def temporary_bytes(self) -> int:
        return 0 if self.optimizer is None else self.optimizer.temporary_bytes(sum(self.param_elements))

    def peak_bytes(self, memory: MemoryEstimate) -> int:
        """The step's peak of live tensors: the forward and backward's peak with the optimizer state beside it, or
        the optimizer step's own (shards, state, gradients and its temporaries), whichever is higher."""
        state = self.state_bytes()
        during_step = memory.persistent_bytes + state + memory.outputs_bytes + self.temporary_bytes()
        return max(memory.total_peak_bytes + state, during_step)

    def reserved_bytes(self, memory: MemoryEstimate) -> int:
        """The caching allocator's peak reserved bytes (`passes.allocator`) over two steps: the persistent
        tensors first, each step's allocations in order, the gradients kept to the optimizer step, the optimizer
        state created at the first step (as torch.optim does), its temporaries, then the gradients freed
        (`zero_grad`)."""
        allocator = CachingAllocator(self.expandable_segments)
        for nbytes in memory.persistent_blocks:
            if nbytes > 0:
                allocator.malloc(nbytes)
        next_id = 0
        for step in range(2):
            events, kept = allocation_events(memory, next_id)
            next_id += len(memory.blocks)
            handles: dict[int, int] = {}
            for kind, ident, nbytes in events:
                if kind == "malloc":
                    handles[ident] = allocator.malloc(nbytes)
                else:
                    allocator.free(handles.pop(ident))
            if self.optimizer is not None:
                if step == 0:
                    for elements in self.param_elements:
                        for _ in range(self.optimizer.states if elements else 0):
                            allocator.malloc(4 * elements)
                temporaries = [
                    allocator.malloc(4 * elements)
                    for elements in self.param_elements
                    for _ in range(self.optimizer.temporaries)
                    if elements
                ]
                for handle in temporaries:
                    allocator.free(handle)
            for ident in kept:
                allocator.free(handles.pop(ident))
        return allocator.peak_reserved
