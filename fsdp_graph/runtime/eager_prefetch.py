"""Forward prefetch for the eager path (issue 27, item 5): each gather of the next flat parameter is issued before
this one's is waited for, so the all-gather of unit k+1 runs while unit k computes.

The order is the one the first eager forward gathered in (recorded then; that forward gathers as before, one op per
flat parameter). Every later eager forward, at the gather of flat parameter k: take k's gather if it was issued
already (else issue it), issue k+1's (the next in the recorded order), then wait for k's and hand it to autograd
through `ops.reuse_gathered`, whose backward is `fsdp::unshard`'s own. Every rank issues the same gathers in the same
order as long as their forwards read the units in the same order, which the eager path needs anyway. A gather
issued for a unit the forward then does not read is waited for and dropped when the forward ends.

Not prefetched (gathered by the op as before): the backward (activation-checkpoint recomputes run a unit's forward
while autograd runs), a forward under selective activation checkpointing (its dispatch mode records each region's
collectives for that region's recompute: a gather issued in region k and waited in region k + 1 matches neither),
world 1 (nothing to gather), `reshard_after_forward=k` (a gather in two steps) and units that keep their gathers
(`set_reshard_after_backward(False)`: the next forward reuses the kept one), and groups that run the gathers on
torch's two-thread gloo (a mixed group's CPU side): fully_shard's gloo shard groups are single-thread copies
(`runtime.gloo`), where two gathers in flight on one group are safe.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from fsdp_graph.ir.ops import start_gather, wait_gather


class _FlatParam(Protocol):
    """What this module reads of a `runtime.unit.FlatParamState`."""

    name: str
    group_name: str
    world: int
    param_dtype: torch.dtype | None
    compute_device: torch.device | None
    post_forward_world: int
    reshard_after_backward: bool

    @property
    def flat_shard(self) -> torch.Tensor: ...


def _two_thread_gloo(state: _FlatParam) -> bool:
    """Whether `state`'s group runs its gathers on torch's own gloo (two worker threads: two collectives in flight
    can corrupt the heap, issue 10). fully_shard's gloo groups are single-thread copies; a mixed
    `cpu:gloo,cuda:nccl` group's CPU side is not."""
    import torch.distributed as dist

    from fsdp_graph.runtime.devices import backend_for

    group = dist.distributed_c10d._resolve_process_group(state.group_name)
    return backend_for(group, state.compute_device or state.flat_shard.device) == "gloo"


@dataclass(eq=False)
class ForwardPrefetch:
    """One `fully_shard` call's eager forward prefetch (held by its `RootState`)."""

    order: list[str] | None = None  # flat parameter names in the first eager forward's gather order
    recording: list[str] = field(default_factory=list)
    issued: dict[str, torch.Tensor] = field(default_factory=dict)  # gathers issued and not yet waited for
    eligible: dict[str, bool] = field(default_factory=dict)  # per flat parameter name, `prefetchable`

    def prefetchable(self, state: _FlatParam) -> bool:
        if state.name not in self.eligible:  # the groups are the model's for good: resolved once
            self.eligible[state.name] = state.world > 1 and not _two_thread_gloo(state)
        return self.eligible[state.name] and state.post_forward_world == 1 and state.reshard_after_backward

    def gather(self, state: _FlatParam, states: Sequence[_FlatParam], gathered: Container[str]) -> torch.Tensor | None:
        """`state`'s full flat parameter, waited for, with the next flat parameter's gather issued before the wait
        (no autograd: the caller attaches it). None: not prefetched here, the caller gathers with the op. `states`:
        every flat parameter of the root; `gathered`: the names this forward has gathered already."""
        if not self.prefetchable(state) or _recomputing_or_selective_checkpoint():
            return None
        if self.order is None:
            if state.name not in self.recording:
                self.recording.append(state.name)
            return None
        started = self.issued.pop(state.name, None)
        if started is None:
            started = _issue(state)
        after = self._next(state.name, states, gathered)
        if after is not None:
            self.issued[after.name] = _issue(after)
        return wait_gather(started, state.world)

    def _next(self, name: str, states: Sequence[_FlatParam], gathered: Container[str]) -> _FlatParam | None:
        if name not in self.order:
            return None
        by_name = {s.name: s for s in states}
        for following in self.order[self.order.index(name) + 1 :]:
            state = by_name.get(following)
            if following in self.issued or following in gathered or state is None or not self.prefetchable(state):
                continue
            return state
        return None

    def end_forward(self) -> None:
        """The outermost eager forward returned (or raised): the first one's order is kept; gathers issued for
        units it did not read are waited for (every rank issued them) and dropped."""
        if self.order is None:
            self.order = self.recording
        for started in self.issued.values():
            torch.ops._c10d_functional.wait_tensor(started)
        self.issued.clear()


def _recomputing_or_selective_checkpoint() -> bool:
    """Autograd is running a backward (a checkpoint's recompute of the forward), or selective activation
    checkpointing's dispatch mode (torch.utils.checkpoint's caching modes) records this forward's ops."""
    if torch._C._current_graph_task_id() != -1:
        return True
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(type(mode).__module__ == "torch.utils.checkpoint" for mode in _get_current_dispatch_mode_stack())


def _issue(state: _FlatParam) -> torch.Tensor:
    with torch.no_grad():
        return start_gather(
            state.flat_shard.detach(), state.group_name, state.world, state.param_dtype, state.compute_device
        )
