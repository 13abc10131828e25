"""The eager `fsdp.reduce_grad` (issue 27, minor): no division pass over the full gradient before the reduction
where the reduce dtype has fp32's range (it moves onto the shard, after the reduction), with the values of the
divide-then-reduce formula the lowered graph computes."""

from collections import Counter

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_graph
from fsdp_graph.ir import gradient_divide_factors, ops

_PASSES = {"div", "mul", "to", "_to_copy"}  # the division by `pre`, the cast to the reduce dtype


class _FullGradientPasses(TorchDispatchMode):
    """Counts, by op name, the arithmetic ops (`_PASSES`) whose first argument has one of `sizes` elements, the
    bodies of the `fsdp` ops included (they run under the mode, as `planning.measure.wire_bytes_per_group` runs
    them)."""

    def __init__(self, sizes: set[int]) -> None:
        super().__init__()
        self.sizes, self.counts = sizes, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "fsdp":
            with self:
                return getattr(ops, func._opname)._init_fn(*args, **kwargs)
        name = func._overloadpacket.__name__
        if name in _PASSES and isinstance(args[0], torch.Tensor) and args[0].numel() in self.sizes:
            self.counts[name] += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize(
    ("param_dtype", "mixed", "expected"),
    [
        (torch.float32, None, {}),  # fp32: the division moves after the reduction, onto the shard
        (torch.float32, (torch.bfloat16, torch.float32), {"to": 2}),  # bf16 gradients: the cast alone
        (torch.float16, None, {"div": 2}),  # fp16's narrow range: dividing first keeps the sum finite
    ],
)
def test_one_eager_backward_passes_over_each_full_gradient_at_most_once(fake_pg, param_dtype, mixed, expected):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)).to(param_dtype)
    mp = None if mixed is None else fsdp_graph.MixedPrecision(param_dtype=mixed[0], reduce_dtype=mixed[1])
    fsdp_graph.fully_shard(model, wrap=[model[0], model[2]], mixed_precision=mp)
    states = model._fsdp_root.flat_params
    loss = model(torch.randn(3, 16, dtype=param_dtype)).sum()
    counting = _FullGradientPasses({s.layout.padded_numel for s in states})
    with counting:
        loss.backward()
    assert len(states) == 2 and dict(counting.counts) == expected, (param_dtype, mixed, counting.counts)


def _divide_then_reduce(grad, dtype, out_dtype, factor, partial=None, all_reduce=True):
    """The formula as the lowered graph writes it (`passes.lower._lower_reduce`), for one rank."""
    pre, post = gradient_divide_factors(1, factor)
    grad = (grad if dtype is None else grad.to(dtype)) / pre
    if partial is not None:
        grad = grad + partial
    return (grad if not all_reduce else grad / post).to(out_dtype)


@pytest.mark.parametrize(
    ("grad_dtype", "dtype"),
    [
        (torch.float32, None),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.float16, None),
    ],
)
def test_eager_reduce_values_equal_divide_then_reduce(grad_dtype, dtype):
    """World 1 with a divide factor (6 = 4 x 1.5, 3.3 = 4 x 0.825): `pre` > 1 and no process group. Gradients over
    many binades; bit for bit, the partial-sum paths (`set_requires_all_reduce`) included."""
    gen = torch.Generator().manual_seed(0)
    scale = torch.exp2(torch.randint(-12, 12, (4096,), generator=gen).float())
    grad = (torch.randn(4096, generator=gen) * scale).to(grad_dtype)
    reduce_dtype = dtype or grad_dtype
    partial = torch.randn(4096, generator=gen).to(reduce_dtype)
    for factor in (6.0, 3.3):
        common = {"unit": "u", "group": "", "world": 1, "dtype": dtype, "out_dtype": torch.float32}
        for all_reduce, part in ((True, None), (False, None), (True, partial), (False, partial)):
            got = ops.reduce_grad(grad, **common, divide_factor=factor, all_reduce=all_reduce, partial=part)
            want = _divide_then_reduce(grad, dtype, torch.float32, factor, part, all_reduce)
            assert torch.equal(got, want), (grad_dtype, dtype, factor, all_reduce, part is not None)
