"""`reshard_after_forward=k` (an int): the two-step gather's graphs on fake process groups, and bad values."""

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline
from torch.distributed.device_mesh import init_device_mesh

import fsdp_graph
from fsdp_graph.ir import ALL_GATHER, UNSHARD_SIGNATURE, WAIT
from fsdp_graph.runtime.unit import _STATIC_FIELDS, _unshard_values, flat_params
from passes.fx_nodes import collective_group
from tests.graphs.capture import TwoBlock
from tests.workers.models import GPT, GPTConfig


def _ranks(name: str) -> list[int]:
    return dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(name))


def _compile(model, *inputs, **backend_options):
    torch._dynamo.reset()
    backend = fsdp_graph.make_backend(inductor=False, keep_graphs=True, **backend_options)
    torch.compile(model, backend=backend, fullgraph=True)(*inputs).sum().backward()
    assert backend.dynamo_graphs == 1
    return {r.stage: r for r in backend.reports}


def _lines(report) -> str:
    """The collective fingerprint with each group shown as its ranks (group names are creation counters)."""
    lines = []
    for line in report.fingerprint:
        for name in report.groups:
            line = line.replace(f"group={name},", f"ranks={_ranks(name)},")
        lines.append(line)
    return "\n".join(lines)


_aten = torch.ops.aten
_VIEWS_AND_COPIES = (
    _aten.view.default,
    _aten.permute.default,
    _aten.clone.default,
    _aten.slice.Tensor,
    _aten.t.default,
)


def _saved_gathers(fw_graph) -> list[tuple[list[int], int]]:
    """(group ranks, numel) of the gather behind every tensor the forward saves for the backward that is a gather,
    or a view or copy of one (a parameter read from the rank-ordered flat would show as the node group's)."""
    output = next(n for n in fw_graph.graph.nodes if n.op == "output")
    saved = []
    for node in output.args[0]:
        while isinstance(node, torch.fx.Node) and node.target in _VIEWS_AND_COPIES:
            node = node.args[0]
        if isinstance(node, torch.fx.Node) and node.target is WAIT and node.args[0].target is ALL_GATHER:
            saved.append((_ranks(collective_group(node.args[0])), node.meta["val"].numel()))
    return saved


def test_int_gathers_a_piece_saves_it_and_regathers_within_the_node(fake_pg):
    """World 4, k=2, rank 0: node groups {0,1} {2,3}, piece groups {0,2} {1,3}. The forward gathers the piece over
    [0, 2], then the pieces over [0, 1]; it saves only the 1/2 pieces; the backward gathers them over [0, 1] and
    reduce-scatters over all 4 ranks. blocks.0 is not re-gathered (its input needs no gradient). The flat layout
    (its sizes are the unit's, padded by under one element per rank); the default rows layout is the next test."""
    torch.manual_seed(0)
    # without shared block bodies (the default since issue 25): this checks each block's own nodes
    model = fsdp_graph.fully_shard(TwoBlock(), reshard_after_forward=2, layout="flat", reuse_blocks=False)
    states = flat_params(model)
    assert [(s.world, s.post_forward_world, s.reshard_after_forward) for s in states] == [(4, 2, True)] * 3
    assert {(tuple(_ranks(s.piece_group)), tuple(_ranks(s.post_forward_group))) for s in states} == {((0, 2), (0, 1))}
    reports = _compile(model, torch.randn(2, 4))
    assert_expected_inline(
        _lines(reports["fw"]),
        """\
all_gather_into_tensor(ranks=[0, 2], group_size=2, 5 x float32 -> 10 x float32)
all_gather_into_tensor(ranks=[0, 1], group_size=2, 10 x float32 -> 20 x float32)
all_gather_into_tensor(ranks=[0, 2], group_size=2, 5 x float32 -> 10 x float32)
all_gather_into_tensor(ranks=[0, 1], group_size=2, 10 x float32 -> 20 x float32)
all_gather_into_tensor(ranks=[0, 2], group_size=2, 2 x float32 -> 4 x float32)
all_gather_into_tensor(ranks=[0, 1], group_size=2, 4 x float32 -> 8 x float32)""",
    )
    assert_expected_inline(
        _lines(reports["bw"]),
        """\
all_gather_into_tensor(ranks=[0, 1], group_size=2, 4 x float32 -> 8 x float32)
all_gather_into_tensor(ranks=[0, 1], group_size=2, 10 x float32 -> 20 x float32)
reduce_scatter_tensor(ranks=[0, 1, 2, 3], reduce_op=sum, group_size=4, 8 x float32 -> 2 x float32)
reduce_scatter_tensor(ranks=[0, 1, 2, 3], reduce_op=sum, group_size=4, 20 x float32 -> 5 x float32)
reduce_scatter_tensor(ranks=[0, 1, 2, 3], reduce_op=sum, group_size=4, 20 x float32 -> 5 x float32)""",
    )
    padded = {s.name: s.layout.padded_numel for s in states}
    assert sorted(_saved_gathers(reports["fw"].graph)) == sorted(
        [([0, 2], padded["blocks.1"] // 2), ([0, 2], padded[""] // 2)]
    )
    assert "permute" in reports["fw"].code and "permute" in reports["bw"].code  # rank order before the views


def test_fast_path_arguments_carry_the_post_forward_fields(fake_pg):
    """Dynamo reads `static_unshard_args` (one precomputed tuple) instead of the fields: every op argument that is a
    fact of the flat parameter must be in it, and it must follow the fields when they are set (fully_shard sets the
    post-forward ones after building the state)."""
    per_step = {"shard", "sync", "unsynced", "all_reduce", "partial", "gathered"}
    assert set(UNSHARD_SIGNATURE.names) - per_step == set(_STATIC_FIELDS)
    model = fsdp_graph.fully_shard(TwoBlock(), reshard_after_forward={"blocks.1": 2})
    states = {s.name: s for s in flat_params(model)}
    for state in states.values():
        slow = UNSHARD_SIGNATURE.call_args(_unshard_values(state.flat_shard.detach(), state))[1:]
        assert state.static_unshard_args == slow, state.name
    by_node, whole = states["blocks.1"], states["blocks.0"]
    bound = UNSHARD_SIGNATURE.bind((None, *by_node.static_unshard_args), {})
    assert (bound.post_forward_world, bound.post_forward_group, bound.piece_group) == (
        2,
        by_node.post_forward_group,
        by_node.piece_group,
    )
    assert len(whole.static_unshard_args) < UNSHARD_SIGNATURE.names.index("post_forward_world")
    by_node.post_forward_world, by_node.post_forward_group, by_node.piece_group = 1, "", ""
    assert by_node.static_unshard_args[1:] == whole.static_unshard_args[1:]  # all but the unit's name


def test_plain_gather_follows_the_per_step_switches(fake_pg):
    """A compiled read calls the op on `static_unshard_args` alone while `plain_gather` holds (the property's fast
    path): it must turn off under each switch that gives the op a per-step argument or keeps the gather, and on
    again when the switch is undone."""
    model = fsdp_graph.fully_shard(TwoBlock())
    states = flat_params(model)
    assert all(s.plain_gather for s in states)
    fsdp_graph.set_requires_gradient_sync(model, False)  # no_sync's accumulator leaves
    assert not any(s.plain_gather for s in states)
    fsdp_graph.set_requires_gradient_sync(model, True)
    assert not any(s.plain_gather for s in states)  # the leaves stay, their pending gradient goes in next
    for s in states:
        s.unsynced = None
    assert all(s.plain_gather for s in states)
    model.set_reshard_after_backward(False)  # the gather is kept (world 4)
    assert not any(s.plain_gather for s in states)
    model.set_reshard_after_backward(True)
    assert all(s.plain_gather for s in states)
    states[0].partial = torch.zeros(1)  # set_requires_all_reduce(False)'s leaf (HYBRID_SHARD)
    assert [s.plain_gather for s in states] == [False] + [True] * (len(states) - 1)
    states[0].partial = None
    assert all(s.plain_gather for s in states)


def test_int_with_the_rows_layout_reorders_before_the_copy_out(fake_pg):
    torch.manual_seed(0)
    model = fsdp_graph.fully_shard(TwoBlock(8), reshard_after_forward=2)  # the default layout, rows
    reports = _compile(model, torch.randn(2, 8, requires_grad=True))
    assert reports["fw"].collectives.counts == {"all_gather": 6}
    assert reports["bw"].collectives.counts == {"all_gather": 3, "reduce_scatter": 3}
    padded = sorted(s.layout.padded_numel // 2 for s in flat_params(model))
    assert sorted(n for _, n in _saved_gathers(reports["fw"].graph)) == padded


def test_int_per_unit_and_normalised_values(fake_pg):
    torch.manual_seed(0)
    model = fsdp_graph.fully_shard(TwoBlock(), reshard_after_forward={"blocks.1": 2, "": 4, "blocks.0": 1})
    worlds = {s.name: (s.reshard_after_forward, s.post_forward_world) for s in flat_params(model)}
    assert worlds == {"blocks.0": (False, 1), "blocks.1": (True, 2), "": (True, 1)}
    reports = _compile(model, torch.randn(2, 4, requires_grad=True))
    assert reports["fw"].collectives.counts == {"all_gather": 4}
    assert [u for k, u in reports["bw"].collectives.units if k == "all_gather"] == ["", "blocks.1"]
    model = fsdp_graph.fully_shard(TwoBlock(), reshard_after_forward=1)
    assert {(s.reshard_after_forward, s.post_forward_world) for s in flat_params(model)} == {(False, 1)}


def test_int_overrides_shard_grad_ops_default(fake_pg):
    """SHARD_GRAD_OP keeps the gathered parameters by default; an int reshards them to pieces as under FULL_SHARD."""
    torch.manual_seed(0)
    model = fsdp_graph.fully_shard(
        TwoBlock(), strategy=fsdp_graph.ShardingStrategy.SHARD_GRAD_OP, reshard_after_forward=2
    )
    assert {(s.reshard_after_forward, s.post_forward_world) for s in flat_params(model)} == {(True, 2)}
    reports = _compile(model, torch.randn(2, 4, requires_grad=True))
    assert reports["fw"].collectives.counts == {"all_gather": 6}
    assert {tuple(r) for r, _ in _saved_gathers(reports["fw"].graph)} == {(0, 2)}
    bw = _lines(reports["bw"])
    assert bw.count("all_gather_into_tensor(ranks=[0, 1],") == 3 and "ranks=[0, 2]" not in bw, bw


def test_int_hybrid_shards_within_the_shard_dimension(fake_world_8):
    """HYBRID_SHARD on a (2, 4) mesh, k=2, rank 5: shard group [4..7], node [4, 5], piece [5, 7], replicas [1, 5]."""
    mesh = init_device_mesh("cpu", (2, 4))
    torch.manual_seed(0)
    model = TwoBlock()
    fsdp_graph.fully_shard(model, mesh, strategy=fsdp_graph.ShardingStrategy.HYBRID_SHARD, reshard_after_forward=2)
    state = flat_params(model)[0]
    assert [_ranks(g) for g in (state.group_name, state.post_forward_group, state.piece_group)] == [
        [4, 5, 6, 7],
        [4, 5],
        [5, 7],
    ]
    assert _ranks(state.replicate_group) == [1, 5]
    reports = _compile(model, torch.randn(2, 4))
    bw = _lines(reports["bw"])
    assert "all_gather_into_tensor(ranks=[4, 5]," in bw and "ranks=[5, 7]" not in bw, bw
    assert "reduce_scatter_tensor(ranks=[4, 5, 6, 7]," in bw and "all_reduce(ranks=[1, 5]," in bw, bw


def test_explain_counts_the_gathers_on_their_groups(fake_world_8):
    """World 8, k=2: the piece gather runs over 4 ranks, the node gather over 2; explain's plan counts three
    gathers per re-gathered unit and step, and the backward's node-group gathers cost less than world-wide ones."""

    def plan(reshard):
        torch.manual_seed(0)
        model = GPT(GPTConfig())
        fsdp_graph.fully_shard(model, reshard_after_forward=reshard)
        idx = torch.randint(0, 96, (4, 16))
        loss = lambda logits: -logits.log_softmax(-1).gather(-1, idx.unsqueeze(-1)).mean()  # noqa: E731
        return model, fsdp_graph.explain(model, idx, loss_fn=loss, hardware="infiniband")

    model, by_node = plan(2)
    _, whole = plan(True)
    state = flat_params(model)[0]
    assert by_node.group_sizes[state.post_forward_group] == 2 and by_node.group_sizes[state.piece_group] == 4
    for row_k, row_all in zip(by_node.units, whole.units):
        assert row_k.gathers == row_all.gathers + 1 and row_k.reduce_scatters == row_all.reduce_scatters == 1
    assert by_node.backward.comm_time < whole.backward.comm_time


@pytest.mark.parametrize(
    "value, error, match",
    [
        (3, ValueError, r"reshard_after_forward=3 must divide the shard group's 4 ranks: one of \[1, 2, 4\]"),
        (0, ValueError, r"reshard_after_forward=0 must divide"),
        (-2, ValueError, r"reshard_after_forward=-2 must divide"),
        (8, ValueError, r"reshard_after_forward=8 must divide the shard group's 4 ranks"),
        (2.0, TypeError, r"reshard_after_forward must be None, a bool, an int or a mapping"),
        ({"blocks.0": 3}, ValueError, r"reshard_after_forward\['blocks.0'\]=3 must divide"),
        ({"blocks.0": "2"}, TypeError, r"reshard_after_forward\['blocks.0'\] must be a bool or an int, got '2'"),
    ],
)
def test_bad_int_values_are_refused(fake_pg, value, error, match):
    with pytest.raises(error, match=match):
        fsdp_graph.fully_shard(TwoBlock(), reshard_after_forward=value)


def test_no_shard_refuses_an_int(fake_pg):
    with pytest.raises(ValueError, match="NO_SHARD has nothing to reshard"):
        fsdp_graph.fully_shard(TwoBlock(), strategy=fsdp_graph.ShardingStrategy.NO_SHARD, reshard_after_forward=2)


def test_int_groups_are_made_once_by_their_members_and_move_no_world_counter(fake_pg, monkeypatch):
    """Issue 27 item 7: each call made 2k world-wide groups anew (a leak), and a world-wide `new_group` advances
    torch's counter that names the next one, so pipeline stages with different settings would name later groups
    differently and hang. Now: this rank's two groups, once, and the counter moves as for `True`."""
    made = []
    real_new_group = dist.new_group

    def new_group(*args, **kwargs):
        made.append(kwargs.get("use_local_synchronization", False))
        return real_new_group(*args, **kwargs)

    monkeypatch.setattr(dist, "new_group", new_group)
    world = dist.distributed_c10d._world

    def counter_moves(reshard) -> int:
        before = world.group_count
        fsdp_graph.fully_shard(TwoBlock(), reshard_after_forward=reshard)
        return world.group_count - before

    assert counter_moves(True) == 0 and made == []
    assert counter_moves(2) == 0 and made == [True, True]  # the piece and node group of rank 0, members only
    state = flat_params(fsdp_graph.fully_shard(TwoBlock(), reshard_after_forward=2))[0]
    assert made == [True, True]  # reused
    assert (_ranks(state.piece_group), _ranks(state.post_forward_group)) == ([0, 2], [0, 1])
