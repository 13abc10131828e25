"""The default wrap gives an LLM's input embedding and output head units of their own (tied weights stay one
piece in the root) and leaves models without such pieces as they were."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fsdp_graph
from fsdp_graph.api.wrap import auto_wrap_policy
from fsdp_graph.runtime.unit import flat_params
from fsdp_graph.train.llama import Llama, llama_loss, preset
from tests.graphs.capture import TwoBlock
from tests.workers.edge_units import all_gather_bytes, padded_bytes
from tests.workers.hf_models import build_hf
from tests.workers.models import GPT, BNNet, ConvNet, GPTConfig, OddMLP, SharedBlockNet


def _policy_units(model: nn.Module) -> list[str]:
    fqn = {id(m): name for name, m in model.named_modules()}
    return sorted(fqn[id(m)] for m in auto_wrap_policy(model))


def _owners(model: nn.Module) -> dict[str, list[str]]:
    """Unit name -> the parameter FQNs its flat parameter holds (a tied weight lists all its names)."""
    return {s.name: [name for slot in s.layout.slots for name in slot.fqns] for s in flat_params(model)}


def test_project_llama_untied_gets_embedding_and_head_units(fake_pg):
    model = fsdp_graph.fully_shard(Llama(preset("tiny", tied=False)))
    owners = _owners(model)
    assert owners["tok_embeddings"] == ["tok_embeddings.weight"]
    assert owners["output"] == ["output.weight"]
    assert owners[""] == ["norm.weight"]  # the final norm, a vector, stays in the root
    assert sorted(owners) == ["", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "output", "tok_embeddings"]


def test_hf_llama_gets_embedding_and_head_units(fake_pg):
    model = fsdp_graph.fully_shard(build_hf("llama"))
    owners = _owners(model)
    assert owners["model.embed_tokens"] == ["model.embed_tokens.weight"]
    assert owners["lm_head"] == ["lm_head.weight"]
    assert owners[""] == ["model.norm.weight"]


@pytest.mark.parametrize("build", [lambda: Llama(preset("tiny")), lambda: GPT(GPTConfig())], ids=["llama", "gpt"])
def test_tied_embedding_and_head_stay_one_piece_in_the_root(fake_pg, build):
    model = build()
    assert all(name.startswith("blocks.") for name in _policy_units(model))
    sharded = fsdp_graph.fully_shard(model)
    owners = _owners(sharded)
    tied = [names for names in owners.values() if any("emb" in n or n.startswith("tok.") for n in names)]
    assert len(tied) == 1 and tied == [owners[""]], owners  # one owner, the root, listing both names
    assert sum(len(names) for names in owners.values()) == len({n for names in owners.values() for n in names})
    assert any("output.weight" in n or "head.weight" in n for n in owners[""]), owners


def test_hf_gpt2_tied_weight_in_root_position_embedding_apart(fake_pg):
    model = fsdp_graph.fully_shard(build_hf("gpt2"))
    owners = _owners(model)
    assert owners["transformer.wpe"] == ["transformer.wpe.weight"]
    assert "transformer.wte.weight" in owners[""] and "lm_head.weight" in owners[""], owners


def test_models_without_edge_pieces_keep_their_units():
    assert _policy_units(TwoBlock()) == ["blocks.0", "blocks.1"]  # one piece beside the blocks: stays in the root
    assert _policy_units(ConvNet()) == ["features.0", "features.1"]
    assert _policy_units(OddMLP()) == ["layers.0", "layers.1", "layers.2"]
    assert _policy_units(BNNet()) == []  # no block list: the root alone
    assert _policy_units(SharedBlockNet()) == []


class NormsAround(nn.Module):
    """Vector-only modules (norms) beside the blocks never become units: too small for a collective each."""

    def __init__(self):
        super().__init__()
        self.pre = nn.LayerNorm(4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.post = nn.LayerNorm(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = self.pre(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.post(x))


def test_vector_only_modules_stay_in_the_root():
    assert _policy_units(NormsAround()) == ["blocks.0", "blocks.1"]


@pytest.mark.parametrize("which", ["project", "hf"])
def test_largest_gather_is_at_most_the_largest_piece(fake_pg, which):
    # A vocabulary large enough that the embedding and the head are each larger than a block (as in real LLMs):
    # gathered together (the old default) they would be the largest gather of the step.
    vocab = 2048
    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (2, 16))
    if which == "hf":
        model = build_hf("llama", vocab=vocab)
        pieces = [model.model.embed_tokens, model.lm_head, *model.model.layers]
        args, kwargs, loss_fn = (), {"input_ids": ids, "labels": ids}, None
    else:
        model = Llama(preset("tiny", tied=False, vocab=vocab))
        pieces = [model.tok_embeddings, model.output, *model.blocks]
        args, kwargs = (ids,), {}

        def loss_fn(logits):
            return llama_loss(lambda _: logits, (ids, ids))

    sizes = [padded_bytes(m, fake_pg.size()) for m in pieces]
    assert sizes[0] + sizes[1] > max(sizes)
    fsdp_graph.fully_shard(model)
    # explain keeps a copy of each lowered graph (a Hugging Face Llama's has constant tensors: copied by reference).
    report = fsdp_graph.explain(model, *args, loss_fn=loss_fn, example_kwargs=kwargs)
    gathers = [size for graph in report.graphs for size in all_gather_bytes(graph.graph)]
    assert gathers and max(gathers) <= max(sizes), (gathers, sizes)


def test_torchtitan_moduledict_layers_get_a_unit_each(fake_pg):
    # torchtitan keeps its layers in a ModuleDict: the automatic wrap finds them as it finds a ModuleList.
    from tests.workers import titan

    if (why := titan.available()) is not None:
        pytest.skip(why)
    model = fsdp_graph.fully_shard(titan.build())
    owners = _owners(model)
    layers = [f"layers.{name}" for name in model.layers]
    assert sorted(owners) == sorted(["", "tok_embeddings", "lm_head", *layers]), sorted(owners)
    assert owners[""] == ["norm.weight"]
