"""Hugging Face layers given a KV cache share a body when the cache is empty for them (issue 36), 1 gloo rank,
eager kernels: `generate()` gives an unsharded model's tokens (its prefill shares the body; the decoding steps, whose
cache is not empty, run each layer on its own with one warning), and `reuse_blocks=True` raises where a unit would
fall back. A prefill's logits and cache equal an unsharded model's bit for bit: the first step of every family in
tests/numerics/test_hf_models.py::test_families_train_alike_with_and_without_block_reuse (T5's EncoderDecoderCache
and its cross-attention flags included)."""

from __future__ import annotations

import warnings

import pytest
import torch

import fsdp_graph
from fsdp_graph.runtime.block_region import ReuseBlocksError
from tests.workers.block_reuse import body_calls
from tests.workers.hf_families import build_family

pytest.importorskip("transformers")


def _pair(name: str, reuse: bool | None = None):
    """(the family's model unsharded, the same model sharded and compiled with eager kernels in place, the Dynamo
    graphs it compiles)."""
    torch.manual_seed(0)
    plain, _ = build_family(name)
    torch.manual_seed(0)
    model, wrap = build_family(name)
    fsdp_graph.fully_shard(model, wrap=wrap, **({} if reuse is None else {"reuse_blocks": reuse}))
    backend = fsdp_graph.make_backend(inductor=False)
    graphs: list[torch.fx.GraphModule] = []
    torch._dynamo.reset()
    model.compile(backend=lambda gm, ex: graphs.append(gm) or backend(gm, ex), fullgraph=True)
    return plain, model, graphs


def test_generate_decodes_layer_by_layer_with_one_warning(one_rank):
    """`generate()` compiled (greedy, 3 new tokens) gives the unsharded model's tokens; its prefill shares the body,
    its decoding steps (a cache holding keys and values) run each layer on its own, with one warning saying why."""
    plain, model, graphs = _pair("llama")
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(tokens, plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False))
    assert tokens.shape == (2, 9)
    assert len(body_calls(graphs[0])) == 2 and all(body_calls(gm) == [] for gm in graphs[1:]) and len(graphs) > 1
    (warning,) = [str(w.message) for w in caught if "reuse_blocks" in str(w.message)]
    assert "LlamaDecoderLayer is traced layer by layer" in warning and "(decoding)" in warning, warning


def test_reuse_blocks_true_raises_where_a_unit_falls_back(one_rank):
    """`reuse_blocks=True`: a prefill shares the body; the first decoding step raises `ReuseBlocksError` (a
    ValueError) naming the layer and why, instead of tracing the layers one by one."""
    _, model, graphs = _pair("llama", reuse=True)
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"reuse_blocks=True: LlamaDecoderLayer cannot share a body: .*\(decoding\)"):
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
    assert issubclass(ReuseBlocksError, ValueError) and len(body_calls(graphs[0])) == 2
