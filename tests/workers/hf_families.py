"""Hugging Face model families (tiny configs, random init, nothing downloaded), each trained sharded and compiled with
and without `reuse_blocks` (issue 25), called with their defaults (a KV cache for decoders: issue 36): the same
losses, parameters and caches bit for bit, one Dynamo graph, with reuse a body shared by the decoder (encoder,
vision) layers, and both trained as the unsharded model, stepped eagerly beside them on the same batches."""

from __future__ import annotations

import warnings
from collections import Counter

import torch
import torch.nn as nn

import fsdp_graph
from tests.workers.block_reuse import body_calls
from tests.workers.hf_models import VOCAB, build_hf, make_batch

SEQ = 16
STEPS = 2  # the second step shows there is no recompile
# Llama-shaped decoders: (transformers config class, model class, extra config fields)
DECODERS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    # alternating sliding-window and global layers: two structures, two bodies
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"head_dim": 16, "sliding_window": 8, "num_hidden_layers": 4, "attn_implementation": "eager"},  # no SDPA
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"bos_token_id": 0, "eos_token_id": 0}),
}
# One family per structure the block key and the cache handling meet: Llama (its Qwen2/Qwen3/Mistral/Phi3 relatives
# differ in a bias, a norm or fused projections, not in how a layer is called; `build_family` still builds them), T5
# (encoder and decoder stacks, an EncoderDecoderCache), Gemma2 (two layer kinds), GPT-NeoX (parallel residual), ViT
# (no text, no cache), GPT-2 (tied head in the root). Split over 2 ranks by their CPU seconds for both runs (measured
# on 1 rank, 2026-12-07: T5 24.7, Gemma2 14.9, GPT-NeoX 8.0, Llama 7.7, GPT-2 7.0, ViT 6.6): 32.7 and 36.2 s, where
# every other family of one list gave 39.7 and 29.2.
FAMILIES_BY_RANK = [["t5", "gpt_neox"], ["llama", "gemma2", "vit", "gpt2"]]
FAMILIES = [name for names in FAMILIES_BY_RANK for name in names]


def build_family(name: str) -> tuple[nn.Module, object]:
    """The model (from the current RNG state) and the wrap policy (None: the default units)."""
    import transformers

    if name in ("llama", "gpt2"):
        return build_hf(name), None
    if name in DECODERS:
        config_name, model_name, extra = DECODERS[name]
        fields = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        fields.update(intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=32)
        config = getattr(transformers, config_name)(**{"attn_implementation": "sdpa", **fields, **extra})
        return getattr(transformers, model_name)(config), None
    if name == "t5":  # encoder and decoder blocks differ (cross-attention), and so does each stack's first block
        config = transformers.T5Config(
            vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=3, num_heads=4, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        )  # fmt: skip
        model = transformers.T5ForConditionalGeneration(config)
        return model, fsdp_graph.ModuleWrapPolicy({type(model.encoder.block[0])})
    if name == "vit":
        config = transformers.ViTConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=16,
            patch_size=4, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        # its loss sets config.problem_type on the first call, which would recompile the second step (plain
        # torch.compile too): set to what that call sets
        config.problem_type = "single_label_classification"
        return transformers.ViTForImageClassification(config), None
    raise ValueError(name)


def family_batch(name: str, gen: torch.Generator) -> dict:
    if name == "vit":
        return {
            "pixel_values": torch.randn(4, 3, 16, 16, generator=gen),
            "labels": torch.randint(0, 10, (4,), generator=gen),
        }
    batch = make_batch(gen, 4)
    if name == "t5":
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": batch["labels"]}
    return batch


def cache_tensors(out) -> list[torch.Tensor]:
    """Every key and value tensor of the transformers cache in a model output (none: an empty list), in layer order;
    an EncoderDecoderCache's self-attention halves, then its cross-attention ones."""
    from transformers.cache_utils import Cache, EncoderDecoderCache

    def flat(cache) -> list[torch.Tensor]:
        if isinstance(cache, EncoderDecoderCache):
            return flat(cache.self_attention_cache) + flat(cache.cross_attention_cache)
        return [t for layer in cache.layers for t in (layer.keys, layer.values)]

    caches = [value for value in out.values() if isinstance(value, Cache)]
    return [t.detach().clone() for cache in caches for t in flat(cache)]


def _prefill_against(theirs, out) -> dict:
    """The first step's forward (a prefill: every layer's cache empty on entry) against the unsharded model's output
    `theirs` on the same batch: whether the logits and every cached key and value are equal bit for bit, how many
    cache tensors, and T5's per-layer cross-attention flags (`EncoderDecoderCache.is_updated`) on both sides."""
    mine_cache, their_cache = cache_tensors(out), cache_tensors(theirs)
    flags = [getattr(o.get("past_key_values"), "is_updated", None) for o in (out, theirs)]
    return {
        "logits_equal": torch.equal(out.logits.detach(), theirs.logits.detach()),
        "caches_equal": len(mine_cache) == len(their_cache)
        and all(torch.equal(a, b) for a, b in zip(mine_cache, their_cache)),
        "cache_tensors": len(mine_cache),
        "is_updated": [dict(f) if f is not None else None for f in flags],
    }


def train_family(name: str, reuse: bool, mesh=None) -> dict:
    """STEPS SGD steps (momentum) of `name`, sharded over `mesh` (None: the world), compiled fullgraph with eager
    kernels, called as its users call it: the config's defaults (decoders' `use_cache`: transformers passes every
    layer a cache, empty on entry)."""
    torch.manual_seed(0)
    plain, _ = build_family(name)
    torch.manual_seed(0)
    model, wrap = build_family(name)
    fsdp_graph.fully_shard(model, mesh, wrap=wrap, reuse_blocks=reuse)
    backend = fsdp_graph.make_backend(inductor=False)
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return backend(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, plain)]
    gen = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    losses, plain_losses, prefill = [], [], {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            batch = family_batch(name, gen)
            out = compiled(**batch)
            theirs = plain(**batch)  # autograd on, as compiled: T5's eager logits move 1.5e-6 under no_grad
            if step == 0:
                prefill = _prefill_against(theirs, out)
            for loss, kept in ((out.loss, losses), (theirs.loss, plain_losses)):
                loss.backward()
                kept.append(loss.item())
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
    with fsdp_graph.summon_full_params(model):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    plain_params = dict(plain.named_parameters())
    return {
        "losses": losses,
        "params": params,
        # single-process training, the unsharded model stepped eagerly beside it on the same batches
        "plain_loss_diff": max(abs(a - b) for a, b in zip(losses, plain_losses)),
        "plain_param_diff": max((v - plain_params[n]).abs().max().item() for n, v in params.items()),
        "cache": [] if name == "vit" else cache_tensors(out),
        "prefill": prefill,
        "graphs": len(graphs),
        "body_uses": sorted(Counter(body_calls(graphs[0])).values()),
        "reuse_warnings": [str(w.message) for w in caught if "reuse_blocks" in str(w.message)],
    }


def train_families(rank: int, world: int, names_by_rank: list[list[str]]) -> dict[str, list[dict]]:
    """Each family of `names_by_rank[rank]` trained without and with `reuse_blocks`, on its own, sharded over a
    one-rank mesh: the comparison is within a rank, so the ranks split the compiles between them."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("family", "dp"))["dp"]
    return {name: [train_family(name, False, mesh), train_family(name, True, mesh)] for name in names_by_rank[rank]}
