"""Python's cyclic garbage collector paused while torch.compile runs.

A compile allocates hundreds of thousands of long-lived objects (FX nodes, fake tensors, guards, sources), and every
gen-2 collection the allocations trigger walks all of them again, so the collector's share of a compile grows
faster than the model's depth (measurements on 70B shapes: docs/design-notes.md).

`install()` registers a start and an end callback with Dynamo's compilation callbacks (`torch._dynamo.callback`),
which run around each outermost compile: Dynamo's trace and its backend, and AOT autograd's lazy backward compile.
The start callback disables the collector if it is enabled; the end callback, which runs even when the compile
raises, collects the young generations the compile filled and enables it again (Dynamo runs both under its own
lock, once per outermost compile). A collector the user had disabled stays disabled. `torch._dynamo.reset()` clears those callbacks; our backend installs them again at its next
call and runs its own part (AOT autograd, our passes, Inductor) under `paused()` whatever the callbacks' state, so
after a reset only one compile's Dynamo trace runs with the collector on. Garbage made during a compile is still
freed by reference counting as it goes, and torch collects the young generations after each Dynamo compile
(`torch._dynamo.config.run_gc_after_compile`, on by default), so nothing accumulates past the compile.

The pause is process-wide for its duration (threads allocating meanwhile are not collected either), and it covers
every compile in the process once a model is sharded, not only ours: the callbacks cannot tell whose compile runs.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

_paused_by_us = False


def _pause(_args: object) -> None:
    global _paused_by_us
    if gc.isenabled():
        gc.disable()
        _paused_by_us = True


def _resume(_args: object) -> None:
    global _paused_by_us
    if _paused_by_us:
        # Collected while still paused: enabled with the compile's objects uncollected, the collector's next
        # allocation walks them all as generation 0 (the counts grew through the pause), and torch's collection
        # after the compile then walks them again as generation 1. One walk instead: 100 ms against 190 ms after
        # a compile of the tests' TP transformer.
        gc.collect(1)
        gc.enable()
        _paused_by_us = False


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The collector disabled for the block, then as it was (a no-op inside a compile the callbacks paused)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def install() -> None:
    """Registers the pause with Dynamo's compilation callbacks, once (again if the callbacks were cleared)."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:  # a torch without compilation callbacks: compiles run with the collector on, as before
        return
    if _pause not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_pause)
    if _resume not in callback_handler.end_callbacks:
        callback_handler.register_end_callback(_resume)
