"""Rank-side: torchtune 0.6.1's FSDP recipe steps (`full_finetune_distributed._setup_model` and its training step),
run with `fsdp_graph.fsdp2.fully_shard` in place of torch's, against the same steps with torch's FSDP2.

torchtune's `training.shard_model` calls the `fully_shard` it imported into `torchtune.training._distributed`; the
switch replaces that module attribute (the one-import change of docs/migrating-from-fsdp2.md). Configurations:
- `plain`: the model built on CPU, `shard_model`, training;
- `ac`: also `training.set_activation_checkpointing(model, {TransformerSelfAttentionLayer})` before sharding;
- `recipe`: the recipe's own order: the model built on meta, activation checkpointing, `shard_model`, `rope_init()`,
  then `training.load_from_full_model_state_dict` (DCP's `set_model_state_dict`: `load_state_dict(assign=True)`).
The model is torchtune's Llama 3.2 builder with 2 layers, small dimensions and tied embeddings; the loss is the
recipe's default `CEWithChunkedOutputLoss` with `set_num_output_chunks`; 5 SGD-with-momentum steps."""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_graph
from fsdp_graph import fsdp2

CONFIGS = ("plain", "ac", "recipe")
MODES = ("eager", "compiled")
STEPS = 5
VOCAB = 64
IGNORE = -100


def available() -> str | None:
    """None when torchtune 0.6.1 (with torchao 0.11 and its imports) imports here, else the reason it does not."""
    try:
        import torchtune.training  # noqa: F401
        from torchtune.models.llama3_2 import llama3_2  # noqa: F401
    except Exception as error:  # an absent package or one of its dependencies
        return f"torchtune 0.6.1 with its imports (.ci/run) is not importable: {error!r}"
    return None


def _build() -> nn.Module:
    from torchtune.models.llama3_2 import llama3_2

    return llama3_2(
        vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=32,
        intermediate_dim=64, tie_word_embeddings=True,
    )


def _setup(config: str, shard_with: Callable, checkpoint: dict[str, torch.Tensor], world: int) -> nn.Module:
    """The recipe's `_setup_model` with `shard_with` as torchtune's `fully_shard`."""
    from torchtune import modules, training
    from torchtune.training import _distributed

    if config == "recipe":
        with torch.device("meta"):
            model = _build()
    else:
        model = _build()
        model.load_state_dict(checkpoint)
    if config in ("ac", "recipe"):
        training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    torch_fully_shard = _distributed.fully_shard
    _distributed.fully_shard = shard_with
    try:
        training.shard_model(
            model=model, shard_conditions=[training.get_shard_conditions], cpu_offload=False,
            reshard_after_forward=True, dp_mesh=mesh["dp"],
        )
    finally:
        _distributed.fully_shard = torch_fully_shard
    if config == "recipe":
        with torch.device("cpu"):
            for module in model.modules():
                if hasattr(module, "rope_init"):  # RoPE's buffers are not in the state dict
                    module.rope_init()
        training.load_from_full_model_state_dict(model, dict(checkpoint), torch.device("cpu"), strict=True)
        training.validate_no_params_on_meta_device(model)
    return model


def _train(config: str, shard_with: Callable, mode: str, rank: int, world: int, checkpoint, reference: bool) -> dict:
    """The recipe's training step: labels shifted with the ignore index, the loss times the token count, backward,
    the gradients scaled by world / all tokens (`training.scale_grads`), then the optimizer (SGD with momentum).
    `mode` "compiled": the loss is `nn.CrossEntropyLoss` on whole logits (torchtune's `CEWithChunkedOutputLoss` makes
    the model call its `torch.compiler.disable`d `chunked_output`: a graph break); the reference then runs eagerly
    with the same loss."""
    from torchtune import training
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    model = _setup(config, shard_with, checkpoint, world)
    run, backend = model, None
    if mode == "compiled":
        loss_fn: nn.Module = nn.CrossEntropyLoss(ignore_index=IGNORE)
        if not reference:
            torch._dynamo.reset()
            backend = fsdp_graph.make_backend(inductor=False)
            run = torch.compile(model, backend=backend, fullgraph=True)
    else:
        loss_fn = CEWithChunkedOutputLoss(ignore_index=IGNORE)
        model.set_num_output_chunks(loss_fn.num_output_chunks)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (2, 16), generator=gen)
        labels = torch.hstack((tokens[:, 1:], torch.full((2, 1), IGNORE)))
        logits = run(tokens)
        if not isinstance(logits, list):
            logits, labels = logits.reshape(-1, logits.size(-1)), labels.reshape(-1)
        num_tokens = (labels != IGNORE).sum()
        loss = loss_fn(logits, labels) * num_tokens
        loss.backward()
        torch.distributed.all_reduce(num_tokens)
        training.scale_grads(model, world / num_tokens)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item() / num_tokens.item())
    params = {name: param.to_local().detach().clone() for name, param in model.named_parameters()}
    return {"losses": losses, "params": params, "graphs": None if backend is None else backend.dynamo_graphs}


def _compare(ref: dict, mine: dict) -> dict[str, float]:
    out = {"loss_diff": max(abs(a - b) for a, b in zip(ref["losses"], mine["losses"]))}
    out["loss_moved"] = abs(ref["losses"][0] - ref["losses"][-1])
    out["same_params"] = float(list(ref["params"]) == list(mine["params"]))
    out["param_diff"] = max(
        (ref["params"][n] - p).abs().max().item() if p.numel() else 0.0
        for n, p in mine["params"].items()
        if n in ref["params"] and ref["params"][n].shape == p.shape
    )
    out["same_shapes"] = float(all(ref["params"].get(n, p).shape == p.shape for n, p in mine["params"].items()))
    if mine["graphs"] is not None:
        out["graphs"] = float(mine["graphs"])
    return out


def tune_recipe_checks(rank: int, world: int) -> dict[str, dict[str, float | str]]:
    torch.manual_seed(0)
    checkpoint = {k: v.clone() for k, v in _build().state_dict().items()}  # the "checkpoint" every rank reads
    results: dict[str, dict[str, float | str]] = {}
    for config in CONFIGS:
        for mode in MODES:  # the reference runs the same loss as the run it is compared with
            name = f"{config}[{mode}]"
            try:
                ref = _train(config, torch.distributed.fsdp.fully_shard, mode, rank, world, copy.deepcopy(checkpoint), True)
            except Exception:
                results[name] = {"error": "reference: " + traceback.format_exc(limit=8)}
                continue
            try:
                mine = _train(config, fsdp2.fully_shard, mode, rank, world, copy.deepcopy(checkpoint), False)
                results[name] = _compare(ref, mine)
            except Exception:  # recorded for the test that owns this check
                results[name] = {"error": traceback.format_exc(limit=8)}
            finally:
                fsdp2.calls._PENDING.clear()
    return results
