"""explain() on the meta device plans scaled-dot-product attention as the fused kernel a device runs
(`fsdp_graph.planning.attention`), not meta's math fallback with its fp32 score matrix."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

import fsdp_graph
from fsdp_graph.planning.attention import fused_attention_on_meta
from fsdp_graph.train.llama import Llama, preset

EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention.default
EFFICIENT_BACKWARD = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
SOFTMAX = torch.ops.aten._safe_softmax.default


def _targets(report) -> list[set]:
    """Per graph, the ops it calls, those of its block bodies (shared `invoke_subgraph` bodies) included."""
    graphs = [[g.graph, *(m for m in g.graph.children() if isinstance(m, torch.fx.GraphModule))] for g in report.graphs]
    return [{n.target for gm in group for n in gm.graph.nodes if n.op == "call_function"} for group in graphs]


def _plan(fused: bool, seq: int):
    cfg = dataclasses.replace(preset("tiny", seq=seq), layers=2)
    with torch.device("meta"):
        model = Llama(cfg)
    mp = fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fsdp_graph.fully_shard(model, device="meta", param_init_fn=model.init_module, mixed_precision=mp)
    idx = torch.zeros(1, seq, dtype=torch.long, device="meta")

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return -logits.float().log_softmax(-1).gather(-1, idx.unsqueeze(-1)).mean()

    return cfg, fsdp_graph.explain(model, idx, loss_fn=loss, hardware="nvlink", fused_attention=fused)


def test_meta_plan_uses_the_fused_kernel_and_drops_the_score_matrix(fake_pg):
    seq = 256
    cfg, fused = _plan(True, seq)
    _, math = _plan(False, seq)
    forward, backward = _targets(fused)
    assert EFFICIENT in forward and SOFTMAX not in forward
    assert EFFICIENT_BACKWARD in backward
    assert EFFICIENT not in _targets(math)[0] and SOFTMAX in _targets(math)[0]
    # The math path keeps at least one fp32 (heads, seq, seq) softmax per layer for the backward (bf16 is upcast on
    # meta); the fused kernel keeps its output and a (heads, seq) log-sum-exp instead.
    scores = cfg.heads * seq * seq * 4
    assert math.peak_memory_bytes - fused.peak_memory_bytes >= cfg.layers * scores
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention  # restored after explain


def test_context_leaves_other_devices_alone():
    q = torch.randn(1, 2, 8, 4)
    with fused_attention_on_meta():
        patched = F.scaled_dot_product_attention
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        mask = torch.ones(8, 8, dtype=torch.bool, device="meta").tril()
        meta = torch.empty(1, 2, 8, 4, device="meta", requires_grad=True)
        masked = F.scaled_dot_product_attention(meta, meta, meta, attn_mask=mask)
    assert patched is not torch._C._nn.scaled_dot_product_attention
    assert torch.equal(out, torch._C._nn.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert masked.shape == (1, 2, 8, 4) and masked.device.type == "meta"
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
