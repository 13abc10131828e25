"""Modules under torch's composable activation checkpointing (`torch.distributed._composable.checkpoint`) run their
forward through `torch.utils.checkpoint.checkpoint` instead, with the same options (issue 32).

The composable API checkpoints from forward hooks: the pre-hook enters torch.utils.checkpoint's generator, which
Dynamo does not trace (a graph break; `fullgraph=True` fails), and the compiled forward between the hooks then saves
other tensors than the eager recompute makes ("Recomputed values ... have different metadata": torch's FSDP2 and a
plain model under torch's own `aot_eager` backend fail the same way). `torch.utils.checkpoint.checkpoint` with
`use_reentrant=False` is the same non-reentrant checkpoint, and Dynamo traces it as one region that the compiled
graph recomputes itself (fsdp_graph's passes handle such regions: docs/design-notes.md, "Activation
checkpointing"). One difference remains: the recompute runs the module's `forward`, not its call, so the module's own
forward hooks run once per step, not again in the recompute.
"""

from __future__ import annotations

import inspect
import types

import torch
import torch.nn as nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed._composable import checkpoint_activation

# Names of the composable pre-hook's closure variables -> torch.utils.checkpoint.checkpoint's keyword arguments.
_OPTIONS = {
    "preserve_rng_state": "preserve_rng_state",
    "user_context_fns": "context_fn",
    "determinism_check": "determinism_check",
    "debug": "debug",
    "early_stop": "early_stop",
}


def adopt_composable_checkpoints(model: nn.Module) -> list[str]:
    """Every module of `model` that composable `checkpoint()` was applied to (and is on) gets a forward that runs
    its class's forward under `torch.utils.checkpoint.checkpoint` with that call's options; the composable hooks
    are turned off. Returns the modules' FQNs."""
    adopted = []
    for fqn, module in model.named_modules():
        state = composable_checkpoint.state(module)
        if state is None or not state.enable_hook:
            continue
        options = _options_of(fqn or type(module).__name__, module)
        state.enable_hook = False
        module.forward = types.MethodType(_checkpointed_forward, module)
        module.__dict__["_fsdp_checkpoint_options"] = options
        adopted.append(fqn)
    return adopted


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    forward = type(self).forward.__get__(self)
    return torch.utils.checkpoint.checkpoint(
        forward, *args, use_reentrant=False, **self.__dict__["_fsdp_checkpoint_options"], **kwargs
    )


def _options_of(name: str, module: nn.Module) -> dict:
    """The options `checkpoint(module, ...)` was called with, read from the pre-hook it registered."""
    for hook in module._forward_pre_hooks.values():
        if getattr(hook, "__module__", None) == checkpoint_activation.__name__ and hook.__name__ == "forward_pre_hook":
            closure = inspect.getclosurevars(hook).nonlocals
            if set(_OPTIONS) <= set(closure):
                options = {ours: closure[theirs] for theirs, ours in _OPTIONS.items()}
                if options["context_fn"] is None:  # (Dynamo takes the default only when it is not passed)
                    del options["context_fn"]
                return options
    raise NotImplementedError(
        f"fully_shard: module '{name}' uses torch.distributed._composable.checkpoint, whose options this torch "
        f"version ({torch.__version__}) keeps where fsdp_graph cannot read them. Checkpoint it with "
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper (apply_activation_checkpointing) or "
        "torch.utils.checkpoint.checkpoint instead."
    )
