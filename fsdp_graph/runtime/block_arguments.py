"""The arguments of a reused block's call (`block_region._gathering_forward`): which ones a shared body cannot take
(torch's reuse check refuses anything but tensors, numbers, strings, None and modules; a transformers cache becomes
a marker where it is empty for the layer), told at trace time in one step where every argument is plain, and why a
call falls back, in words."""

from __future__ import annotations

import torch
import torch.nn as nn

from fsdp_graph.runtime import block_cache

_SCALARS = (bool, int, float, str, type(None), torch.SymInt, torch.SymFloat, torch.SymBool)
_ARGUMENT_TYPES = (torch.Tensor, nn.Module, *_SCALARS)


def with_markers(args: tuple, kwargs: dict, layer: int | None) -> tuple[tuple, dict, str | None]:
    """`args` and `kwargs` with each transformers cache that is empty for `layer` replaced by its marker; and why
    one cannot be (the argument named), or None."""
    reasons: list[str] = []

    def replaced(value, name):
        kind = block_cache.cache_kind(value)
        if kind is None:
            return value
        refused = block_cache.eligible(value, kind, layer)
        if refused is not None:
            reasons.append(f"its argument {name!r} is a {type(value).__qualname__} that {refused}")
            return value
        return block_cache.marker(kind)

    new_args = tuple(replaced(value, f"positional argument {i}") for i, value in enumerate(args))
    new_kwargs = {name: replaced(value, name) for name, value in kwargs.items()}
    return new_args, new_kwargs, reasons[0] if reasons else None


_NOTED_PLAIN: list[bool] = [False]


def note_plain_arguments(args, kwargs) -> None:
    """At trace time (`comptime`): whether every argument, inside tuples, lists and dicts, is a tensor, a symbolic or
    plain scalar, a string, None or a module (so that neither `with_markers` nor `refused_argument` would find
    anything), told from Dynamo's variables; False wherever a variable is of a kind not known here (the traced
    checks then decide)."""
    variables = [variable._i_will_not_complain_if_bc_breaks_VariableTracker() for variable in (args, kwargs)]
    _NOTED_PLAIN[0] = all(_plain_variable(variable) for variable in variables)


def _plain_variable(variable) -> bool:
    from torch._dynamo.variables import (
        ConstantVariable,
        ConstDictVariable,
        SymNodeVariable,
        TensorVariable,
    )
    from torch._dynamo.variables.lists import BaseListVariable
    from torch._dynamo.variables.nn_module import NNModuleVariable, UnspecializedNNModuleVariable

    if isinstance(variable, (TensorVariable, SymNodeVariable, NNModuleVariable, UnspecializedNNModuleVariable)):
        return True
    if isinstance(variable, ConstantVariable):
        return isinstance(variable.as_python_constant(), _SCALARS)
    if type(variable) is ConstDictVariable and variable.python_type() is dict:
        return all(_plain_variable(item) for item in variable.items.values())
    if isinstance(variable, BaseListVariable) and variable.python_type() in (tuple, list):
        return all(_plain_variable(item) for item in variable.items)
    return False


@torch._dynamo.assume_constant_result
def noted_plain_arguments() -> bool:
    return _NOTED_PLAIN[0]


def refused_argument(args: tuple, kwargs: dict) -> tuple[str, str] | None:
    """(where, type name) of the first argument torch's reuse check would refuse: anything but a tensor, a symbolic
    or plain scalar, a string, None or a module, inside tuples, lists and dicts (`classify_vt`)."""
    named = [(f"positional argument {i}", value) for i, value in enumerate(args)] + list(kwargs.items())
    for name, value in named:
        pending = [value]
        while pending:
            item = pending.pop()
            if isinstance(item, (tuple, list)):
                pending.extend(item)
            elif isinstance(item, dict):
                pending.extend(item.values())
            elif not isinstance(item, _ARGUMENT_TYPES):
                return name, type(item).__name__
    return None


def argument_reason(why: str | None, refused: tuple[str, str] | None) -> str:
    if why is not None:
        return (
            f"{why}; a transformers DynamicCache or EncoderDecoderCache empty for the layer (training, a prefill) "
            "shares the body"
        )
    name, type_name = refused
    hint = " (for training: use_cache=False, or model.config.use_cache = False)" if "cache" in name.lower() else ""
    return (
        f"its argument {name!r} is a {type_name}, and torch's nested_compile_region reuses a body only for tensors, "
        f"numbers, strings, None and modules (invoke_subgraph's is_reuse_eligible: 'unsupported input VT types'){hint}"
    )
