"""A shared block body's output, taken apart inside the body and put back together by its caller (issue 25).

torch reuses a `nested_compile_region` body only if it returns a tensor, or a tuple or list of tensors, none of
them an input (`is_reuse_eligible`, `supports_aliasing = False`). Blocks return more: T5's a tuple with `None` and
the position bias argument it was given, others a dict, a dataclass or a transformers `ModelOutput`. The body
returns only the fresh tensors (`split_output`) and records a template of the rest, built of Python constants so
that it can be read at trace time; the caller rebuilds the block's output from it (`rebuild_output`).

A template is, recursively:
- `FRESH` (or `("fresh",)` at the top, where None would read as "no template"): the next tensor the body returns;
- `("arg", i)` / `("kwarg", name)`: that argument of the call itself (a tensor, or any object: a cache);
- `("constant", value)`: a bool, int, float, str or None;
- `("sequence", cls, items)`: a tuple, list or namedtuple of `cls`;
- `("mapping", cls, keys, items)`: a dict (or a subclass built from its items) of `cls`;
  (`cls` is the name "tuple", "list" or "dict" for those builtins: a builtin read from the template at trace time
  is a value Dynamo cannot guard on);
- `("dataclass", cls, names, items)`: a dataclass instance (a `ModelOutput` too), rebuilt as `cls(**fields)`;
- `("refused", why)`: an output that cannot be rebuilt from constants and tensors (any other object, a dataclass
  with fields its `__init__` does not take); the caller then runs the block's own forward instead.
"""

from __future__ import annotations

import dataclasses

import torch

FRESH = None
_CONSTANTS = (bool, int, float, str, type(None))


def split_output(
    out: object, args: tuple, kwargs: dict, explicit: bool = False
) -> tuple[object, tuple[torch.Tensor, ...]]:
    """(template, the fresh tensors in template order) of `out`, a block's output; template None when `out` is a
    tensor or a plain tuple of fresh tensors, which torch accepts as they are, unless `explicit` (the body returns
    more tensors after the output's)."""
    # compared with `is`, not looked up by `id()`: Dynamo guards a traced tensor's id (a recompile every step)
    inputs = [(place, value) for place, value in _argument_places(args, kwargs) if not isinstance(value, _CONSTANTS)]
    tensors: list[torch.Tensor] = []
    template = _template(out, inputs, tensors)
    plain = template is FRESH or (
        type(out) is tuple and template[0] == "sequence" and all(item is FRESH for item in template[2])
    )
    if plain and not explicit:
        return None, out if isinstance(out, tuple) else (out,)
    return ("fresh",) if template is FRESH else template, tuple(tensors)


def refusal(template: object) -> str | None:
    """Why an output with `template` cannot be rebuilt (its first such part), or None."""
    if not isinstance(template, tuple):
        return None
    if template[0] == "refused":
        return template[1]
    if template[0] in ("sequence", "mapping", "dataclass"):
        for item in template[-1]:
            why = refusal(item)
            if why is not None:
                return why
    return None


def rebuild_output(template: object, tensors: tuple, args: tuple, kwargs: dict) -> object:
    """The block's output from the body's `tensors`, its call's arguments and `split_output`'s template."""
    return _rebuild(template, iter(tensors), args, kwargs)


def _argument_places(args: tuple, kwargs: dict) -> list[tuple[tuple, object]]:
    """Each argument and, after them, each tensor inside an argument's tuples, lists and dicts, by its place: an
    output that is one of them (a namedtuple's member passed through) is the caller's own object, which a body
    cannot return (torch's higher-order ops refuse outputs aliasing inputs)."""
    top = [(("arg", i), value) for i, value in enumerate(args)] + [(("kwarg", k), v) for k, v in kwargs.items()]
    nested: list[tuple[tuple, object]] = []
    pending = list(top)
    while pending:
        place, value = pending.pop(0)
        if isinstance(value, (tuple, list)):
            items = list(enumerate(value))
        elif isinstance(value, dict):
            items = [(key, item) for key, item in value.items() if isinstance(key, _CONSTANTS)]
        else:
            continue
        for key, item in items:
            if isinstance(item, torch.Tensor):  # tensors only: Dynamo traces `is` between tensors, not containers
                nested.append(((*place, key), item))
            else:
                pending.append(((*place, key), item))
    return top + nested


def _template(item: object, inputs: list, tensors: list) -> object:
    if isinstance(item, _CONSTANTS):
        return ("constant", item)
    containers = (tuple, list, dict)  # Dynamo cannot trace `is` on them: a container passed through is rebuilt
    for place, value in inputs:
        if not isinstance(item, containers) and not isinstance(value, containers) and value is item:
            return place
    if isinstance(item, torch.Tensor):
        tensors.append(item)
        return FRESH
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        fields = dataclasses.fields(item)
        skipped = [field.name for field in fields if not field.init]
        if skipped:
            return (
                "refused",
                f"a {type(item).__qualname__} (dataclass field {skipped[0]!r} is not an __init__ argument)",
            )
        names = tuple(field.name for field in fields)
        return ("dataclass", type(item), names, tuple(_template(getattr(item, n), inputs, tensors) for n in names))
    if isinstance(item, (tuple, list)):
        return ("sequence", _class(item), tuple(_template(value, inputs, tensors) for value in item))
    if isinstance(item, dict):
        keys = tuple(item.keys())
        if not all(isinstance(key, _CONSTANTS) for key in keys):
            return ("refused", f"a {type(item).__qualname__} with keys other than numbers and strings")
        return ("mapping", _class(item), keys, tuple(_template(item[key], inputs, tensors) for key in keys))
    return ("refused", f"a {type(item).__qualname__}")


def _class(item: object) -> type | str:
    cls = type(item)
    return cls.__name__ if cls in (tuple, list, dict) else cls


def _rebuild(template: object, tensors, args: tuple, kwargs: dict) -> object:
    if template is FRESH or template == ("fresh",):
        return next(tensors)
    kind = template[0]
    if kind in ("arg", "kwarg"):
        value = args[template[1]] if kind == "arg" else kwargs[template[1]]
        for key in template[2:]:  # an item inside the argument (`_argument_places`)
            value = value[key]
        return value
    if kind == "constant":
        return template[1]
    if kind == "sequence":
        cls, items = template[1], [_rebuild(item, tensors, args, kwargs) for item in template[2]]
        if isinstance(cls, str):
            return items if cls == "list" else tuple(items)
        return cls(*items) if hasattr(cls, "_fields") else cls(items)
    if kind == "mapping":
        cls, keys = template[1], template[2]
        values = [_rebuild(item, tensors, args, kwargs) for item in template[3]]
        return dict(zip(keys, values)) if isinstance(cls, str) else cls(zip(keys, values))
    cls, names = template[1], template[2]
    return cls(**dict(zip(names, [_rebuild(item, tensors, args, kwargs) for item in template[3]])))
