"""What one kernel costs: its flops (attention counted over the query-key pairs its mask leaves), its class
(matmul, attention, or memory-bound), and its time on a `Hardware`.

Flops come from `torch.utils.flop_counter`'s formulas. Its attention formulas count every query-key pair; a
causal kernel (`is_causal=True`) computes only the pairs at or below the diagonal, about half at long sequences,
and a sliding window of w keys at most w per query (`attention_pair_fraction`). Attention wrapped by the
partitioner's `run_and_save_rng_state` / `run_with_rng_state` (a recomputed random op under activation
checkpointing) is costed as the op it runs.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
from torch.fx.operator_schemas import normalize_function
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop, sdpa_flop

from passes.fx_nodes import fake_value, hint
from passes.hardware import Hardware

_aten = torch.ops.aten

# CPU attention kernels are missing from torch's registry; their arguments start like the CUDA ones'.
_EXTRA_FLOPS = {
    _aten._scaled_dot_product_flash_attention_for_cpu: sdpa_flop,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_backward_flop,
}
MATMULS = frozenset(
    {_aten.mm, _aten.bmm, _aten.addmm, _aten.baddbmm, _aten.matmul, _aten._scaled_mm, _aten.convolution}
)
ATTENTION = frozenset(
    {
        _aten._scaled_dot_product_efficient_attention,
        _aten._scaled_dot_product_efficient_attention_backward,
        _aten._scaled_dot_product_flash_attention,
        _aten._scaled_dot_product_flash_attention_backward,
        _aten._scaled_dot_product_cudnn_attention,
        _aten._scaled_dot_product_cudnn_attention_backward,
        _aten._scaled_dot_product_flash_attention_for_cpu,
        _aten._scaled_dot_product_flash_attention_for_cpu_backward,
        _aten._flash_attention_forward,
        _aten._flash_attention_backward,
        _aten._efficient_attention_forward,
        _aten._efficient_attention_backward,
    }
)
RNG_WRAPPERS = (run_and_save_rng_state, run_with_rng_state)
_SEQUENCE_MAJOR = frozenset(
    {
        _aten._flash_attention_forward,
        _aten._flash_attention_backward,
        _aten._efficient_attention_forward,
        _aten._efficient_attention_backward,
    }
)


def called_op(node: fx.Node) -> tuple[object, tuple, dict]:
    """(op, args, kwargs) a node runs: its own target, or the op inside an rng wrapper."""
    if node.target is run_and_save_rng_state:
        return node.args[0], tuple(node.args[1:]), dict(node.kwargs)
    if node.target is run_with_rng_state:
        return node.args[1], tuple(node.args[2:]), dict(node.kwargs)
    return node.target, tuple(node.args), dict(node.kwargs)


def kind_of(node: fx.Node) -> str:
    """ "matmul", "attention" or "other" (memory-bound) for a compute node."""
    op = called_op(node)[0]
    packet = getattr(op, "overloadpacket", None)
    if packet in MATMULS:
        return "matmul"
    if packet in ATTENTION:
        return "attention"
    return "other"


def attention_pair_fraction(q_len: int, k_len: int, causal: bool, window: int | None = None) -> float:
    """The fraction of the q_len x k_len query-key pairs an attention kernel computes. Causal masks are
    top-left aligned as `F.scaled_dot_product_attention(is_causal=True)`: query i sees keys 0..i. A sliding window
    of w keys (causal, as Mistral's) keeps the last w of those: query i sees keys i-w+1..i."""
    if q_len <= 0 or k_len <= 0:
        return 0.0
    if not causal and window is None:
        return 1.0
    limit = k_len if window is None else min(k_len, window)
    ramp = min(q_len, limit)  # queries 0..ramp-1 see i + 1 keys, the rest see `limit`
    pairs = ramp * (ramp + 1) // 2 + (q_len - ramp) * limit
    return pairs / (q_len * k_len)


def _concrete(val):
    """A meta tensor with `val`'s concrete (hinted) shape, so flop formulas see plain ints."""
    if isinstance(val, torch.Tensor):
        return torch.empty([hint(s) for s in val.shape], dtype=val.dtype, device="meta")
    if isinstance(val, (list, tuple)):
        return type(val)(_concrete(v) for v in val)
    if isinstance(val, torch.SymInt):
        return hint(val)
    return val


def _output_value(node: fx.Node, op) -> object:
    val = fake_value(node)
    if node.target is run_and_save_rng_state and isinstance(val, (tuple, list)) and len(val) == 2:
        return val[1]  # (rng state, the op's output)
    return val


def node_flops(node: fx.Node, attention_window: int | None = None) -> int:
    """Flops of one node from torch.utils.flop_counter's formulas (matmuls, convolutions, attention); 0 for
    everything else (elementwise kernels are charged by the bytes they move instead). Attention counts only the
    pairs its causal mask and `attention_window` leave."""
    if node.op != "call_function":
        return 0
    op, args, kwargs = called_op(node)
    if not isinstance(op, torch._ops.OpOverload):
        return 0
    formula = flop_registry.get(op.overloadpacket) or _EXTRA_FLOPS.get(op.overloadpacket)
    if formula is None:
        return 0
    concrete_args, concrete_kwargs = fx.map_arg((args, kwargs), lambda n: _concrete(fake_value(n)))
    flops = hint(formula(*concrete_args, **concrete_kwargs, out_val=_concrete(_output_value(node, op))))
    if op.overloadpacket in ATTENTION:
        flops = round(flops * _attention_fraction(op, concrete_args, concrete_kwargs, attention_window))
    return flops


def _attention_fraction(op, args: tuple, kwargs: dict, window: int | None) -> float:
    bound = normalize_function(op, args, kwargs, normalize_to_only_use_kwargs=True)
    named = bound.kwargs if bound is not None else {}
    causal = bool(named.get("is_causal", False)) or named.get("custom_mask_type", 0) in (1, 2)
    query = named.get("query", args[0] if args else None)
    key = named.get("key", args[1] if len(args) > 1 else None)
    if not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor):
        return 1.0
    # (batch, heads, seq, dim) for SDPA's kernels; (batch, seq, heads, dim) for the _flash/_efficient ones.
    seq_dim = 1 if op.overloadpacket in _SEQUENCE_MAJOR else -2
    return attention_pair_fraction(query.shape[seq_dim], key.shape[seq_dim], causal, window)


def kernel_seconds(flops: float, moved_bytes: float, kind: str, hardware: Hardware, fp32: bool = False) -> float:
    """One kernel's time: max(flops / rate, bytes / memory rate) + the hardware's per-kernel overhead, the rate
    by the kernel's class (`Hardware.matmul_rate`, `attention_rate`, `vector_rate`)."""
    if kind == "matmul":
        rate = hardware.matmul_rate(fp32)
    elif kind == "attention":
        rate = hardware.attention_rate()
    else:
        rate = hardware.vector_rate()
    compute = flops / rate if flops else 0.0
    return max(compute, moved_bytes / hardware.memory_rate()) + hardware.kernel_overhead_s


def is_fp32_matmul(node: fx.Node) -> bool:
    val = _output_value(node, called_op(node)[0])
    return isinstance(val, torch.Tensor) and val.dtype == torch.float32
