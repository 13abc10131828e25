"""CPU offload on the host side: pinned shards, and no host read of a gradient before its device-to-host copy ends.

Both copies are asynchronous (`non_blocking=True`): the shard's host-to-device copy reads pinned memory, and the
reduced gradient's device-to-host copy writes pinned memory that the host may read only once the copy has run.
Autograd does not order the two: the gradient hook of a CPU flat shard runs on the host as soon as the copy is
enqueued. So a hook receiving such a gradient records an event and defers its work (handing out `.grad`, optimizer
steps in backward); one callback at the end of the backward waits for each event, then runs the work, in order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class _Event(Protocol):
    def synchronize(self) -> None: ...


def is_accelerator(device: torch.device | None) -> bool:
    """Whether copies between the CPU and `device` are asynchronous (and so need pinned memory and ordering)."""
    return device is not None and device.type not in ("cpu", "meta")


def pinned(shard: torch.Tensor) -> torch.Tensor:
    """`shard` in pinned memory when an accelerator can copy from it asynchronously (CPU-only torch cannot pin)."""
    if torch.cuda.is_available() and not shard.is_pinned():
        return shard.pin_memory()
    return shard


def keep_pinned(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`new` (a converted copy of the CPU shard `old`: `.to()`, `.double()`) pinned again if `old` was pinned."""
    return new.pin_memory() if old.is_pinned() and not new.is_pinned() else new


def recorded_event(device: torch.device) -> _Event:
    """An event recorded now on `device`'s current stream: it completes when the work enqueued so far has run."""
    module = torch.get_device_module(device)
    event = module.Event()
    event.record(module.current_stream(device))
    return event


def _queue_callback(callback: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class GradFence:
    """Defers host work on asynchronously offloaded gradients to the end of the backward, after their copies.

    `make_event(device)` returns an event already recorded on `device` (default: `recorded_event`);
    `queue_callback(fn)` runs `fn` when the current backward ends (default: the autograd engine's). Both are
    injectable so that the ordering can be tested without an accelerator."""

    def __init__(
        self,
        make_event: Callable[[torch.device], _Event] | None = None,
        queue_callback: Callable[[Callable[[], None]], None] | None = None,
    ):
        self._make_event = make_event
        self._queue_callback = queue_callback
        self._pending: list[tuple[_Event, Callable[[], None]]] = []
        self._task = -1  # the autograd graph task `flush` is queued on

    def defer(self, device: torch.device, work: Callable[[], None]) -> None:
        """Called from a gradient hook, after the copy of the gradient from `device` was enqueued."""
        task = torch._C._current_graph_task_id()
        if task != self._task:  # work left by a backward that raised is dropped with its gradients
            self._pending.clear()
            self._task = task
            (self._queue_callback or _queue_callback)(self.flush)
        self._pending.append(((self._make_event or recorded_event)(device), work))

    def flush(self) -> None:
        pending, self._pending, self._task = self._pending, [], -1
        for event, work in pending:
            event.synchronize()
            work()
