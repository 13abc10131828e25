"""A Hugging Face KV cache that is empty for the block it is passed to shares the block's body (issue 36).

transformers passes every decoder layer a `Cache` object when `use_cache` is on (the config's default, training
included). torch reuses a `nested_compile_region` body only for tensors, numbers, strings, None and modules, so a
call with a cache object ran the layer on its own. For the layer's own entry of the cache EMPTY on entry (training,
a prefill) the call is equivalent to one on a fresh empty cache, followed by the real cache's `update` with the
keys and values the layer computed:

- the caller replaces the cache argument by a marker string (`marker`), which torch accepts;
- inside the body the marker becomes a fresh, empty cache of transformers' own classes (`stand_ins`: a
  `DynamicCache` whose `update` also records its inputs; an `EncoderDecoderCache` of two of them), so the layer
  runs transformers' own cache code on an empty entry, as it would on the real one;
- the body returns the recorded keys and values after its own outputs (`recorded_updates`), and the caller replays
  the `update` calls on the real cache with its own layer index, outside the body (and T5's `is_updated` flag).
  What is replayed is what `update` returned on the empty entry: new tensors, equal to the ones it was given.

Exact where an empty entry's `update` returns what it is given and stores a function of it only: transformers'
`DynamicLayer` and `DynamicSlidingWindowLayer` (both concatenate onto an empty tensor; the sliding one keeps the
last window). `eligible` checks that on the real cache, through its class names and attributes shared by
transformers 5.17 and 5.24 (`layers`, `layer_class_to_replicate`, `offloading`, `is_updated`, the sub-caches); any
other cache (static, quantized, offloaded, a layer holding keys already: decoding) is refused, and the caller runs
the layer's own forward with one warning (`reuse_blocks=None`) or raises (`reuse_blocks=True`).
"""

from __future__ import annotations

import torch

MARKER_PREFIX = "fsdp_graph: empty transformers cache, "
_CACHE_KINDS = {
    ("transformers.cache_utils", "DynamicCache"): "dynamic",
    ("transformers.cache_utils", "EncoderDecoderCache"): "encoder_decoder",
}
_EXACT_LAYERS = frozenset(
    {("transformers.cache_utils", "DynamicLayer"), ("transformers.cache_utils", "DynamicSlidingWindowLayer")}
)
_SUB_CACHES = ("self_attention_cache", "cross_attention_cache")


def cache_kind(value: object) -> str | None:
    """The kind, "dynamic" or "encoder_decoder", for transformers' `DynamicCache` or `EncoderDecoderCache` (the classes
    themselves, not subclasses), else None."""
    cls = type(value)
    return _CACHE_KINDS.get((cls.__module__, cls.__qualname__))


def marker(kind: str) -> str:
    """The string that stands for an empty cache of `kind` in a body's arguments."""
    return MARKER_PREFIX + kind


def layer_index(unit: torch.nn.Module) -> int | None:
    """The `layer_idx` every transformers module of `unit` that has one agrees on (the index a layer addresses its
    cache with), or None: none, or several. For such a layer, also makes the stand-in classes (`_CLASSES`)."""
    found = {
        module.layer_idx
        for module in unit.modules()
        if getattr(type(module), "_fsdp_original_class", type(module)).__module__.startswith("transformers.")
        and isinstance(getattr(module, "layer_idx", None), int)
    }
    if len(found) != 1:
        return None
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _make_stand_in_classes()
    return found.pop()


def eligible(cache: object, kind: str, layer: int | None) -> str | None:
    """Why `cache` (of `kind`) cannot be replaced by an empty stand-in for the block at `layer`, or None: its entry
    for `layer` must hold nothing and be (or become) a layer type whose `update` on an empty entry is exact."""
    if layer is None:
        return "its block has no single `layer_idx` to address the cache with"
    if kind == "dynamic":
        return _dynamic_refusal(cache, layer)
    for name in _SUB_CACHES:
        why = _dynamic_refusal(getattr(cache, name), layer)
        if why is not None:
            return f"its {name} {why}"
    if cache.is_updated.get(layer):
        return "its cross-attention entry is already computed (decoding)"
    return None


def _dynamic_refusal(cache: object, layer: int) -> str | None:
    if cache_kind(cache) != "dynamic":
        return f"is a {type(cache).__qualname__}, not a DynamicCache"
    if cache.offloading:
        return "offloads its layers"
    layers = cache.layers
    if layer < len(layers):
        entry = layers[layer]
        if (type(entry).__module__, type(entry).__qualname__) not in _EXACT_LAYERS:
            return f"holds a {type(entry).__qualname__} for this layer"
        if entry.get_seq_length() != 0:
            return "holds keys and values for this layer already (decoding)"
        return None
    replicated = cache.layer_class_to_replicate
    if replicated is None or (replicated.__module__, replicated.__qualname__) not in _EXACT_LAYERS:
        return "makes layers of a type other than DynamicLayer"
    return None


def _make_stand_in_classes() -> tuple[type, type]:
    """(a `DynamicCache` that also records the keys and values given to `update`, `EncoderDecoderCache`)."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    class RecordingDynamicCache(DynamicCache):
        """An empty `DynamicCache` that also records each `update`'s layer index and the keys and values it returns:
        on an empty entry, new tensors equal to those it was given (a concatenation onto nothing). Those, not the
        given ones, leave the body: GPT-2's keys and values are views of one tensor, and torch refuses a body
        whose outputs alias each other."""

        def __init__(self):
            super().__init__()
            self.fsdp_graph_updates = []

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            self.fsdp_graph_updates.append((layer_idx, keys, values))
            return keys, values

    return RecordingDynamicCache, EncoderDecoderCache


# Made before any trace, by `layer_index` for a transformers layer (so transformers is imported): traced code reads
# them as a module global, which Dynamo guards as such (a class made or returned at trace time leaves guards on a
# name the guard code cannot resolve).
_CLASSES: tuple[type, type] | None = None


def stand_ins(args: tuple, kwargs: dict) -> tuple[tuple, dict, list]:
    """`args` and `kwargs` with each marker replaced by a fresh empty cache, and the (place, cache) replaced."""
    made = []

    def fresh(value, place):
        if not (isinstance(value, str) and value.startswith(MARKER_PREFIX)):
            return value
        recording, encoder_decoder = _CLASSES
        if value == marker("dynamic"):
            cache = recording()
        else:
            cache = encoder_decoder(recording(), recording())
        made.append((place, cache))
        return cache

    new_args = tuple(fresh(value, ("arg", i)) for i, value in enumerate(args))
    new_kwargs = {name: fresh(value, ("kwarg", name)) for name, value in kwargs.items()}
    return new_args, new_kwargs, made


def recorded_updates(made: list, layer: int | None) -> tuple[tuple, tuple]:
    """(what to replay, its tensors) from the stand-ins a body's layer ran with: ("update", place, sub-cache or
    None) per `update` call (two tensors each: keys, values) and ("flag", place, value) per `is_updated` entry set;
    or (("refused", why),) when the layer touched an entry other than its own."""
    replay, tensors = [], []
    for place, cache in made:
        pair = cache_kind(cache) == "encoder_decoder"
        subs = [(n, getattr(cache, n)) for n in _SUB_CACHES] if pair else [(None, cache)]
        for name, sub in subs:
            for index, keys, values in sub.fsdp_graph_updates:
                if index != layer:
                    return (("refused", f"its layer updates the cache at index {index}, not its own ({layer})"),), ()
                replay.append(("update", place, name))
                tensors.extend((keys, values))
        if pair:  # T5 marks its cross-attention entry as computed
            for index, value in cache.is_updated.items():
                if index != layer:
                    return (("refused", f"its layer marks the cache's entry {index}, not its own ({layer})"),), ()
                replay.append(("flag", place, value))
    return tuple(replay), tuple(tensors)


def refusal(replay: tuple | None) -> str | None:
    """Why a body's cache calls cannot be replayed, or None."""
    if replay and replay[0][0] == "refused":
        return replay[0][1]
    return None


def apply_updates(replay: tuple, tensors: tuple, args: tuple, kwargs: dict, layer: int) -> None:
    """Replays a body's cache calls on the caches in `args`/`kwargs` (the call's own), for `layer`."""
    pending = iter(tensors)
    for kind, place, name in replay:
        cache = args[place[1]] if place[0] == "arg" else kwargs[place[1]]
        if kind == "flag":
            cache.is_updated[layer] = name
            continue
        target = cache if name is None else getattr(cache, name)
        keys, values = next(pending), next(pending)
        target.update(keys, values, layer)
