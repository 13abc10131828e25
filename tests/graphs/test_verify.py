"""`passes.check_collectives`: each broken contract is named; a well-formed lowered graph passes."""

import pytest
import torch
import torch.fx as fx

from fsdp_graph.ir import ALL_GATHER, ALL_TO_ALL, WAIT
from passes import check_collectives

_aten = torch.ops.aten


def _graph(build) -> fx.GraphModule:
    graph = fx.Graph()
    shard = graph.placeholder("shard")
    graph.output(build(graph, shard))
    return fx.GraphModule(torch.nn.Module(), graph)


def _gather(graph: fx.Graph, shard: fx.Node, group: str = "g") -> fx.Node:
    return graph.call_function(ALL_GATHER, (shard, 2, group))


def test_well_formed_graph_passes():
    def build(graph, shard):
        issue = _gather(graph, shard)
        work = graph.call_function(_aten.mul.Tensor, (shard, 2))
        return graph.call_function(_aten.add.Tensor, (graph.call_function(WAIT, (issue,)), 1)), work

    check_collectives(_graph(build), {"g"})
    check_collectives(_graph(lambda graph, shard: graph.call_function(_aten.relu.default, (shard,))))


def test_read_before_wait():
    def build(graph, shard):
        issue = _gather(graph, shard)
        early = graph.call_function(_aten.add.Tensor, (issue, 1))
        return early, graph.call_function(WAIT, (issue,))

    with pytest.raises(RuntimeError, match="reads all_gather_into_tensor_default.s result without waiting"):
        check_collectives(_graph(build))


def test_size_reads_of_an_issue_are_not_data_reads():
    # torchtitan's token dispatch: an all-to-all of data-dependent size, whose output size the graph reads at once
    def build(graph, shard):
        issue = graph.call_function(ALL_TO_ALL, (shard, [1, 1], [1, 1], "g"))
        rows = graph.call_function(_aten.sym_size.int, (issue, 0))
        return graph.call_function(WAIT, (issue,)), rows

    check_collectives(_graph(build), {"g"})


def test_write_to_in_flight_input_through_a_view():
    def build(graph, shard):
        issue = _gather(graph, shard)
        view = graph.call_function(_aten.view.default, (shard, [-1]))
        graph.call_function(_aten.mul_.Tensor, (view, 2))
        return graph.call_function(WAIT, (issue,))

    with pytest.raises(
        RuntimeError, match="writes to a buffer of all_gather_into_tensor_default while it is in flight"
    ):
        check_collectives(_graph(build))


def test_no_wait_before_output():
    def build(graph, shard):
        _gather(graph, shard)  # issued, never waited for
        return shard

    with pytest.raises(RuntimeError, match="all_gather_into_tensor_default still in flight when the graph returns"):
        check_collectives(_graph(build))


def test_two_in_flight_on_a_serial_group_only():
    def build(graph, shard):
        first, second = _gather(graph, shard), _gather(graph, shard)
        return graph.call_function(WAIT, (first,)), graph.call_function(WAIT, (second,))

    check_collectives(_graph(build))  # allowed on a group that is not serial (NCCL: one stream orders them)
    with pytest.raises(RuntimeError, match="issued on serial group .g. while all_gather_into_tensor_default is"):
        check_collectives(_graph(build), {"g"})
