"""The Python writes a traced block body makes to objects it did not create, read from Dynamo's record of side
effects at trace time (`comptime`), for `block_region`. A shared body is traced for one block and stamped out for
the others, so Dynamo applies its writes once:
- a write that lasts (a counter `self.calls += 1`) makes the caller run the block on its own;
- a write the body undoes before it returns does not. That is a constant attribute set and put back, as `kernels`'
  `use_kernelized_func` does around every forward of transformers' attention layers (since transformers 5.25,
  which depends on `kernels`), with its module-global `_ACTIVE_KERNEL_FUNCS`. Applied once or once per block, such a
  write ends with the same value.

torch 2.13's own check for a higher-order op's body (`SideEffects.snapshot_attr_mutation`, "nullified" writes) is
the same idea; it does not run for a `nested_compile_region`, whose bodies may write. The structure read here
(`SideEffects.store_attr_mutations`) is the same in torch 2.11 and 2.13."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_graph import compat

_CONSTANT_TYPES = (type(None), bool, int, float, str)
_MISSING = object()


@dataclass
class WritesBefore:
    """What a trace had written before a body's forward: its sourced writes (`compat.mutated_sources`) and its
    pending attribute values by (variable id, name)."""

    side_effects: object
    sources: set
    attributes: dict


def note(side_effects) -> WritesBefore:
    """Before a body's forward."""
    return WritesBefore(side_effects, compat.mutated_sources(side_effects), _attributes(side_effects))


def lasting_writes(before: WritesBefore, ignored_member: str) -> list:
    """The sources of the pre-existing objects the body wrote since `before` and did not put back, an attribute
    named `ignored_member` aside. An attribute the trace had written before the body counts too when the body
    writes it again."""
    side_effects = before.side_effects
    undone, redone = set(), set()
    for key, (variable, value) in _attributes(side_effects).items():
        if _unchanged(before, key, value) or getattr(variable, "source", None) is None:
            continue
        source = _attribute_source(variable, key[1])
        (undone if _restored(before, key, variable, value) else redone).add(source)
    new = compat.mutated_sources(side_effects) - before.sources
    lasting = (new | redone) - (undone - _value_mutated_sources(side_effects))
    return [s for s in lasting if getattr(s, "member", None) != ignored_member]


def _attributes(side_effects) -> dict:
    return {
        (id(variable), name): (variable, value)
        for variable, names in side_effects.store_attr_mutations.items()
        for name, value in names.items()
    }


def _unchanged(before: WritesBefore, key: tuple, value) -> bool:
    return key in before.attributes and before.attributes[key][1] is value


def _attribute_source(variable, name: str):
    from torch._dynamo.source import AttrSource

    return AttrSource(variable.source, name)


def _restored(before: WritesBefore, key: tuple, variable, value) -> bool:
    """Whether an attribute's pending value is a constant equal to its value before the body: the trace's pending
    value then, else the object's own (from its instance dict: a class default or a property is not compared)."""
    if not value.is_python_constant():
        return False
    if key in before.attributes:
        previous = before.attributes[key][1]
        original = previous.as_python_constant() if previous.is_python_constant() else _MISSING
    else:
        instance_dict = getattr(getattr(variable, "value", None), "__dict__", {})
        original = instance_dict.get(key[1], _MISSING)
    current = value.as_python_constant()
    return isinstance(original, _CONSTANT_TYPES) and type(original) is type(current) and original == current


def _value_mutated_sources(side_effects) -> set:
    """The sources of written lists, dicts and other values, not attributes: a source that is both an attribute
    put back and a value written (`self.items` reassigned, then appended to) is not taken as undone."""
    return {
        variable.source
        for variable in side_effects.id_to_variable.values()
        if variable.source is not None
        and not side_effects.is_attribute_mutation(variable)
        and side_effects.is_modified(variable)
    }
