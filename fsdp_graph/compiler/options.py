"""torch.compile's own `mode=` and `options=`: Dynamo hands them to a custom backend as keyword arguments
(`_TorchCompileWrapper` passes `mode` unless it is "default" and `options` unless empty, never both: torch.compile
refuses that itself). `fsdp_backend` turns them into Inductor config patches, as torch's own Inductor backend does."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Config entries the pipeline sets itself: a user value would silently replace a pass (or be replaced).
_PASS_SLOT = (
    "is where fsdp_backend installs its own pass; register yours as post_grad_custom_post_pass (after ours) instead"
)
_OWNED = {
    "joint_custom_pre_pass": _PASS_SLOT,
    "post_grad_custom_pre_pass": _PASS_SLOT,
    "reorder_for_peak_memory": (
        "stays False: Inductor's peak-memory reordering would move the prefetched all-gathers back to their first "
        "use and undo passes.schedule's order (docs/design-notes.md); make_backend(prefetch=...) sets the schedule"
    ),
}
# What the pipeline sets an owned entry to where it is not a pass (a user's equal value is accepted).
OWNED_VALUES = {"reorder_for_peak_memory": False}

CUDAGRAPHS_REFUSED = (
    "fsdp_backend cannot run its graphs as CUDA graphs ({source}). The flat parameter shards are plain tensor "
    "attributes that the optimizer, state-dict loads and `.to()` change outside the graph, and each parameter's "
    ".grad is a view into the flat gradient that is accumulated in place across steps. A CUDA graph replays the "
    "memory addresses it recorded at capture and reuses its output memory on the next replay, so it would read "
    "stale shards and overwrite gradients still in use. Use mode='max-autotune-no-cudagraphs' (or the default mode), "
    "and leave triton.cudagraphs off."
)


def inductor_config_patches(mode: str | None, options: Mapping[str, Any] | None, inductor: bool) -> dict[str, Any]:
    """The Inductor config patches that `mode` and `options` stand for (`options` override the mode's entries).

    Raises ValueError, naming the argument and the fix, when nothing would use them (`inductor=False`), when an
    option is not an Inductor config entry or is one the pipeline owns, and when CUDA graphs would be on."""
    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options

    mode = None if mode == "default" else mode
    if mode is None and not options:
        patches: dict[str, Any] = {}
    elif not inductor:
        given = f"mode={mode!r}" if mode is not None else f"options={dict(options or {})!r}"
        raise ValueError(
            f"fsdp_backend: torch.compile(..., {given}) configures Inductor, but this backend was made with "
            "make_backend(inductor=False) and runs eager kernels, so nothing would use it. Drop the argument, or use "
            "a backend made with inductor=True."
        )
    else:
        try:
            patches = dict(list_mode_options(mode)) if mode is not None else {}
        except RuntimeError as error:
            raise ValueError(f"fsdp_backend: {error}") from None
        known = inductor_config.get_config_copy()
        for key, value in (options or {}).items():
            name = key.replace("-", "_")
            if name not in known:
                raise ValueError(
                    f"fsdp_backend: options[{key!r}] is not an Inductor config entry "
                    "(torch._inductor.list_options() lists them)"
                )
            if name in _OWNED and OWNED_VALUES.get(name, object()) != value:
                raise ValueError(f"fsdp_backend: options[{key!r}] {_OWNED[name]}")
            patches[name] = value
    if patches.get("triton.cudagraphs", inductor and inductor_config.triton.cudagraphs):
        if "triton.cudagraphs" in (options or {}):
            source = "options['triton.cudagraphs']=True"
        elif mode is not None:
            source = f"mode={mode!r} turns them on"
        else:
            source = "torch._inductor.config.triton.cudagraphs is True"
        raise ValueError(CUDAGRAPHS_REFUSED.format(source=source))
    return patches


def patches_key(patches: Mapping[str, Any]) -> str:
    """A stable text of the patches for the passes' cache key: a CustomGraphPass counts by its uuid, not its id."""
    parts = []
    for name in sorted(patches):
        value = patches[name]
        uuid = getattr(value, "uuid", None)
        parts.append(f"{name}={uuid() if callable(uuid) else repr(value)}")
    return ";".join(parts)
