"""Optimizer step inside backward: each flat parameter steps as soon as its gradient is reduced."""

from __future__ import annotations

import torch
import torch.nn as nn

from fsdp_graph.runtime.unit import flat_params


def optimizer_in_backward(
    model: nn.Module, optimizer_class: type[torch.optim.Optimizer], **optimizer_kwargs
) -> list[torch.optim.Optimizer]:
    """Give every trainable flat parameter its own `optimizer_class(views, **optimizer_kwargs)`, stepped and
    zeroed (set_to_none) from the gradient hook right after the backward hands out its gradients: a unit's
    gradient is freed as soon as its step is done, instead of all gradients living until `opt.step()`.

    Returns the optimizers (one per flat parameter, in creation order) for learning-rate schedules and state
    dicts. Do not call `step()` yourself. Every backward steps: no gradient accumulation across backwards.
    """
    optimizers = []
    for state in flat_params(model):
        trainable = [v for v in state.views if v.requires_grad]
        if not trainable:
            continue
        optimizer = optimizer_class(trainable, **optimizer_kwargs)

        def step(optimizer: torch.optim.Optimizer = optimizer) -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        state.after_grad.append(step)
        optimizers.append(optimizer)
    if not optimizers:
        raise RuntimeError("optimizer_in_backward: the model has no sharded trainable parameters.")
    return optimizers
