"""Planning on the meta device: scaled-dot-product attention as the fused kernel a real device runs, and the
partitioner's rng wrappers (full activation checkpointing) runnable on meta tensors.

On meta tensors `F.scaled_dot_product_attention` can only take its math fallback: in bf16 it upcasts to fp32 and
materialises a (batch, heads, seq, seq) score matrix and its softmax, which the backward keeps. No GPU (and no CPU
with torch's flash kernel) runs that: a plan that models it over-counts the peak by gigabytes per layer at 2048
tokens and traces about forty extra nodes per layer. While `fused_attention_on_meta()` is active, a call on meta
tensors traces as `aten._scaled_dot_product_efficient_attention` (the memory-efficient kernel, which takes fp32 and
low precision, additive masks and causal masking), whose meta kernels give the output and the fp32 log-sum-exp it
saves. Calls on other devices are untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

_efficient = torch.ops.aten._scaled_dot_product_efficient_attention.default


@contextmanager
def fused_attention_on_meta() -> Iterator[None]:
    """Route `torch.nn.functional.scaled_dot_product_attention` on 4-D meta tensors to the memory-efficient
    attention op while the context is open (a model that imported the function by name before keeps the math
    path). Restores the original on exit."""
    original = F.scaled_dot_product_attention

    def scaled_dot_product_attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if query.device.type != "meta" or query.dim() != 4:
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if enable_gqa and key.shape[1] != query.shape[1]:
            key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
            value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
        bias = _additive_bias(attn_mask, query, key)
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return _efficient(query, key, value, bias, needs_grad, dropout_p, is_causal, scale=scale)[0]

    F.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _additive_bias(mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """SDPA's mask as the kernel's additive bias, broadcast to (batch, heads, q_len, k_len): a boolean mask keeps
    True positions (0) and masks False ones (-inf)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, float("-inf"))
    return mask.to(query.dtype).expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])


@contextmanager
def random_ops_on_meta() -> Iterator[None]:
    """Let the partitioner's rng wrappers run on meta tensors while the context is open.

    Under activation checkpointing, AOT autograd's partitioner recomputes a random op (the memory-efficient
    attention kernel is tagged random for its dropout) through `run_and_save_rng_state(op, ...)` in the forward
    and `run_with_rng_state(state, op, ...)` in the backward. Their kernels pick the generator by the inputs'
    device and know cuda, cpu, hpu and xpu, so running the graphs on meta tensors raised "Backend not supported
    for meta": full activation checkpointing could not be planned. On meta inputs the wrappers here run the op
    and hand back an empty meta state (there is no generator to save on meta); other devices keep torch's kernels.
    """
    from torch._C import DispatchKey
    from torch._prims.rng_prims import get_device, run_and_save_rng_state, run_with_rng_state

    key = DispatchKey.BackendSelect
    saved = {op: op.py_kernels[key] for op in (run_and_save_rng_state, run_with_rng_state)}

    def save_state(op, *args, **kwargs):
        if get_device(args, kwargs) == "meta":
            return torch.empty(0, dtype=torch.uint8, device="meta"), op(*args, **kwargs)
        return saved[run_and_save_rng_state](op, *args, **kwargs)

    def with_state(rng_state, op, *args, **kwargs):
        if get_device(args, kwargs) == "meta":
            return op(*args, **kwargs)
        return saved[run_with_rng_state](rng_state, op, *args, **kwargs)

    for op, kernel in ((run_and_save_rng_state, save_state), (run_with_rng_state, with_state)):
        op.py_kernels[key] = kernel
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, kernel in saved.items():
            op.py_kernels[key] = kernel
            op._dispatch_cache.clear()
