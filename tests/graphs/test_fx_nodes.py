"""`passes.fx_nodes`: the helpers every pass reads and writes nodes with (argument binding, bytes, aliasing, emission)."""

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fsdp_graph.ir import ALL_GATHER, UNSHARD, WAIT
from passes import check_collectives
from passes.fx_nodes import (
    NodeEmitter,
    alias_source,
    bind_args,
    collective_group,
    finish,
    node_bytes,
    value_bytes,
    written_args,
)

_aten, _prims = torch.ops.aten, torch.ops.prims


class _Builder:
    """A graph of placeholders with fake values; `op` appends a node whose fake value is the op run on its inputs'."""

    def __init__(self, **inputs: torch.Tensor):
        self.mode = FakeTensorMode()
        self.graph = fx.Graph()
        self.inputs = {}
        for name, tensor in inputs.items():
            node = self.graph.placeholder(name)
            node.meta["val"] = self.mode.from_tensor(tensor)
            self.inputs[name] = node
        self.out = self.graph.output(None)
        self.emit = NodeEmitter(self.graph, {"fsdp_role": "test"}, before=self.out)

    def op(self, target, *args, **kwargs) -> fx.Node:
        with self.mode:
            return self.emit(target, args, kwargs)


def test_alias_source_views_and_reshape_of_contiguous():
    b = _Builder(x=torch.zeros(4, 6))
    x = b.inputs["x"]
    assert alias_source(b.op(_aten.view.default, x, [24])) is x
    assert alias_source(b.op(_aten.slice.Tensor, x, 1, 0, 3)) is x
    assert alias_source(b.op(_aten._unsafe_view.default, x, [6, 4])) is x
    assert alias_source(b.op(_aten.reshape.default, x, [24])) is x
    transposed = b.op(_aten.t.default, x)
    assert alias_source(transposed) is x
    # A reshape of a non-contiguous tensor may copy: it allocates as far as liveness is concerned.
    assert alias_source(b.op(_aten.reshape.default, transposed, [24])) is None
    assert alias_source(b.op(_aten.clone.default, x)) is None
    assert alias_source(b.op(_aten.add.Tensor, x, 1)) is None


def test_alias_source_device_put():
    b = _Builder(x=torch.zeros(8))
    x = b.inputs["x"]
    # Same device: the kernel is `Tensor.to`, which hands back the input itself.
    same = b.op(_prims.device_put.default, x, torch.device("cpu"), True)
    assert alias_source(same) is x
    real = torch.zeros(8)
    assert torch.ops.prims.device_put.default(real, torch.device("cpu")).data_ptr() == real.data_ptr()
    # Another device: a new tensor there.
    assert alias_source(b.op(_prims.device_put.default, x, torch.device("meta"))) is None


def test_alias_source_in_place_and_out_ops_alias_what_they_mutate():
    b = _Builder(x=torch.zeros(8), y=torch.zeros(8), out=torch.zeros(8))
    x, y, out = b.inputs["x"], b.inputs["y"], b.inputs["out"]
    assert alias_source(b.op(_aten.add_.Tensor, x, y)) is x
    assert alias_source(b.op(_aten.add.out, x, y, out=out)) is out
    assert [n.name for n in written_args(b.op(_aten.mul_.Tensor, y, 2))] == ["y"]
    assert [n.name for n in written_args(b.op(_aten.add.out, x, y, out=out))] == ["out"]
    assert written_args(b.op(_aten.mul.Tensor, y, 2)) == []


def test_alias_source_wait_and_non_ops():
    b = _Builder(shard=torch.zeros(8))
    issue = b.graph.call_function(ALL_GATHER, (b.inputs["shard"], 2, "g"))
    wait = b.graph.call_function(WAIT, (issue,))
    assert alias_source(wait) is issue
    assert alias_source(b.inputs["shard"]) is None
    assert alias_source(b.graph.call_function(lambda t: t, (wait,))) is None


def test_check_collectives_follows_every_alias():
    """A write through an `_unsafe_view` (not a view op by its schema) of a buffer in flight is caught."""

    def build(graph: fx.Graph) -> fx.GraphModule:
        shard = graph.placeholder("shard")
        issue = graph.call_function(ALL_GATHER, (shard, 2, "g"))
        alias = graph.call_function(_aten._unsafe_view.default, (shard, [8]))
        graph.call_function(_aten.mul_.Tensor, (alias, 2))
        graph.output(graph.call_function(WAIT, (issue,)))
        return fx.GraphModule(torch.nn.Module(), graph)

    with pytest.raises(RuntimeError, match="mul__tensor writes to a buffer of all_gather_into_tensor_default"):
        check_collectives(build(fx.Graph()))


def test_bind_args_names_positional_keyword_and_default_arguments():
    graph = fx.Graph()
    shard = graph.placeholder("shard")
    node = graph.call_function(UNSHARD, (shard, "blocks.0", "g", 4), {"compute_device": torch.device("cpu")})
    bound = bind_args(node)
    assert bound["shard"] is shard
    assert (bound["unit"], bound["group"], bound["world"]) == ("blocks.0", "g", 4)
    assert bound["compute_device"] == torch.device("cpu")
    assert (bound["dtype"], bound["reshard_after_forward"], bound["replicate_world"]) == (None, True, 1)
    # Dynamo graphs call the packet; a single-overload packet binds like its overload.
    packet = graph.call_function(torch.ops.fsdp.unshard, (shard, "u", "g", 2, None, None, False))
    assert bind_args(packet)["reshard_after_forward"] is False
    gather = graph.call_function(ALL_GATHER, (shard,), {"group_size": 2, "group_name": "dp"})
    assert collective_group(gather) == "dp"
    assert collective_group(graph.call_function(ALL_GATHER, (shard, 2, "tp"))) == "tp"
    assert collective_group(node) is None


def test_bind_args_refuses_what_it_cannot_bind():
    graph = fx.Graph()
    shard = graph.placeholder("shard")
    with pytest.raises(TypeError, match="leaves out fsdp::unshard's argument 'world'"):
        bind_args(graph.call_function(UNSHARD, (shard, "u", "g")))
    with pytest.raises(TypeError, match="does not call an op with a schema"):
        bind_args(graph.call_function(len, (shard,)))


def test_bytes_of_tensors_tuples_and_symbolic_sizes():
    b = _Builder(x=torch.zeros(3, 4))
    x = b.inputs["x"]
    assert node_bytes(x) == 48
    assert node_bytes(b.op(_prims.convert_element_type.default, x, torch.bfloat16)) == 24
    assert node_bytes(b.op(_aten.split.Tensor, x, 2)) == 48  # a tuple: every piece
    assert value_bytes(None) == value_bytes(3) == 0
    assert node_bytes(b.graph.call_function(len, (x,))) == 0  # no fake value

    gm = make_fx(lambda t: t.view(-1), tracing_mode="symbolic")(torch.zeros(5, 2))
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert isinstance(placeholder.meta["val"].numel(), torch.SymInt)
    assert node_bytes(placeholder) == 40  # at the traced size

    # an unbacked size (an all-to-all's data-dependent split sizes, `.tolist()`): Inductor's fallback hint, 1 row
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        rows = mode.shape_env.create_unbacked_symint()
        torch._check(rows >= 0)
        routed = b.graph.placeholder("routed")
        routed.meta["val"] = torch.empty(rows, 4)
    assert not rows.node.has_hint()
    assert node_bytes(routed) == 16


def test_node_emitter_fake_values_and_meta():
    b = _Builder(x=torch.zeros(4))
    x = b.inputs["x"]
    inferred = b.op(_aten.mul.Tensor, x, 2)
    assert inferred.meta["fsdp_role"] == "test" and inferred.meta["val"].shape == (4,)
    given = b.emit(_aten.mul.Tensor, (x, 2), val=torch.empty(7, device="meta"))
    assert given.meta["val"].shape == (7,)
    unknown = b.emit(_aten.mul.Tensor, (x, 2), val=None)
    assert "val" not in unknown.meta
    first = b.emit(_aten.neg.default, (x,), before=inferred)
    assert list(b.graph.nodes).index(first) < list(b.graph.nodes).index(inferred)
    with pytest.raises(ValueError, match="no node to insert"):
        NodeEmitter(b.graph, {})(_aten.neg.default, (x,), val=None)


def test_finish_lints_a_changed_graph_only():
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(_aten.neg.default, (x,))
    graph.output(y)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    y.prepend(graph.call_function(_aten.neg.default, (y,)))  # uses y before y is defined
    assert finish(gm, changed=False) is gm
    with pytest.raises(RuntimeError, match="used before it has been defined"):
        finish(gm, changed=True)
