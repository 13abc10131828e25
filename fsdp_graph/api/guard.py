"""A non-finite guard for training loops: a step whose loss or gradients hold NaN or Inf is not applied.

The loss alone is not enough: a step's loss can be finite while its gradients are not (measured on the main job
with `--lr 1e6 --clip 0`: step 2's loss 5.545, its gradients non-finite, and the step-2 checkpoint held 16
non-finite tensors). So the guard checks both, at no collective of its own: the one all-reduce it runs per step
carries this rank's loss (the sum a loop logs), a measure of its local gradients, and the stop flag of a
`StopSignal`, so every rank reaches the same verdict. With clipping, the norm `clip_grad_norm_` returns (already
the same on every rank) is used instead of a pass over the gradients.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_graph.api.preemption import StopSignal
from fsdp_graph.runtime.devices import collective_device
from fsdp_graph.runtime.dtensor_views import local_of

MODES = ("skip", "stop", "off")


class NonFiniteError(RuntimeError):
    """Training stopped: a step's loss or gradients were non-finite (`StepGuard`'s `stop` mode, or more steps in a
    row than `max_skips` in `skip` mode). `step` is the step that stopped it."""

    fsdp_graph_brief = True

    def __init__(self, step: int, message: str):
        self.step = step
        super().__init__(message)


@dataclass
class StepCheck:
    """What `StepGuard.check` found for one step, the same on every rank."""

    apply: bool  # the loss and gradients are finite (or the guard is off): take the optimizer step
    stop: bool  # some rank saw a stop signal: every rank stops after this step
    stop_ranks: int  # how many ranks saw one
    loss: float  # the losses summed over ranks, divided by `loss_ranks`
    grad_norm: float | None  # the norm the caller passed (clip_grad_norm_'s), else None
    what: str = ""  # when not applied: what was non-finite, for a log line
    skipped_in_a_row: int = 0


class StepGuard:
    """Check each step before the optimizer applies it:

        guard = fsdp_graph.StepGuard(model, nonfinite="skip", max_skips=3, stop=stop_signal)
        loss = loss_fn(compiled(x), y); loss.backward()
        norm = fsdp_graph.clip_grad_norm_(model, 1.0)          # optional
        check = guard.check(step, loss, grad_norm=norm)        # collective: one all-reduce of 3 numbers
        if check.apply:
            opt.step()
        opt.zero_grad()
        if check.stop: save and leave

    `nonfinite`: "skip" drops a step whose loss or gradients are non-finite (the optimizer and its state untouched:
    its moments, its step count) and raises `NonFiniteError` when more than `max_skips` steps in a row were; "stop"
    raises at the first; "off" checks nothing (the loss is still reduced). The all-reduce replaces the loss
    all-reduce a loop makes to log a mean loss (`check.loss`), so it adds no collective to such a loop. Without a
    `grad_norm`, each rank's local gradient pieces are measured (a vector norm per gradient, no communication).
    `loss` may be a tensor or a float; `group`: the ranks that agree (default: all)."""

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        nonfinite: str = "skip",
        max_skips: int = 3,
        stop: StopSignal | None = None,
        group: dist.ProcessGroup | None = None,
    ):
        if nonfinite not in MODES:
            raise ValueError(f"StepGuard: nonfinite must be one of {', '.join(MODES)}, got {nonfinite!r}")
        if max_skips < 0:
            raise ValueError(f"StepGuard: max_skips must be at least 0, got {max_skips}")
        if nonfinite != "off" and model is None:
            raise ValueError("StepGuard: pass the model whose gradients are checked (or nonfinite='off')")
        self.model, self.mode, self.max_skips, self.stop, self.group = model, nonfinite, max_skips, stop, group
        self._params = list(model.parameters()) if model is not None else []  # listed once: walking modules is slow
        self.skipped: list[int] = []  # every step skipped so far
        self._in_a_row = 0

    def _local_gradient_measure(self, device: torch.device) -> torch.Tensor:
        """Sum of squared norms of this rank's local gradient pieces: finite iff every element is."""
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for p in self._params:
            if p.grad is not None:
                grad = local_of(p.grad)
                by_device[grad.device].append(grad)
        parts = [torch.stack(torch._foreach_norm(grads)).to(device, torch.float64) for grads in by_device.values()]
        if not parts:
            return torch.zeros((), dtype=torch.float64, device=device)
        return torch.cat(parts).square().sum()

    def check(
        self, step: int, loss: torch.Tensor | float, grad_norm: torch.Tensor | float | None = None, *, loss_ranks=None
    ) -> StepCheck:
        """Reduce this step's loss, gradient measure and stop flag over the group; decide (see the class). `step`
        names the step in messages; `loss_ranks`: what the summed loss is divided by (default: the group size)."""
        loss_t = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        device = collective_device(self.group, loss_t.device)  # every rank's loss is on the same device type
        loss_t = loss_t.to(device)
        if self.mode == "off":
            grads = torch.zeros((), dtype=torch.float64, device=device)
        elif grad_norm is not None:
            norm_t = grad_norm if isinstance(grad_norm, torch.Tensor) else torch.tensor(float(grad_norm))
            grads = norm_t.detach().to(device, torch.float64) * 0  # NaN iff the norm is non-finite
        else:
            grads = self._local_gradient_measure(device)
        flag = float(self.stop is not None and self.stop.requested)
        packed = torch.stack([loss_t.to(torch.float64).reshape(()), grads, torch.tensor(flag, device=device)])
        dist.all_reduce(packed, group=self.group)
        loss_sum, grad_measure, stop = packed.tolist()
        ranks = loss_ranks or dist.get_world_size(self.group)
        norm = float(grad_norm) if grad_norm is not None else None
        check = StepCheck(apply=True, stop=stop > 0, stop_ranks=round(stop), loss=loss_sum / ranks, grad_norm=norm)
        if self.mode == "off":
            return check
        bad_loss, bad_grads = not math.isfinite(loss_sum), not math.isfinite(grad_measure)
        if not (bad_loss or bad_grads):
            self._in_a_row = 0
            return check
        if bad_loss:
            check.what = f"the loss is {loss_sum / ranks}"
        else:
            measure = f"norm {norm}; " if norm is not None else ""
            check.what = f"the gradients are non-finite ({measure}the loss was finite, {loss_sum / ranks:.4f})"
        self._in_a_row += 1
        self.skipped.append(step)
        check.apply, check.skipped_in_a_row = False, self._in_a_row
        if self.mode == "stop":
            raise NonFiniteError(step, f"step {step}: {check.what}; stopped (nonfinite='stop').")
        if self._in_a_row > self.max_skips:
            first = step - self._in_a_row + 1
            raise NonFiniteError(
                step,
                f"step {step}: {check.what}; {self._in_a_row} steps in a row non-finite (steps {first}-{step}), "
                f"more than the {self.max_skips} skips allowed; stopped. Lower the learning rate or clip gradients.",
            )
        return check
