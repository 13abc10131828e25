"""`fully_shard(reuse_blocks=True)` (issue 15): one block body for every block of the same structure, the gathers
and reductions outside it (fake process group, world 4)."""

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import fsdp_graph
from fsdp_graph.ir import ALL_GATHER, UNSHARD_TARGETS
from fsdp_graph.train.llama import Llama, LlamaConfig, llama_loss
from tests.workers.block_reuse import body_calls

CFG = LlamaConfig(dim=32, layers=4, heads=4, kv_heads=2, hidden=48, seq=16, vocab=64)


def _compiled(model: nn.Module) -> tuple[nn.Module, list[torch.fx.GraphModule], object]:
    """`model` compiled with eager kernels, the Dynamo graphs it compiles (appended as they come) and the backend."""
    torch._dynamo.reset()  # each model compiles from scratch (no recompile limit across the tests' models)
    backend = fsdp_graph.make_backend(inductor=False, keep_graphs=True)
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return backend(gm, example_inputs)

    return torch.compile(model, backend=capture, fullgraph=True), graphs, backend


def _compile_step(model: nn.Module, loss_fn, *inputs) -> tuple[list[torch.fx.GraphModule], object]:
    compiled, graphs, backend = _compiled(model)
    loss_fn(compiled, *inputs).backward()
    return graphs, backend


def _targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_llama_blocks_share_one_body(fake_pg, monkeypatch):
    """4 blocks: one Dynamo graph calling `subgraph_0` 4 times; every gather is in the outer graph (none in the
    body); the lowered forward issues block k+1's gather before block k's body runs, and the backward re-gathers
    every block (reshard after forward) as many times as without reuse.

    One schema per body while compiling: torch's autograd rule for `invoke_subgraph` asks for the body's schema at
    every call (a re-trace of the body); our backend computes it once per body (`compiler.region_schema`), so
    compile time does not grow with it. Each block after the first is stamped out with the body's one output:
    Dynamo adds every intermediate of a body with a Python side effect to its outputs, and each costs a fake tensor
    and a node per block (`block_region._set_region_flats`). (Checked on this test's compile, not one of its own.)"""
    import importlib.util

    from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP

    computed, stamped = [], []
    compute = InvokeSubgraphHOP.gen_schema
    monkeypatch.setattr(InvokeSubgraphHOP, "gen_schema", lambda self, *a: computed.append(a[1]) or compute(self, *a))
    stamp = None  # torch 2.13's; 2.11 traces every block
    if importlib.util.find_spec("torch._dynamo.variables.invoke_subgraph") is not None:
        from torch._dynamo.variables import invoke_subgraph as dynamo_invoke_subgraph

        stamp = getattr(dynamo_invoke_subgraph, "stamp_out_subgraph", None)
    if stamp is not None:

        def stamp_out(tx, fingerprint, cached):
            stamped.append(len(cached.output_metadata))
            return stamp(tx, fingerprint, cached)

        monkeypatch.setattr(dynamo_invoke_subgraph, "stamp_out_subgraph", stamp_out)
    torch.manual_seed(0)
    tokens = torch.randint(0, CFG.vocab, (2, CFG.seq + 1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    graphs, backend = _compile_step(fsdp_graph.fully_shard(Llama(CFG), reuse_blocks=True), llama_loss, batch)
    assert computed and len(computed) == len(set(computed)), computed  # once per body (forward and backward's)
    assert stamped == ([1] * (CFG.layers - 1) if stamp is not None else []), stamped
    assert len(graphs) == 1
    (gm,) = graphs
    assert body_calls(gm) == ["subgraph_0"] * CFG.layers
    # after the backend's dedup pass: one gather per block and one for the root (the tied embedding and head)
    assert sum(t in UNSHARD_TARGETS for t in _targets(gm)) == CFG.layers + 1
    assert not any(t in UNSHARD_TARGETS for t in _targets(gm.subgraph_0))
    outer = {r.stage: r for r in backend.reports if "invoke_subgraph" in r.code}
    fw = outer["fw"].graph
    calls = [n for n in fw.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert len({str(n.args[1]) for n in calls}) == 1  # one compiled body, called once per block
    order = {n: i for i, n in enumerate(fw.graph.nodes)}
    gathers = [n for n in fw.graph.nodes if n.target is ALL_GATHER]
    for call in calls[:-1]:  # prefetch: some gather is issued between this body and the one before it
        assert any(order[g] < order[call] and g not in call.all_input_nodes for g in gathers)
    graphs_plain, plain = _compile_step(fsdp_graph.fully_shard(Llama(CFG)), llama_loss, batch)
    counts = {r.stage: r.collectives.to_text() for r in plain.reports}
    assert {stage: r.collectives.to_text() for stage, r in outer.items()} == counts
    assert counts["bw"].startswith(f"all_gather: {CFG.layers + 1} ")  # every block and the embedding re-gathered


# Options combined two by two (each pair on one compile): flat layout with a 1/2 piece kept after forward (and a
# `no_sync` step first), bf16 gathers with the gathers kept for backward.
@pytest.mark.parametrize(
    "options, no_sync_first",
    [
        ({"layout": "flat", "reshard_after_forward": 2}, True),
        (
            {
                "mixed_precision": fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                "reshard_after_forward": False,
            },
            False,
        ),
    ],
    ids=["flat_reshard_2_no_sync", "bf16_no_reshard"],
)
def test_other_options_keep_their_collectives(fake_pg, options, no_sync_first):
    """With the flat layout, bf16 gathers, gathers kept for backward or a 1/2 piece kept: one body for the 3 blocks,
    and the collectives of the same model without `reuse_blocks` (graphs only; numerics untested).

    With `no_sync_first` (was test_no_sync_then_sync): a `no_sync` step then a synchronising one (two graphs,
    gathers with accumulator arguments), each graph calling one body per block; the first reduces nothing."""
    cfg = LlamaConfig(dim=32, layers=3, heads=4, kv_heads=2, hidden=48, seq=16, vocab=64)
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq + 1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    collectives = []
    for reuse in (False, True):
        torch.manual_seed(0)
        model = fsdp_graph.fully_shard(Llama(cfg), reuse_blocks=reuse, **options)
        compiled, graphs, backend = _compiled(model)
        if no_sync_first:
            with fsdp_graph.no_sync(model):
                llama_loss(compiled, batch).backward()
        llama_loss(compiled, batch).backward()
        steps = 2 if no_sync_first else 1
        assert [body_calls(gm) for gm in graphs] == [["subgraph_0"] * cfg.layers if reuse else []] * steps
        collectives.append([(r.stage, r.collectives.to_text()) for r in backend.reports])
    assert collectives[0] == collectives[1]
    if no_sync_first:
        assert "reduce_scatter" not in collectives[0][1][1] and "reduce_scatter" in collectives[0][3][1]


# test_no_sync_then_sync: merged into test_other_options_keep_their_collectives[flat_reshard_2_no_sync].


class Block(nn.Module):
    def __init__(self, hidden: int, scale: float = 1.0):
        super().__init__()
        self.up, self.down, self.scale = nn.Linear(4, hidden), nn.Linear(hidden, 4), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * self.down(torch.relu(self.up(x)))


class Mixed(nn.Module):
    """Blocks of three structures: hidden 8 (twice), hidden 6 (twice), hidden 8 with another plain attribute."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(8), Block(6), Block(8), Block(6), Block(8, scale=0.5)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_blocks_of_another_structure_get_their_own_body(fake_pg):
    """A body is shared only by blocks with equal parameter layouts and plain attributes."""
    torch.manual_seed(0)
    model = fsdp_graph.fully_shard(Mixed(), reuse_blocks=True)
    (gm,), _ = _compile_step(model, lambda m, x: m(x).sum(), torch.randn(3, 4))
    # The block of its own structure (scale 0.5) gets a body of its own, used once, which Dynamo inlines
    # (`torch._dynamo.config.inline_single_use_invoke_subgraph`); with the others' key it would be a third call.
    calls = body_calls(gm)
    assert calls == [calls[0], calls[1]] * 2 and calls[0] != calls[1]


class CheckpointedBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().forward, x, use_reentrant=False)


def test_activation_checkpoint_inside_the_body(fake_pg):
    """Blocks whose forward is an activation checkpoint: one body, the collectives of the model without reuse."""
    x = torch.randn(3, 4)
    collectives = []
    for reuse in (False, True):
        torch.manual_seed(0)
        model = Mixed()
        model.blocks = nn.ModuleList(CheckpointedBlock(8) for _ in range(3))
        (gm,), backend = _compile_step(fsdp_graph.fully_shard(model, reuse_blocks=reuse), lambda m, x: m(x).sum(), x)
        assert body_calls(gm) == (["subgraph_0"] * 3 if reuse else [])
        collectives.append([(r.stage, r.collectives.to_text()) for r in backend.reports])
    assert collectives[0] == collectives[1]
    assert collectives[0][1][1].startswith("all_gather: 3 ")  # re-gathered in backward


def test_refuses_a_unit_holding_another_unit(fake_pg):
    model = Mixed()
    with pytest.raises(ValueError, match="contains another unit"):
        fsdp_graph.fully_shard(model, wrap=[model.blocks[0], model.blocks[0].up], reuse_blocks=True)
    assert not fsdp_graph.runtime.unit.is_sharded(model)  # refused before anything changed


def test_refuses_weights_shared_between_units(fake_pg):
    model = Mixed()
    model.blocks[2].up.weight = model.blocks[0].up.weight  # owned by the root, read by two units
    with pytest.raises(ValueError, match="reads a parameter of unit ''"):
        fsdp_graph.fully_shard(model, reuse_blocks=True)


def test_by_default_refused_units_are_traced_alone_with_one_warning(fake_pg):
    """Issue 25: reuse is the default; where a unit cannot share a body (here two blocks read a weight the root
    owns) `fully_shard` warns once, naming why, and those units are traced on their own while the others still
    share one (blocks 1 and 3). `reuse_blocks=False`: no body, no warning."""
    for reuse in (None, False):
        model = Mixed()
        model.blocks[2].up.weight = model.blocks[0].up.weight
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fsdp_graph.fully_shard(model, **({} if reuse is None else {"reuse_blocks": reuse}))
        messages = [str(w.message) for w in caught if "reuse_blocks" in str(w.message)]
        (gm,), _ = _compile_step(model, lambda m, x: m(x).sum(), torch.randn(3, 4))
        if reuse is None:
            assert len(messages) == 1 and "reads a parameter of unit ''" in messages[0], messages
            assert "2 unit(s) traced on their own" in messages[0], messages
            assert body_calls(gm) == ["subgraph_0"] * 2
        else:
            assert messages == [] and body_calls(gm) == []


def test_units_holding_complex_tensors_share_bodies(fake_pg):
    """torchtitan's Llama3 keeps a complex RoPE cache in every layer: such units share a body like any other (no
    warning, `reuse_blocks=True` accepted), and Dynamo then keeps a body called once as a region
    (`block_region.keep_complex_bodies_exact`); a model without complex tensors leaves that setting alone."""
    import torch._dynamo.config as dynamo_config

    with dynamo_config.patch(inline_single_use_invoke_subgraph=True):  # the process's setting, restored after
        fsdp_graph.fully_shard(Mixed(), reuse_blocks=True)
        assert dynamo_config.inline_single_use_invoke_subgraph is True
        model = Mixed()
        for block in model.blocks:
            block.register_buffer("rope", torch.ones(4, dtype=torch.complex64))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fsdp_graph.fully_shard(model, reuse_blocks=True)
        assert all(fsdp_graph.runtime.block_key.BLOCK_KEY in block.__dict__ for block in model.blocks)
        assert dynamo_config.inline_single_use_invoke_subgraph is False


# test_one_schema_per_body_while_compiling: merged into test_llama_blocks_share_one_body (same compile).


def test_schema_cache_still_refuses_a_body_that_mutates_its_input():
    """The cache keeps torch's check: the first call computes the real schema (a trace of the body), so training
    through a body that writes its input fails as it does without the cache, with the same error."""
    from fsdp_graph.compiler.region_schema import cached_region_schemas

    @torch.compiler.nested_compile_region
    def scale_in_place(x):
        x.mul_(2)
        return x * 3

    def fn(x):
        return scale_in_place(x.clone()) + scale_in_place(x.clone())

    x = torch.randn(4, requires_grad=True)
    errors = []
    for context in (torch.enable_grad, cached_region_schemas):
        torch._dynamo.reset()
        with context(), pytest.raises(Exception, match="in-place operation") as raised:
            torch.compile(fn, backend="aot_eager", fullgraph=True)(x).sum().backward()
        errors.append(str(raised.value).splitlines()[1])
    assert errors[0] == errors[1]


def _aliasing_guards(layers: int) -> list[str]:
    """The object-aliasing guards (`a is b`, one Python lambda each, built at compile and run at every call) that
    compiling one step of a `layers`-block Llama installs, from Dynamo's guard log."""
    import logging
    from dataclasses import replace

    from fsdp_graph.train.llama import Llama

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.extend(line for line in record.getMessage().splitlines() if "LAMBDA_GUARD" in line and " is " in line)

    torch.manual_seed(0)
    model = fsdp_graph.fully_shard(Llama(replace(CFG, layers=layers)))
    logger, handler = logging.getLogger("torch._dynamo.guards"), Collect()
    torch._logging.set_logs(guards=True)
    logger.addHandler(handler)
    try:
        idx = torch.randint(0, CFG.vocab, (2, CFG.seq))
        _compile_step(model, llama_loss, (idx, idx))
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
    return lines


def test_units_reach_their_states_and_root_through_one_source(fake_pg):
    """A unit's hooks read its states and root from the module, as the gathers do, not from their closures: each
    object reached through two sources costs an aliasing guard per unit, built in Python at compile time (1.1-1.2 s of
    70B shapes' 80-layer compile against 0.5 s without them) and checked at every call. What is left is one per
    unit: the root read through each unit's state (`_compiled_gather`)."""
    two, four = _aliasing_guards(2), _aliasing_guards(4)
    assert not [g for g in four if "__closure__" in g or "__dict__['_fsdp_states']" in g], four
    assert len(four) - len(two) == 2, (two, four)
