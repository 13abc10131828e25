"""Hugging Face `transformers` models (tiny configs, random init, nothing downloaded) trained sharded and compiled
on each rank, against single-process training on the full batch (run inside each rank)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_graph
from tests.workers.training import max_param_diff

VOCAB = 128
SEQ = 16
PER_RANK_BATCH = 4
LR = 1e-3


def build_hf(name: str, vocab: int = VOCAB) -> nn.Module:
    """A 2-layer GPT-2 (tied embedding and head) or Llama (untied, grouped-query attention, RoPE), SDPA attention,
    fp32, initialised from the current RNG state, with a vocabulary of `vocab` tokens."""
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=2,
            n_embd=64,
            n_head=4,
            vocab_size=vocab,
            n_positions=32,
            attn_pdrop=0.0,
            embd_pdrop=0.0,
            resid_pdrop=0.0,
            bos_token_id=0,  # the defaults (50256) are outside this vocabulary
            eos_token_id=0,
            attn_implementation="sdpa",
        )
        model = GPT2LMHeadModel(config)
        # transformers derives the loss from the class name, and "GPT2LMHeadModel" matches none of its loss types:
        # every forward then calls logger.warning_once, which Dynamo cannot trace (fullgraph fails the same way
        # without fsdp_graph). Naming the loss it falls back to anyway avoids that call.
        model.loss_type = "ForCausalLM"
        return model
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=vocab,
            max_position_embeddings=32,
            tie_word_embeddings=False,
            attn_implementation="sdpa",
        )
        return LlamaForCausalLM(config)
    raise ValueError(name)


def make_batch(gen: torch.Generator, batch: int) -> dict[str, torch.Tensor]:
    """Random tokens, left-padded: row i masks its first i % 4 positions (attention_mask 0, label -100).
    Every block of 4 rows has the same number of real labels, so each rank's mean loss over its half weighs the
    same and their average is the full batch's mean."""
    input_ids = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    labels = input_ids.clone()
    for row in range(batch):
        attention_mask[row, : row % 4] = 0
        labels[row, : row % 4] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


@dataclass
class HFResult:
    name: str
    units: list[str]
    losses: list[float]  # the ranks' mean loss per step
    ref_losses: list[float]
    max_param_diff: float
    param_change: float  # max |final - initial| of the reference: parity is not vacuous
    dynamo_graphs: int
    reports: list[tuple[str, dict[str, int]]] = field(default_factory=list)
    tied: bool = False  # lm_head and the token embedding are still one parameter, sharded and in full_state_dict


def train_hf(rank: int, world: int, name: str, steps: int = 5, inductor: bool = False) -> HFResult:
    """`steps` AdamW steps of `name` sharded with the default wrap policy and compiled fullgraph, each rank on
    its half of a global batch, next to the same model trained in this process on the whole batch."""
    torch.manual_seed(0)
    model = build_hf(name)
    ref = copy.deepcopy(model)
    initial = copy.deepcopy(ref.state_dict())
    fsdp_graph.fully_shard(model)
    backend = fsdp_graph.make_backend(inductor=inductor)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    # HF init (std 0.02) leaves many gradient elements at 1e-8 and below (GPT-2's key bias is exactly zero in
    # exact arithmetic: softmax ignores a shift shared by all keys). Adam scales those up to lr-sized steps, so
    # the fp32 noise of summing a split batch in another order grows with lr: lr=1e-2 measured 1e-4 (GPT-2 key
    # bias), lr=1e-3 stays well inside the fp32 tolerance.
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1234)
    losses, ref_losses = [], []
    for _ in range(steps):
        full = make_batch(gen, PER_RANK_BATCH * world)
        local = {k: v.chunk(world)[rank] for k, v in full.items()}
        loss = compiled(**local).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)
        ref_loss = ref(**full).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    tied = False
    if name == "gpt2":
        full_sd = fsdp_graph.full_state_dict(model)
        tied = model.lm_head.weight is model.transformer.wte.weight and torch.equal(
            full_sd["lm_head.weight"], full_sd["transformer.wte.weight"]
        )
    return HFResult(
        name=name,
        units=[state.name for state in fsdp_graph.runtime.unit.flat_params(model)],
        losses=losses,
        ref_losses=ref_losses,
        max_param_diff=max_param_diff(model, ref),
        param_change=max((v - initial[k]).abs().max().item() for k, v in ref.state_dict().items()),
        dynamo_graphs=backend.dynamo_graphs,
        reports=[(r.stage, dict(r.collectives.counts)) for r in backend.reports],
        tied=tied,
    )


def run_hf_models(
    rank: int, world: int, names: list[str], inductor: bool | tuple[bool, ...] = False
) -> list[HFResult]:
    """`train_hf` of each name; `inductor`: one flag for all, or one per name."""
    flags = inductor if isinstance(inductor, tuple) else (inductor,) * len(names)
    return [train_hf(rank, world, name, inductor=flag) for name, flag in zip(names, flags, strict=True)]
