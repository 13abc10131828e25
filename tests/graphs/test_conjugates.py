"""`passes.materialize_conjugates` on a tiny complex product (torchtitan's RoPE arithmetic): the joint graph's
lazy conjugate (the backward of `x * cache`) becomes a materialised one, with the same gradients. The snapshot is
the spec."""

import torch
from expecttest import assert_expected_inline
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from passes import materialize_conjugates
from tests.graphs.capture import code


def _rotate(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(torch.view_as_complex(x.reshape(2, 2, 2)) * cache).flatten(1).square().sum()


def test_materialize_conjugates_rewrites_the_backward_conjugate():
    joints, rewritten = [], []

    def partition(joint, inputs, **kwargs):
        rewritten.append(materialize_conjugates(joint.graph))
        rewritten.append(materialize_conjugates(joint.graph))  # nothing left to rewrite: a no-op
        joint.recompile()
        joints.append(code(joint))
        return min_cut_rematerialization_partition(joint, inputs, **kwargs)

    keep = lambda gm, _: make_boxed_func(gm.forward)  # noqa: E731
    torch._dynamo.reset()
    x, cache = torch.randn(2, 4, requires_grad=True), torch.polar(torch.ones(2), torch.tensor([0.5, 1.0]))
    _rotate(x, cache).backward()
    expected, x.grad = x.grad, None
    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=partition)
    torch.compile(_rotate, backend=backend, fullgraph=True)(x, cache).backward()
    assert rewritten == [1, 0]
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)
    assert_expected_inline(
        joints[0],
        """\
def forward(self, primals, tangents):
    primals_1, primals_2, tangents_1, = fx_pytree.tree_flatten_spec([primals, tangents], self._in_spec)
    view = torch.ops.aten.view.default(primals_1, [2, 2, 2]);  primals_1 = None
    view_as_complex = torch.ops.aten.view_as_complex.default(view);  view = None
    mul = torch.ops.aten.mul.Tensor(view_as_complex, primals_2);  view_as_complex = None
    view_as_real = torch.ops.aten.view_as_real.default(mul);  mul = None
    view_1 = torch.ops.aten.view.default(view_as_real, [2, 4]);  view_as_real = None
    pow_1 = torch.ops.aten.pow.Tensor_Scalar(view_1, 2)
    sum_1 = torch.ops.aten.sum.default(pow_1);  pow_1 = None
    expand = torch.ops.aten.expand.default(tangents_1, [2, 4]);  tangents_1 = None
    pow_2 = torch.ops.aten.pow.Tensor_Scalar(view_1, 1.0);  view_1 = None
    mul_1 = torch.ops.aten.mul.Scalar(pow_2, 2.0);  pow_2 = None
    mul_2 = torch.ops.aten.mul.Tensor(expand, mul_1);  expand = mul_1 = None
    view_2 = torch.ops.aten.view.default(mul_2, [2, 2, 2]);  mul_2 = None
    view_as_complex_1 = torch.ops.aten.view_as_complex.default(view_2);  view_2 = None
    _conj = torch.ops.aten.conj_physical.default(primals_2);  primals_2 = None
    clone = torch.ops.aten.clone.default(_conj);  _conj = None
    mul_3 = torch.ops.aten.mul.Tensor(view_as_complex_1, clone);  view_as_complex_1 = clone = None
    view_as_real_1 = torch.ops.aten.view_as_real.default(mul_3);  mul_3 = None
    view_3 = torch.ops.aten.view.default(view_as_real_1, [2, 4]);  view_as_real_1 = None
    return pytree.tree_unflatten([sum_1, view_3, None], self._out_spec)""",
    )
