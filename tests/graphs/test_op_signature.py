"""fsdp::unshard / fsdp::reduce_grad: every consumer of the ops' arguments derives them from the registered schema."""

import inspect

import torch

from fsdp_graph import ir
from fsdp_graph.ir import ops


def test_ir_argument_lists_are_the_registered_schemas():
    for op, signature, python_def in (
        (ir.UNSHARD, ir.UNSHARD_SIGNATURE, ops.unshard),
        (ir.REDUCE_GRAD, ir.REDUCE_SIGNATURE, ops.reduce_grad),
    ):
        schema = op._schema.arguments
        assert signature.names == tuple(a.name for a in schema)
        assert signature.arity == len(schema)
        declared = inspect.signature(python_def._init_fn).parameters
        assert signature.names == tuple(declared)
        assert signature.defaults == {n: p.default for n, p in declared.items() if p.default is not p.empty}
    assert ir.UNSHARD_ARGS is ir.UNSHARD_SIGNATURE.names and ir.UNSHARD_DEFAULTS is ir.UNSHARD_SIGNATURE.defaults


def test_call_args_keep_arguments_up_to_the_last_non_default():
    shard = torch.zeros(2)
    base = {"shard": shard, "unit": "u", "group": "0", "world": 2}
    assert ir.UNSHARD_SIGNATURE.call_args({**base, "dtype": None, "sync": True}) == (shard, "u", "0", 2)
    with_reshard = ir.UNSHARD_SIGNATURE.call_args({**base, "reshard_after_forward": False})
    assert with_reshard == (shard, "u", "0", 2, None, None, False)
    assert ir.UNSHARD_SIGNATURE.call_args({**base, "replicate_world": 1}) == (shard, "u", "0", 2)


def test_unknown_argument_is_refused_by_name():
    try:
        ir.UNSHARD_SIGNATURE.call_args({"shard": torch.zeros(1), "reshard": True})
    except TypeError as error:
        assert "reshard" in str(error)
    else:
        raise AssertionError("an unknown argument name was accepted")


def test_bind_and_gradients_follow_the_schema_order():
    node_args = (torch.zeros(4), "u", "0", 2)
    bound = ir.UNSHARD_SIGNATURE.bind(node_args, {"sync": False})
    assert (bound.unit, bound.world, bound.sync, bound.reshard_after_forward) == ("u", 2, False, True)
    grads = ir.UNSHARD_SIGNATURE.gradients(unsynced=torch.ones(1))
    assert len(grads) == ir.UNSHARD_SIGNATURE.arity
    assert grads[ir.UNSHARD_ARGS.index("unsynced")] is not None and grads[0] is None
