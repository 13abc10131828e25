"""Stop a training loop cleanly on SIGTERM or SIGUSR1 (what schedulers send before they kill: SLURM's `--signal`,
Kubernetes, torchrun forwarding its own SIGTERM).

A signal may reach one rank only, and a rank learns of it between two Python bytecodes, so ranks must agree on the
step after which they all stop. Two ways, both without a collective of their own:
- `StepGuard(stop=signals)` folds the flag into the one all-reduce it runs per step (fsdp_graph.api.guard);
- `StopSignal.agreed(step)` goes through the default group's store: the first rank that saw a signal publishes a
  stop step `lookahead` steps ahead (`compare_set`: the first writer wins), and every rank stops after that step.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import torch.distributed as dist

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_GENERATIONS = iter(range(1 << 62))


class StopSignal:
    """`with StopSignal() as stop:` turns SIGTERM and SIGUSR1 into a request to stop after the current step (the
    default action, ending the process at once, is replaced while the block runs, then restored).

    - `requested` (this rank saw a signal) and `signal_name`;
    - `agreed(step)`: whether every rank stops after `step`, through the store (see the module docstring);
    - or pass it to `StepGuard(stop=...)`, whose per-step all-reduce carries the flag.

    Handlers can only be installed from the main thread. Interrupted system calls are restarted (SA_RESTART), so a
    signal arriving in the middle of a checkpoint write or a store operation does not fail it."""

    def __init__(self, signals: tuple[int, ...] = DEFAULT_SIGNALS, *, lookahead: int = 2):
        if lookahead < 1:
            raise ValueError(f"StopSignal: lookahead must be at least 1 step, got {lookahead}")
        self.signals, self.lookahead = tuple(signals), lookahead
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}
        self._key = f"fsdp_graph/stop/{next(_GENERATIONS)}"
        self._stop_after: int | None = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def install(self) -> StopSignal:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopSignal: signal handlers can only be installed from the main thread")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
            signal.siginterrupt(sig, False)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def __enter__(self) -> StopSignal:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def agreed(self, step: int, store: dist.Store | None = None) -> bool:
        """Whether every rank stops after `step` (call it once per step on every rank, after the step). A rank that
        saw a signal publishes `step + lookahead` unless another rank published first; all ranks then stop after the
        published step. Ranks are at most `lookahead` steps apart when each step runs collectives that connect every
        rank through at most `lookahead` groups (one world-wide collective per step, such as the loss all-reduce a
        loop logs: 1; FSDP's shard and replica groups: 2). One store operation per call (two on the call that
        publishes or first sees the stop step)."""
        if self._stop_after is None:
            store = store or dist.distributed_c10d._get_default_store()
            if self.requested:
                self._stop_after = int(store.compare_set(self._key, "", str(step + self.lookahead)))
            elif store.check([self._key]):
                self._stop_after = int(store.get(self._key))
        return self._stop_after is not None and step >= self._stop_after
