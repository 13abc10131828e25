"""Mixed precision's casts of a unit's forward inputs and outputs, inside `forward`, so that Dynamo traces them into
the model's graph (module hooks of the compiled root run as frames of their own, which would make a second graph).

- inputs: floating-point tensors to the compute dtype (`MixedPrecision.cast_forward_inputs`, FSDP2's
  `MixedPrecisionPolicy.cast_forward_inputs`), through pytree containers;
- outputs: floating-point tensors to `MixedPrecision.output_dtype` (FSDP2's `MixedPrecisionPolicy.output_dtype`:
  every module `fully_shard` was called on, each module of a list call included, casts what its forward returns),
  with FSDP2's own walk over the output (`torch.distributed.utils._apply_to_tensors`: tuples, lists, dicts,
  namedtuples and dataclasses, so a transformers `ModelOutput` too).
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.utils import _apply_to_tensors
from torch.utils._pytree import tree_map


def _cast(dtype: torch.dtype, value):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


def casting_forward(inputs_to: torch.dtype | None, outputs_to: torch.dtype | None):
    """A `forward` for a swapped class: the original forward (`_fsdp_original_class.forward`) with its inputs cast
    to `inputs_to` and its output to `outputs_to` (either may be None: no cast)."""
    cast_in = functools.partial(_cast, inputs_to) if inputs_to is not None else None
    cast_out = functools.partial(_cast, outputs_to) if outputs_to is not None else None

    def forward(self, *args, **kwargs):
        if cast_in is not None:
            args, kwargs = tree_map(cast_in, args), tree_map(cast_in, kwargs)
        out = self._fsdp_original_class.forward(self, *args, **kwargs)
        return out if cast_out is None else _apply_to_tensors(cast_out, out)

    return forward
