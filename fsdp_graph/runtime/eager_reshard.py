"""Eager FULL_SHARD: a unit's gathered parameters are freed after its forward and re-gathered in its backward.

Autograd saves what backward needs (a linear layer saves its weight, i.e. a view of the unit's gathered flat
parameter); kept as such, every unit stays gathered until backward (ZeRO-2 memory, whatever the strategy). While an
eager forward runs, a `saved_tensors_hooks` pair replaces each saved view of a resharding unit's gathered flat
parameter by a `_Regather` handle (no tensor), so the gather dies with the unit's forward; the first unpack in
backward gathers the flat parameter again, and the unit's later unpacks reuse it until the last one is taken. The
rows layout's parameters are copies out of the gathered flat, not views: they are tracked as well, and a handle of
one is unpacked from a fresh copy-out of the backward's gather (one per parameter, shared by its handles).
Under `reshard_after_forward=k` the session keeps the unit's 1/k piece of the forward's gather, and the backward
gathers the pieces over the unit's node group instead of the shards over the whole group. Everything else is saved
as it is. Activation-checkpointed regions keep their own (inner) hooks: they save nothing,
and their recomputation gathers (`fsdp_graph.runtime.unit.unsharded_flat`).
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# (FlatParamState, its kept 1/k piece or None) -> its full flat parameter, gathered without autograd
Gather = Callable[[object, torch.Tensor | None], torch.Tensor]


@dataclass(eq=False)
class _Regather:
    """A saved tensor that was a view of `state`'s gathered flat parameter: where it lay inside it."""

    session: ForwardSession
    state: object
    size: torch.Size
    stride: tuple[int, ...]
    offset: int  # from the start of the flat parameter (or of the copied-out parameter)
    slot: int | None = None  # a copied-out parameter's slot in its layout (None: a view of the flat parameter)


@dataclass(eq=False)
class _Outer:
    """A saved tensor packed by the saved-tensor hooks that were active when the forward began (e.g. the user's
    `save_on_cpu`): ours are entered inside them, so everything that is not ours goes to them."""

    unpack: Callable
    packed: object


@dataclass(eq=False)
class ForwardSession:
    """One eager forward of a sharded model and the backward of its graph; the `_Regather` handles autograd holds
    keep it alive exactly as long as that graph."""

    gather: Gather
    outer: tuple[Callable, Callable] | None = None  # (pack, unpack) of the enclosing saved-tensor hooks
    # storage address -> (the gathered flat parameter or a copy out of it, weakly: its storage can't be reused
    # while it lives; state; the copy's slot)
    tracked: dict[int, tuple[weakref.ref, object, int | None]] = field(default_factory=dict)
    regathered: dict[str, torch.Tensor] = field(default_factory=dict)  # unit flat-param name -> backward's gather
    copies: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)  # (name, slot) -> backward's copy
    pending: Counter = field(default_factory=Counter)  # handles not unpacked yet, per flat-param name
    pieces: dict[str, torch.Tensor] = field(default_factory=dict)  # reshard_after_forward=k: the kept 1/k pieces

    def keep_piece(self, state, piece: torch.Tensor) -> None:
        """`state`'s 1/k piece of this forward's gather: what its backward gathers over its node group."""
        self.pieces[state.name] = piece

    def track(self, state, flat: torch.Tensor, slot: int | None = None) -> None:
        """`flat` is `state`'s gathered flat parameter in this forward (or, with `slot`, its parameter copied out
        of it); saved views of it become handles."""
        self.tracked[flat.untyped_storage().data_ptr()] = (weakref.ref(flat), state, slot)

    def pack(self, tensor: torch.Tensor):
        entry = None
        if type(tensor) is torch.Tensor and tensor.layout == torch.strided:
            entry = self.tracked.get(tensor.untyped_storage().data_ptr())
        flat, state, slot = (entry[0](), entry[1], entry[2]) if entry is not None else (None, None, None)
        if flat is None or flat.dtype != tensor.dtype or flat.device != tensor.device:
            return tensor if self.outer is None else _Outer(self.outer[1], self.outer[0](tensor))
        self.pending[state.name] += 1
        offset = tensor.storage_offset() - flat.storage_offset()
        return _Regather(self, state, tensor.size(), tensor.stride(), offset, slot)

    @staticmethod
    def unpack(saved):
        if isinstance(saved, _Outer):
            return saved.unpack(saved.packed)
        if not isinstance(saved, _Regather):
            return saved
        session, name = saved.session, saved.state.name
        flat = session.regathered.get(name)
        if flat is None:
            with torch.no_grad():
                flat = session.gather(saved.state, session.pieces.get(name))
            session.regathered[name] = flat
        base = flat
        if saved.slot is not None:
            base = session.copies.get((name, saved.slot))
            if base is None:
                layout = saved.state.layout
                with torch.no_grad():
                    base = session.copies[(name, saved.slot)] = layout.param_of(flat, layout.slots[saved.slot])
        session.pending[name] -= 1
        if session.pending[name] <= 0:  # the unit's last saved view: the re-gathered copy goes with its backward
            del session.regathered[name]
            session.pieces.pop(name, None)
            for key in [key for key in session.copies if key[0] == name]:
                del session.copies[key]
        return base.as_strided(saved.size, saved.stride, base.storage_offset() + saved.offset)


def begin(gather: Gather) -> tuple[ForwardSession, torch.autograd.graph.saved_tensors_hooks]:
    """Start a session for an outermost eager forward; the returned hooks are entered (call `end` after)."""
    session = ForwardSession(gather, torch._C._autograd._top_saved_tensors_default_hooks(False))
    hooks = torch.autograd.graph.saved_tensors_hooks(session.pack, ForwardSession.unpack)
    hooks.__enter__()
    return session, hooks


def end(hooks: torch.autograd.graph.saved_tensors_hooks) -> None:
    hooks.__exit__(None, None, None)
