"""Block quantizers (`passes.quantize`) and the compression pass (`passes.compress`) on a tiny graph (fake group)."""

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline

import fsdp_graph
from fsdp_graph.ir import (
    ALL_GATHER,
    ALL_TO_ALL,
    COLLECTIVES,
    META_ALL_REDUCE_STEP,
    META_COMPRESSED,
    META_UNIT,
    REDUCE_SCATTER,
    WAIT,
)
from passes import (
    check_collectives,
    compress_collectives,
    lower_fsdp_ops,
    reduce_scatter_as_all_to_all,
    schedule_collectives,
    tag_reshard,
)
from passes.quantize import (
    pack_rows,
    pack_segments,
    packed_bytes,
    round_trip,
    segmented_bytes,
    unpack_rows,
    unpack_segments,
)
from tests.graphs.capture import TwoBlock, aot_stages, code

LEVELS = {"int8": 127, "int4": 7, "fp8": 448}


def _blocks_with_spread(n_blocks: int, block: int) -> torch.Tensor:
    """Blocks whose magnitudes span 12 orders of magnitude, so a shared scale across blocks would fail."""
    g = torch.Generator().manual_seed(0)
    magnitudes = torch.logspace(-6, 6, n_blocks).repeat_interleave(block)
    return torch.randn(n_blocks * block, generator=g) * magnitudes


@pytest.mark.parametrize("scheme", ["int8", "int4", "fp8"])
def test_round_trip_error_is_bounded_per_block(scheme):
    block = 16
    x = _blocks_with_spread(9, block)[:-5]  # a ragged last block: padding
    y = round_trip(x, scheme, block)
    assert y.shape == x.shape and y.dtype == x.dtype
    for lo in range(0, x.numel(), block):
        xb, yb = x[lo : lo + block], y[lo : lo + block]
        scale = xb.abs().max() / LEVELS[scheme]
        if scheme == "fp8":  # 3 mantissa bits: half an ulp relative, or subnormal steps of 2^-9 * scale
            bound = torch.maximum(xb.abs() * 2**-4, torch.full_like(xb, 2**-10) * scale)
        else:
            bound = torch.full_like(xb, scale / 2)
        assert ((xb - yb).abs() <= bound * (1 + 1e-6)).all(), (scheme, lo)


def test_round_trip_is_exact_for_representable_blocks():
    """Codes times a power-of-two scale, with the largest code in every block, come back bit for bit."""
    g = torch.Generator().manual_seed(0)
    for scheme, level in LEVELS.items():
        if scheme == "fp8":  # any float8_e4m3fn value is a code
            codes = (torch.randn(4, 64, generator=g) * 50).clamp(-level, level).to(torch.float8_e4m3fn).float()
        else:
            codes = torch.randint(-level, level + 1, (4, 64), generator=g).float()
        codes[:, 0] = level  # the block's max decides its scale
        codes[1, 0] = -level
        for exponent in (-20, 0, 20):
            x = codes.reshape(-1)[:-3] * 2.0**exponent  # a padded last block too
            assert torch.equal(round_trip(x, scheme, 64), x), (scheme, exponent)


@pytest.mark.parametrize("scheme", ["int8", "int4", "fp8"])
def test_zero_blocks_and_huge_values_stay_finite(scheme):
    x = torch.zeros(3 * 32)
    x[32:64] = 3e38 * torch.linspace(-1, 1, 32)  # near float32's max
    x[64:96] = 1e-40  # subnormal
    y = round_trip(x, scheme, 32)
    assert torch.isfinite(y).all()
    assert torch.equal(y[:32], x[:32])
    huge = x[32:64]
    bound = huge.abs() * 2**-4 if scheme == "fp8" else torch.full_like(huge, 3e38 / LEVELS[scheme] / 2)
    assert ((y[32:64] - huge).abs() <= bound * (1 + 1e-6)).all()
    assert (y[64:] - x[64:]).abs().max() <= 2**-126
    bf16 = round_trip(x[32:64].to(torch.bfloat16), scheme, 32)  # a compute dtype other than float32
    assert bf16.dtype == torch.bfloat16 and torch.isfinite(bf16).all()


def test_packed_rows_hold_codes_and_scales():
    rows = torch.randn(3, 40)
    packed = pack_rows(rows, 3, 40, "int8", 16)
    assert packed.dtype == torch.uint8 and packed.shape == (3, packed_bytes(40, "int8", 16)) == (3, 48 + 12)
    assert packed_bytes(40, "int4", 16) == 24 + 12
    restored = unpack_rows(packed, 3, 40, torch.float32, "int8", 16)
    for r in range(3):  # one row at a time gives the same: rows never share a block
        assert torch.equal(restored[r], round_trip(rows[r], "int8", 16))


# fp8 in the rows layout: one scale per row of each parameter. A rank's shard of a unit with a (3, 8) weight, a
# 1-D bias of 5 (one row: its whole block) and a (2, 12) weight.
ROW_SEGMENTS = ((24, 8), (5, 5), (24, 12))


def _rows_with_spread() -> torch.Tensor:
    """Rows whose magnitudes span 12 orders of magnitude, so a scale shared by two rows would fail."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(53, generator=g)
    row_of = torch.cat(
        [torch.arange(3).repeat_interleave(8), torch.full((5,), 3), 4 + torch.arange(2).repeat_interleave(12)]
    )
    return x * torch.logspace(-6, 6, 6)[row_of], row_of


def test_fp8_round_trip_error_is_bounded_per_row():
    x, row_of = _rows_with_spread()
    y = round_trip(x, "fp8", 256, ROW_SEGMENTS)
    assert y.shape == x.shape and torch.isfinite(y).all()
    for row in range(6):
        xr, yr = x[row_of == row], y[row_of == row]
        scale = xr.abs().max() / 448
        bound = torch.maximum(xr.abs() * 2**-4, torch.full_like(xr, 2**-10) * scale)
        assert ((xr - yr).abs() <= bound * (1 + 1e-6)).all(), row
    packed = pack_segments(x.view(1, -1), 1, ROW_SEGMENTS, "fp8")
    assert packed.shape == (1, segmented_bytes(ROW_SEGMENTS, "fp8")) == (1, 53 + 4 * 6)  # a scale per row
    assert torch.equal(unpack_segments(packed, 1, ROW_SEGMENTS, torch.float32, "fp8").view(-1), y)


def test_fp8_round_trip_is_exact_for_representable_rows():
    """fp8 codes times a power of two per row, each row holding the largest code, come back bit for bit; the same
    values in 256-element blocks do not (one scale for rows of different powers)."""
    g = torch.Generator().manual_seed(1)
    codes = (torch.randn(53, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    _, row_of = _rows_with_spread()
    starts = [0, 8, 16, 24, 29, 41]
    codes[starts] = 448.0
    x = codes * 2.0 ** (torch.tensor([-20, -3, 0, 5, 9, 20])[row_of])
    assert torch.equal(round_trip(x, "fp8", 256, ROW_SEGMENTS), x)
    assert not torch.equal(round_trip(x, "fp8", 256), x)


def test_fp8_zero_and_huge_rows_stay_finite():
    x = torch.zeros(53)
    x[24:29] = 3e38 * torch.linspace(-1, 1, 5)  # the bias row near float32's max
    x[29:41] = 1e-40  # a subnormal row; the others all zero
    y = round_trip(x, "fp8", 256, ROW_SEGMENTS)
    assert torch.isfinite(y).all()
    assert torch.equal(y[:24], x[:24]) and torch.equal(y[41:], x[41:])
    assert ((y[24:29] - x[24:29]).abs() <= x[24:29].abs() * 2**-4 * (1 + 1e-6)).all()
    assert (y[29:41] - x[29:41]).abs().max() <= 2**-126


class _RowsUnit(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 6), torch.nn.Linear(6, 12, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_fp8_gathers_take_a_scale_per_row_in_the_rows_layout(fake_pg):
    """World 4, blocks of 32: a rank's shard is a.weight's 2 rows of 8, a.bias's block of 2 and b.weight's 3 rows of
    6 (36 elements). Rows: the forward packs 36 codes + 2 + 1 + 3 scales; the backward re-gathers only b.weight's
    rows, so the range it does not read keeps a padded block. Flat: the 126 elements padded to 128, so 32 per rank:
    one block and its scale, as before."""
    sizes = {}
    for layout in ("rows", "flat"):
        torch.manual_seed(0)
        model = fsdp_graph.fully_shard(_RowsUnit(), reuse_blocks=False, layout=layout)
        stages = aot_stages(model, torch.randn(2, 8), tag=tag_reshard)
        sizes[layout] = []
        for gm in (lower_fsdp_ops(stages.forward), lower_fsdp_ops(stages.backward)):
            compress_collectives(gm, weights="fp8", grads=None, block_size=32)
            sizes[layout] += [n.args[0].meta["val"].numel() for n in gm.graph.nodes if n.target is ALL_GATHER]
    assert sizes == {"rows": [36 + 4 * 6, (32 + 4) + (18 + 4 * 3)], "flat": [32 + 4] * 2}


def test_compress_pass_snapshot(fake_pg):
    """World 4, int8 blocks of 4: the forward's gather moves packed uint8 rows (codes, then the scales' bytes), the
    backward's reduce-scatter becomes an all-to-all of packed rows, restored and summed in float32. (This weight's
    gradient needs no re-gather; the next test has one.)"""
    torch.manual_seed(0)
    model = fsdp_graph.fully_shard(torch.nn.Linear(8, 4, bias=False), reshard_after_forward=True)
    stages = aot_stages(model, torch.randn(2, 8), tag=tag_reshard)
    fw, bw = lower_fsdp_ops(stages.forward), lower_fsdp_ops(stages.backward)
    compress_collectives(fw, weights="int8", grads="int8", block_size=4)
    compress_collectives(bw, weights="int8", grads="int8", block_size=4)
    assert_expected_inline(
        code(fw),
        """\
def forward(self, primals_1, primals_2):
    view_default = torch.ops.aten.view.default(primals_2, [1, 8]);  primals_2 = None
    view_default_1 = torch.ops.aten.view.default(view_default, [1, 2, 4]);  view_default = None
    abs_default = torch.ops.aten.abs.default(view_default_1)
    amax_default = torch.ops.aten.amax.default(abs_default, [2], True);  abs_default = None
    div_tensor = torch.ops.aten.div.Tensor(amax_default, 127.0);  amax_default = None
    clamp_min_default = torch.ops.aten.clamp_min.default(div_tensor, 1.1754943508222875e-38);  div_tensor = None
    div_tensor_1 = torch.ops.aten.div.Tensor(view_default_1, clamp_min_default);  view_default_1 = None
    round_default = torch.ops.aten.round.default(div_tensor_1);  div_tensor_1 = None
    clamp_min_default_1 = torch.ops.aten.clamp_min.default(round_default, -127.0);  round_default = None
    clamp_max_default = torch.ops.aten.clamp_max.default(clamp_min_default_1, 127.0);  clamp_min_default_1 = None
    convert_element_type_default = torch.ops.prims.convert_element_type.default(clamp_max_default, torch.int8);  clamp_max_default = None
    view_default_2 = torch.ops.aten.view.default(convert_element_type_default, [1, 8]);  convert_element_type_default = None
    view_dtype = torch.ops.aten.view.dtype(view_default_2, torch.uint8);  view_default_2 = None
    view_default_3 = torch.ops.aten.view.default(clamp_min_default, [1, 2]);  clamp_min_default = None
    view_dtype_1 = torch.ops.aten.view.dtype(view_default_3, torch.int32);  view_default_3 = None
    bitwise_and_scalar = torch.ops.aten.bitwise_and.Scalar(view_dtype_1, 255)
    convert_element_type_default_1 = torch.ops.prims.convert_element_type.default(bitwise_and_scalar, torch.uint8);  bitwise_and_scalar = None
    unsqueeze_default = torch.ops.aten.unsqueeze.default(convert_element_type_default_1, 2);  convert_element_type_default_1 = None
    bitwise_right_shift_tensor_scalar = torch.ops.aten.bitwise_right_shift.Tensor_Scalar(view_dtype_1, 8)
    bitwise_and_scalar_1 = torch.ops.aten.bitwise_and.Scalar(bitwise_right_shift_tensor_scalar, 255);  bitwise_right_shift_tensor_scalar = None
    convert_element_type_default_2 = torch.ops.prims.convert_element_type.default(bitwise_and_scalar_1, torch.uint8);  bitwise_and_scalar_1 = None
    unsqueeze_default_1 = torch.ops.aten.unsqueeze.default(convert_element_type_default_2, 2);  convert_element_type_default_2 = None
    bitwise_right_shift_tensor_scalar_1 = torch.ops.aten.bitwise_right_shift.Tensor_Scalar(view_dtype_1, 16)
    bitwise_and_scalar_2 = torch.ops.aten.bitwise_and.Scalar(bitwise_right_shift_tensor_scalar_1, 255);  bitwise_right_shift_tensor_scalar_1 = None
    convert_element_type_default_3 = torch.ops.prims.convert_element_type.default(bitwise_and_scalar_2, torch.uint8);  bitwise_and_scalar_2 = None
    unsqueeze_default_2 = torch.ops.aten.unsqueeze.default(convert_element_type_default_3, 2);  convert_element_type_default_3 = None
    bitwise_right_shift_tensor_scalar_2 = torch.ops.aten.bitwise_right_shift.Tensor_Scalar(view_dtype_1, 24);  view_dtype_1 = None
    bitwise_and_scalar_3 = torch.ops.aten.bitwise_and.Scalar(bitwise_right_shift_tensor_scalar_2, 255);  bitwise_right_shift_tensor_scalar_2 = None
    convert_element_type_default_4 = torch.ops.prims.convert_element_type.default(bitwise_and_scalar_3, torch.uint8);  bitwise_and_scalar_3 = None
    unsqueeze_default_3 = torch.ops.aten.unsqueeze.default(convert_element_type_default_4, 2);  convert_element_type_default_4 = None
    cat_default = torch.ops.aten.cat.default([unsqueeze_default, unsqueeze_default_1, unsqueeze_default_2, unsqueeze_default_3], 2);  unsqueeze_default = unsqueeze_default_1 = unsqueeze_default_2 = unsqueeze_default_3 = None
    view_default_4 = torch.ops.aten.view.default(cat_default, [1, 8]);  cat_default = None
    cat_default_1 = torch.ops.aten.cat.default([view_dtype, view_default_4], 1);  view_dtype = view_default_4 = None
    view_default_5 = torch.ops.aten.view.default(cat_default_1, [-1]);  cat_default_1 = None
    all_gather_into_tensor_default_1 = torch.ops._c10d_functional.all_gather_into_tensor.default(view_default_5, 4, '0');  view_default_5 = None
    wait_tensor_default_1 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default_1);  all_gather_into_tensor_default_1 = None
    view_default_6 = torch.ops.aten.view.default(wait_tensor_default_1, [4, 16]);  wait_tensor_default_1 = None
    slice_tensor = torch.ops.aten.slice.Tensor(view_default_6, 1, 0, 8)
    slice_tensor_1 = torch.ops.aten.slice.Tensor(view_default_6, 1, 8, 16);  view_default_6 = None
    clone_default = torch.ops.aten.clone.default(slice_tensor_1, memory_format = torch.contiguous_format);  slice_tensor_1 = None
    view_dtype_2 = torch.ops.aten.view.dtype(clone_default, torch.float32);  clone_default = None
    view_default_7 = torch.ops.aten.view.default(view_dtype_2, [4, 2, 1]);  view_dtype_2 = None
    view_dtype_3 = torch.ops.aten.view.dtype(slice_tensor, torch.int8);  slice_tensor = None
    convert_element_type_default_5 = torch.ops.prims.convert_element_type.default(view_dtype_3, torch.float32);  view_dtype_3 = None
    view_default_8 = torch.ops.aten.view.default(convert_element_type_default_5, [4, 2, 4]);  convert_element_type_default_5 = None
    mul_tensor = torch.ops.aten.mul.Tensor(view_default_8, view_default_7);  view_default_8 = view_default_7 = None
    view_default_9 = torch.ops.aten.view.default(mul_tensor, [4, 8]);  mul_tensor = None
    view_default_10 = torch.ops.aten.view.default(view_default_9, [32]);  view_default_9 = None
    view = torch.ops.aten.view.default(view_default_10, [4, 8]);  view_default_10 = None
    alias = torch.ops.aten.alias.default(view);  view = None
    view_1 = torch.ops.aten.view.default(alias, [4, 8]);  alias = None
    t = torch.ops.aten.t.default(view_1);  view_1 = None
    mm = torch.ops.aten.mm.default(primals_1, t);  t = None
    return (mm, primals_1)""",
    )
    assert_expected_inline(
        code(bw),
        """\
def forward(self, primals_1, tangents_1):
    t_1 = torch.ops.aten.t.default(tangents_1);  tangents_1 = None
    mm_1 = torch.ops.aten.mm.default(t_1, primals_1);  t_1 = primals_1 = None
    t_2 = torch.ops.aten.t.default(mm_1);  mm_1 = None
    t_3 = torch.ops.aten.t.default(t_2);  t_2 = None
    view_2 = torch.ops.aten.view.default(t_3, [4, 8]);  t_3 = None
    view_3 = torch.ops.aten.view.default(view_2, [32]);  view_2 = None
    view_default = torch.ops.aten.view.default(view_3, [4, 8]);  view_3 = None
    view_default_1 = torch.ops.aten.view.default(view_default, [4, 2, 4]);  view_default = None
    abs_default = torch.ops.aten.abs.default(view_default_1)
    amax_default = torch.ops.aten.amax.default(abs_default, [2], True);  abs_default = None
    div_tensor_1 = torch.ops.aten.div.Tensor(amax_default, 127.0);  amax_default = None
    clamp_min_default = torch.ops.aten.clamp_min.default(div_tensor_1, 1.1754943508222875e-38);  div_tensor_1 = None
    div_tensor_2 = torch.ops.aten.div.Tensor(view_default_1, clamp_min_default);  view_default_1 = None
    round_default = torch.ops.aten.round.default(div_tensor_2);  div_tensor_2 = None
    clamp_min_default_1 = torch.ops.aten.clamp_min.default(round_default, -127.0);  round_default = None
    clamp_max_default = torch.ops.aten.clamp_max.default(clamp_min_default_1, 127.0);  clamp_min_default_1 = None
    convert_element_type_default = torch.ops.prims.convert_element_type.default(clamp_max_default, torch.int8);  clamp_max_default = None
    view_default_2 = torch.ops.aten.view.default(convert_element_type_default, [4, 8]);  convert_element_type_default = None
    view_dtype = torch.ops.aten.view.dtype(view_default_2, torch.uint8);  view_default_2 = None
    view_default_3 = torch.ops.aten.view.default(clamp_min_default, [4, 2]);  clamp_min_default = None
    view_dtype_1 = torch.ops.aten.view.dtype(view_default_3, torch.int32);  view_default_3 = None
    bitwise_and_scalar = torch.ops.aten.bitwise_and.Scalar(view_dtype_1, 255)
    convert_element_type_default_1 = torch.ops.prims.convert_element_type.default(bitwise_and_scalar, torch.uint8);  bitwise_and_scalar = None
    unsqueeze_default = torch.ops.aten.unsqueeze.default(convert_element_type_default_1, 2);  convert_element_type_default_1 = None
    bitwise_right_shift_tensor_scalar = torch.ops.aten.bitwise_right_shift.Tensor_Scalar(view_dtype_1, 8)
    bitwise_and_scalar_1 = torch.ops.aten.bitwise_and.Scalar(bitwise_right_shift_tensor_scalar, 255);  bitwise_right_shift_tensor_scalar = None
    convert_element_type_default_2 = torch.ops.prims.convert_element_type.default(bitwise_and_scalar_1, torch.uint8);  bitwise_and_scalar_1 = None
    unsqueeze_default_1 = torch.ops.aten.unsqueeze.default(convert_element_type_default_2, 2);  convert_element_type_default_2 = None
    bitwise_right_shift_tensor_scalar_1 = torch.ops.aten.bitwise_right_shift.Tensor_Scalar(view_dtype_1, 16)
    bitwise_and_scalar_2 = torch.ops.aten.bitwise_and.Scalar(bitwise_right_shift_tensor_scalar_1, 255);  bitwise_right_shift_tensor_scalar_1 = None
    convert_element_type_default_3 = torch.ops.prims.convert_element_type.default(bitwise_and_scalar_2, torch.uint8);  bitwise_and_scalar_2 = None
    unsqueeze_default_2 = torch.ops.aten.unsqueeze.default(convert_element_type_default_3, 2);  convert_element_type_default_3 = None
    bitwise_right_shift_tensor_scalar_2 = torch.ops.aten.bitwise_right_shift.Tensor_Scalar(view_dtype_1, 24);  view_dtype_1 = None
    bitwise_and_scalar_3 = torch.ops.aten.bitwise_and.Scalar(bitwise_right_shift_tensor_scalar_2, 255);  bitwise_right_shift_tensor_scalar_2 = None
    convert_element_type_default_4 = torch.ops.prims.convert_element_type.default(bitwise_and_scalar_3, torch.uint8);  bitwise_and_scalar_3 = None
    unsqueeze_default_3 = torch.ops.aten.unsqueeze.default(convert_element_type_default_4, 2);  convert_element_type_default_4 = None
    cat_default = torch.ops.aten.cat.default([unsqueeze_default, unsqueeze_default_1, unsqueeze_default_2, unsqueeze_default_3], 2);  unsqueeze_default = unsqueeze_default_1 = unsqueeze_default_2 = unsqueeze_default_3 = None
    view_default_4 = torch.ops.aten.view.default(cat_default, [4, 8]);  cat_default = None
    cat_default_1 = torch.ops.aten.cat.default([view_dtype, view_default_4], 1);  view_dtype = view_default_4 = None
    view_default_5 = torch.ops.aten.view.default(cat_default_1, [-1]);  cat_default_1 = None
    all_to_all_single_default = torch.ops._c10d_functional.all_to_all_single.default(view_default_5, [16, 16, 16, 16], [16, 16, 16, 16], '0');  view_default_5 = None
    wait_tensor_default_1 = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_default);  all_to_all_single_default = None
    view_default_6 = torch.ops.aten.view.default(wait_tensor_default_1, [4, 16]);  wait_tensor_default_1 = None
    slice_tensor = torch.ops.aten.slice.Tensor(view_default_6, 1, 0, 8)
    slice_tensor_1 = torch.ops.aten.slice.Tensor(view_default_6, 1, 8, 16);  view_default_6 = None
    clone_default = torch.ops.aten.clone.default(slice_tensor_1, memory_format = torch.contiguous_format);  slice_tensor_1 = None
    view_dtype_2 = torch.ops.aten.view.dtype(clone_default, torch.float32);  clone_default = None
    view_default_7 = torch.ops.aten.view.default(view_dtype_2, [4, 2, 1]);  view_dtype_2 = None
    view_dtype_3 = torch.ops.aten.view.dtype(slice_tensor, torch.int8);  slice_tensor = None
    convert_element_type_default_5 = torch.ops.prims.convert_element_type.default(view_dtype_3, torch.float32);  view_dtype_3 = None
    view_default_8 = torch.ops.aten.view.default(convert_element_type_default_5, [4, 2, 4]);  convert_element_type_default_5 = None
    mul_tensor = torch.ops.aten.mul.Tensor(view_default_8, view_default_7);  view_default_8 = view_default_7 = None
    view_default_9 = torch.ops.aten.view.default(mul_tensor, [4, 8]);  mul_tensor = None
    sum_dim_int_list = torch.ops.aten.sum.dim_IntList(view_default_9, [0]);  view_default_9 = None
    div_tensor = torch.ops.aten.div.Tensor(sum_dim_int_list, 4);  sum_dim_int_list = None
    return (None, div_tensor)""",
    )
    compressed = [n for gm in (fw, bw) for n in gm.graph.nodes if n.target in (ALL_GATHER, ALL_TO_ALL)]
    assert [n.meta[META_COMPRESSED] for n in compressed] == [("int8", 128), ("int8", 128)]


def test_compress_pass_only_touches_selected_units(fake_pg):
    """FULL_SHARD's backward re-gathers blocks.1 and the root: only blocks.1's gather and reduction are compressed."""
    torch.manual_seed(0)
    # Without block reuse: its shared body would also re-gather blocks.0 in backward (one more, uncompressed, gather).
    stages = aot_stages(fsdp_graph.fully_shard(TwoBlock(), reuse_blocks=False), torch.randn(2, 4), tag=tag_reshard)
    bw = lower_fsdp_ops(stages.backward)
    compress_collectives(bw, weights="fp8", grads="int4", block_size=4, units=frozenset({"blocks.1"}))
    found = {
        (n.target, n.meta["fsdp_unit"]): (n.meta.get(META_COMPRESSED, (None,))[0], n.args[0].meta["val"].dtype)
        for n in bw.graph.nodes
        if n.target in (ALL_GATHER, ALL_TO_ALL, REDUCE_SCATTER)
    }
    assert found == {
        (ALL_GATHER, ""): (None, torch.float32),
        (ALL_GATHER, "blocks.1"): ("fp8 per row", torch.uint8),  # the rows layout: a scale per row
        (ALL_TO_ALL, "blocks.1"): ("int4", torch.uint8),
        (REDUCE_SCATTER, "blocks.0"): (None, torch.float32),
        (REDUCE_SCATTER, ""): (None, torch.float32),
    }


def test_compression_options():
    assert fsdp_graph.Compression.parse("int8") == fsdp_graph.Compression("int8", "int8")
    parsed = fsdp_graph.Compression.parse("weights=fp8,grads=int4,block=128")
    assert parsed == fsdp_graph.Compression("fp8", "int4", 128)
    assert fsdp_graph.Compression.parse("grads=int8") == fsdp_graph.Compression(None, "int8")
    with pytest.raises(ValueError, match="weights must be one of"):
        fsdp_graph.Compression(weights="int4")
    with pytest.raises(ValueError, match="block_size must be a positive multiple of 4"):
        fsdp_graph.Compression(block_size=6)
    with pytest.raises(ValueError, match="unknown key 'bits'"):
        fsdp_graph.Compression.parse("bits=8")
    with pytest.raises(TypeError, match="tuple of unit names"):
        fsdp_graph.Compression(units="blocks.0")
    assert repr(fsdp_graph.make_backend().schedule.compress) == "None"  # off by default


def test_compress_pass_hybrid_snapshot(fake_pg):
    """HYBRID_SHARD on a (2, 2) mesh, int8 gradients in blocks of 4, a 6-element weight: the reduce-scatter over the
    shard group is an all-to-all of packed rows; the replica all-reduce of the 3-element shard becomes: padded to
    2 row pieces of 2 (one per replica), packed, all-to-all over the replica group, restored and summed in
    float32, the summed piece packed again, all-gathered over the replica group, restored and cut to 3 elements."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2))
    hybrid = fsdp_graph.ShardingStrategy.HYBRID_SHARD
    model = fsdp_graph.fully_shard(torch.nn.Linear(3, 2, bias=False), mesh, strategy=hybrid)
    bw = lower_fsdp_ops(aot_stages(model, torch.randn(2, 3), tag=tag_reshard).backward)
    compress_collectives(bw, grads="int8", block_size=4, replica_sizes={model._fsdp_states[0].replicate_group: 2})
    assert_expected_inline(
        code(bw),
        """\
def forward(self, primals_1, tangents_1):
    t_1 = torch.ops.aten.t.default(tangents_1);  tangents_1 = None
    mm_1 = torch.ops.aten.mm.default(t_1, primals_1);  t_1 = primals_1 = None
    t_2 = torch.ops.aten.t.default(mm_1);  mm_1 = None
    t_3 = torch.ops.aten.t.default(t_2);  t_2 = None
    view_2 = torch.ops.aten.view.default(t_3, [2, 3]);  t_3 = None
    view_3 = torch.ops.aten.view.default(view_2, [6]);  view_2 = None
    view_default = torch.ops.aten.view.default(view_3, [2, 3]);  view_3 = None
    constant_pad_nd_default = torch.ops.aten.constant_pad_nd.default(view_default, [0, 1], 0.0);  view_default = None
    view_default_1 = torch.ops.aten.view.default(constant_pad_nd_default, [2, 1, 4]);  constant_pad_nd_default = None
    abs_default = torch.ops.aten.abs.default(view_default_1)
    amax_default = torch.ops.aten.amax.default(abs_default, [2], True);  abs_default = None
    div_tensor_1 = torch.ops.aten.div.Tensor(amax_default, 127.0);  amax_default = None
    clamp_min_default = torch.ops.aten.clamp_min.default(div_tensor_1, 1.1754943508222875e-38);  div_tensor_1 = None
    div_tensor_2 = torch.ops.aten.div.Tensor(view_default_1, clamp_min_default);  view_default_1 = None
    round_default = torch.ops.aten.round.default(div_tensor_2);  div_tensor_2 = None
    clamp_min_default_1 = torch.ops.aten.clamp_min.default(round_default, -127.0);  round_default = None
    clamp_max_default = torch.ops.aten.clamp_max.default(clamp_min_default_1, 127.0);  clamp_min_default_1 = None
    convert_element_type_default = torch.ops.prims.convert_element_type.default(clamp_max_default, torch.int8);  clamp_max_default = None
    view_default_2 = torch.ops.aten.view.default(convert_element_type_default, [2, 4]);  convert_element_type_default = None
    view_dtype = torch.ops.aten.view.dtype(view_default_2, torch.uint8);  view_default_2 = None
    view_default_3 = torch.ops.aten.view.default(clamp_min_default, [2, 1]);  clamp_min_default = None
    view_dtype_1 = torch.ops.aten.view.dtype(view_default_3, torch.int32);  view_default_3 = None
    bitwise_and_scalar = torch.ops.aten.bitwise_and.Scalar(view_dtype_1, 255)
    convert_element_type_default_1 = torch.ops.prims.convert_element_type.default(bitwise_and_scalar, torch.uint8);  bitwise_and_scalar = None
    unsqueeze_default = torch.ops.aten.unsqueeze.default(convert_element_type_default_1, 2);  convert_element_type_default_1 = None
    bitwise_right_shift_tensor_scalar = torch.ops.aten.bitwise_right_shift.Tensor_Scalar(view_dtype_1, 8)
    bitwise_and_scalar_1 = torch.ops.aten.bitwise_and.Scalar(bitwise_right_shift_tensor_scalar, 255);  bitwise_right_shift_tensor_scalar = None
    convert_element_type_default_2 = torch.ops.prims.convert_element_type.default(bitwise_and_scalar_1, torch.uint8);  bitwise_and_scalar_1 = None
    unsqueeze_default_1 = torch.ops.aten.unsqueeze.default(convert_element_type_default_2, 2);  convert_element_type_default_2 = None
    bitwise_right_shift_tensor_scalar_1 = torch.ops.aten.bitwise_right_shift.Tensor_Scalar(view_dtype_1, 16)
    bitwise_and_scalar_2 = torch.ops.aten.bitwise_and.Scalar(bitwise_right_shift_tensor_scalar_1, 255);  bitwise_right_shift_tensor_scalar_1 = None
    convert_element_type_default_3 = torch.ops.prims.convert_element_type.default(bitwise_and_scalar_2, torch.uint8);  bitwise_and_scalar_2 = None
    unsqueeze_default_2 = torch.ops.aten.unsqueeze.default(convert_element_type_default_3, 2);  convert_element_type_default_3 = None
    bitwise_right_shift_tensor_scalar_2 = torch.ops.aten.bitwise_right_shift.Tensor_Scalar(view_dtype_1, 24);  view_dtype_1 = None
    bitwise_and_scalar_3 = torch.ops.aten.bitwise_and.Scalar(bitwise_right_shift_tensor_scalar_2, 255);  bitwise_right_shift_tensor_scalar_2 = None
    convert_element_type_default_4 = torch.ops.prims.convert_element_type.default(bitwise_and_scalar_3, torch.uint8);  bitwise_and_scalar_3 = None
    unsqueeze_default_3 = torch.ops.aten.unsqueeze.default(convert_element_type_default_4, 2);  convert_element_type_default_4 = None
    cat_default = torch.ops.aten.cat.default([unsqueeze_default, unsqueeze_default_1, unsqueeze_default_2, unsqueeze_default_3], 2);  unsqueeze_default = unsqueeze_default_1 = unsqueeze_default_2 = unsqueeze_default_3 = None
    view_default_4 = torch.ops.aten.view.default(cat_default, [2, 4]);  cat_default = None
    cat_default_1 = torch.ops.aten.cat.default([view_dtype, view_default_4], 1);  view_dtype = view_default_4 = None
    view_default_5 = torch.ops.aten.view.default(cat_default_1, [-1]);  cat_default_1 = None
    all_to_all_single_default = torch.ops._c10d_functional.all_to_all_single.default(view_default_5, [8, 8], [8, 8], 'fsdp_graph:shard:e022f294125b');  view_default_5 = None
    wait_tensor_default_2 = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_default);  all_to_all_single_default = None
    view_default_6 = torch.ops.aten.view.default(wait_tensor_default_2, [2, 8]);  wait_tensor_default_2 = None
    slice_tensor = torch.ops.aten.slice.Tensor(view_default_6, 1, 0, 4)
    slice_tensor_1 = torch.ops.aten.slice.Tensor(view_default_6, 1, 4, 8);  view_default_6 = None
    view_default_7 = torch.ops.aten.view.default(slice_tensor_1, [2, 1, 4]);  slice_tensor_1 = None
    convert_element_type_default_5 = torch.ops.prims.convert_element_type.default(view_default_7, torch.int64);  view_default_7 = None
    select_int = torch.ops.aten.select.int(convert_element_type_default_5, 2, 0)
    select_int_1 = torch.ops.aten.select.int(convert_element_type_default_5, 2, 1)
    mul_tensor = torch.ops.aten.mul.Tensor(select_int_1, 256);  select_int_1 = None
    add_tensor = torch.ops.aten.add.Tensor(select_int, mul_tensor);  select_int = mul_tensor = None
    select_int_2 = torch.ops.aten.select.int(convert_element_type_default_5, 2, 2)
    mul_tensor_1 = torch.ops.aten.mul.Tensor(select_int_2, 65536);  select_int_2 = None
    add_tensor_1 = torch.ops.aten.add.Tensor(add_tensor, mul_tensor_1);  add_tensor = mul_tensor_1 = None
    select_int_3 = torch.ops.aten.select.int(convert_element_type_default_5, 2, 3);  convert_element_type_default_5 = None
    mul_tensor_2 = torch.ops.aten.mul.Tensor(select_int_3, 16777216);  select_int_3 = None
    add_tensor_2 = torch.ops.aten.add.Tensor(add_tensor_1, mul_tensor_2);  add_tensor_1 = mul_tensor_2 = None
    convert_element_type_default_6 = torch.ops.prims.convert_element_type.default(add_tensor_2, torch.int32);  add_tensor_2 = None
    view_dtype_2 = torch.ops.aten.view.dtype(convert_element_type_default_6, torch.float32);  convert_element_type_default_6 = None
    view_default_8 = torch.ops.aten.view.default(view_dtype_2, [2, 1, 1]);  view_dtype_2 = None
    view_dtype_3 = torch.ops.aten.view.dtype(slice_tensor, torch.int8);  slice_tensor = None
    convert_element_type_default_7 = torch.ops.prims.convert_element_type.default(view_dtype_3, torch.float32);  view_dtype_3 = None
    view_default_9 = torch.ops.aten.view.default(convert_element_type_default_7, [2, 1, 4]);  convert_element_type_default_7 = None
    mul_tensor_3 = torch.ops.aten.mul.Tensor(view_default_9, view_default_8);  view_default_9 = view_default_8 = None
    view_default_10 = torch.ops.aten.view.default(mul_tensor_3, [2, 4]);  mul_tensor_3 = None
    slice_tensor_2 = torch.ops.aten.slice.Tensor(view_default_10, 1, 0, 3);  view_default_10 = None
    clone_default = torch.ops.aten.clone.default(slice_tensor_2, memory_format = torch.contiguous_format);  slice_tensor_2 = None
    sum_dim_int_list = torch.ops.aten.sum.dim_IntList(clone_default, [0]);  clone_default = None
    constant_pad_nd_default_1 = torch.ops.aten.constant_pad_nd.default(sum_dim_int_list, [0, 1], 0.0);  sum_dim_int_list = None
    view_default_11 = torch.ops.aten.view.default(constant_pad_nd_default_1, [2, 2]);  constant_pad_nd_default_1 = None
    constant_pad_nd_default_2 = torch.ops.aten.constant_pad_nd.default(view_default_11, [0, 2], 0.0);  view_default_11 = None
    view_default_12 = torch.ops.aten.view.default(constant_pad_nd_default_2, [2, 1, 4]);  constant_pad_nd_default_2 = None
    abs_default_1 = torch.ops.aten.abs.default(view_default_12)
    amax_default_1 = torch.ops.aten.amax.default(abs_default_1, [2], True);  abs_default_1 = None
    div_tensor_3 = torch.ops.aten.div.Tensor(amax_default_1, 127.0);  amax_default_1 = None
    clamp_min_default_2 = torch.ops.aten.clamp_min.default(div_tensor_3, 1.1754943508222875e-38);  div_tensor_3 = None
    div_tensor_4 = torch.ops.aten.div.Tensor(view_default_12, clamp_min_default_2);  view_default_12 = None
    round_default_1 = torch.ops.aten.round.default(div_tensor_4);  div_tensor_4 = None
    clamp_min_default_3 = torch.ops.aten.clamp_min.default(round_default_1, -127.0);  round_default_1 = None
    clamp_max_default_1 = torch.ops.aten.clamp_max.default(clamp_min_default_3, 127.0);  clamp_min_default_3 = None
    convert_element_type_default_8 = torch.ops.prims.convert_element_type.default(clamp_max_default_1, torch.int8);  clamp_max_default_1 = None
    view_default_13 = torch.ops.aten.view.default(convert_element_type_default_8, [2, 4]);  convert_element_type_default_8 = None
    view_dtype_4 = torch.ops.aten.view.dtype(view_default_13, torch.uint8);  view_default_13 = None
    view_default_14 = torch.ops.aten.view.default(clamp_min_default_2, [2, 1]);  clamp_min_default_2 = None
    view_dtype_5 = torch.ops.aten.view.dtype(view_default_14, torch.int32);  view_default_14 = None
    bitwise_and_scalar_4 = torch.ops.aten.bitwise_and.Scalar(view_dtype_5, 255)
    convert_element_type_default_9 = torch.ops.prims.convert_element_type.default(bitwise_and_scalar_4, torch.uint8);  bitwise_and_scalar_4 = None
    unsqueeze_default_4 = torch.ops.aten.unsqueeze.default(convert_element_type_default_9, 2);  convert_element_type_default_9 = None
    bitwise_right_shift_tensor_scalar_3 = torch.ops.aten.bitwise_right_shift.Tensor_Scalar(view_dtype_5, 8)
    bitwise_and_scalar_5 = torch.ops.aten.bitwise_and.Scalar(bitwise_right_shift_tensor_scalar_3, 255);  bitwise_right_shift_tensor_scalar_3 = None
    convert_element_type_default_10 = torch.ops.prims.convert_element_type.default(bitwise_and_scalar_5, torch.uint8);  bitwise_and_scalar_5 = None
    unsqueeze_default_5 = torch.ops.aten.unsqueeze.default(convert_element_type_default_10, 2);  convert_element_type_default_10 = None
    bitwise_right_shift_tensor_scalar_4 = torch.ops.aten.bitwise_right_shift.Tensor_Scalar(view_dtype_5, 16)
    bitwise_and_scalar_6 = torch.ops.aten.bitwise_and.Scalar(bitwise_right_shift_tensor_scalar_4, 255);  bitwise_right_shift_tensor_scalar_4 = None
    convert_element_type_default_11 = torch.ops.prims.convert_element_type.default(bitwise_and_scalar_6, torch.uint8);  bitwise_and_scalar_6 = None
    unsqueeze_default_6 = torch.ops.aten.unsqueeze.default(convert_element_type_default_11, 2);  convert_element_type_default_11 = None
    bitwise_right_shift_tensor_scalar_5 = torch.ops.aten.bitwise_right_shift.Tensor_Scalar(view_dtype_5, 24);  view_dtype_5 = None
    bitwise_and_scalar_7 = torch.ops.aten.bitwise_and.Scalar(bitwise_right_shift_tensor_scalar_5, 255);  bitwise_right_shift_tensor_scalar_5 = None
    convert_element_type_default_12 = torch.ops.prims.convert_element_type.default(bitwise_and_scalar_7, torch.uint8);  bitwise_and_scalar_7 = None
    unsqueeze_default_7 = torch.ops.aten.unsqueeze.default(convert_element_type_default_12, 2);  convert_element_type_default_12 = None
    cat_default_2 = torch.ops.aten.cat.default([unsqueeze_default_4, unsqueeze_default_5, unsqueeze_default_6, unsqueeze_default_7], 2);  unsqueeze_default_4 = unsqueeze_default_5 = unsqueeze_default_6 = unsqueeze_default_7 = None
    view_default_15 = torch.ops.aten.view.default(cat_default_2, [2, 4]);  cat_default_2 = None
    cat_default_3 = torch.ops.aten.cat.default([view_dtype_4, view_default_15], 1);  view_dtype_4 = view_default_15 = None
    view_default_16 = torch.ops.aten.view.default(cat_default_3, [-1]);  cat_default_3 = None
    all_to_all_single_default_1 = torch.ops._c10d_functional.all_to_all_single.default(view_default_16, [8, 8], [8, 8], 'fsdp_graph:replicate:333da4cd2324');  view_default_16 = None
    wait_tensor_default_3 = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_default_1);  all_to_all_single_default_1 = None
    view_default_17 = torch.ops.aten.view.default(wait_tensor_default_3, [2, 8]);  wait_tensor_default_3 = None
    slice_tensor_3 = torch.ops.aten.slice.Tensor(view_default_17, 1, 0, 4)
    slice_tensor_4 = torch.ops.aten.slice.Tensor(view_default_17, 1, 4, 8);  view_default_17 = None
    view_default_18 = torch.ops.aten.view.default(slice_tensor_4, [2, 1, 4]);  slice_tensor_4 = None
    convert_element_type_default_13 = torch.ops.prims.convert_element_type.default(view_default_18, torch.int64);  view_default_18 = None
    select_int_4 = torch.ops.aten.select.int(convert_element_type_default_13, 2, 0)
    select_int_5 = torch.ops.aten.select.int(convert_element_type_default_13, 2, 1)
    mul_tensor_4 = torch.ops.aten.mul.Tensor(select_int_5, 256);  select_int_5 = None
    add_tensor_3 = torch.ops.aten.add.Tensor(select_int_4, mul_tensor_4);  select_int_4 = mul_tensor_4 = None
    select_int_6 = torch.ops.aten.select.int(convert_element_type_default_13, 2, 2)
    mul_tensor_5 = torch.ops.aten.mul.Tensor(select_int_6, 65536);  select_int_6 = None
    add_tensor_4 = torch.ops.aten.add.Tensor(add_tensor_3, mul_tensor_5);  add_tensor_3 = mul_tensor_5 = None
    select_int_7 = torch.ops.aten.select.int(convert_element_type_default_13, 2, 3);  convert_element_type_default_13 = None
    mul_tensor_6 = torch.ops.aten.mul.Tensor(select_int_7, 16777216);  select_int_7 = None
    add_tensor_5 = torch.ops.aten.add.Tensor(add_tensor_4, mul_tensor_6);  add_tensor_4 = mul_tensor_6 = None
    convert_element_type_default_14 = torch.ops.prims.convert_element_type.default(add_tensor_5, torch.int32);  add_tensor_5 = None
    view_dtype_6 = torch.ops.aten.view.dtype(convert_element_type_default_14, torch.float32);  convert_element_type_default_14 = None
    view_default_19 = torch.ops.aten.view.default(view_dtype_6, [2, 1, 1]);  view_dtype_6 = None
    view_dtype_7 = torch.ops.aten.view.dtype(slice_tensor_3, torch.int8);  slice_tensor_3 = None
    convert_element_type_default_15 = torch.ops.prims.convert_element_type.default(view_dtype_7, torch.float32);  view_dtype_7 = None
    view_default_20 = torch.ops.aten.view.default(convert_element_type_default_15, [2, 1, 4]);  convert_element_type_default_15 = None
    mul_tensor_7 = torch.ops.aten.mul.Tensor(view_default_20, view_default_19);  view_default_20 = view_default_19 = None
    view_default_21 = torch.ops.aten.view.default(mul_tensor_7, [2, 4]);  mul_tensor_7 = None
    slice_tensor_5 = torch.ops.aten.slice.Tensor(view_default_21, 1, 0, 2);  view_default_21 = None
    clone_default_1 = torch.ops.aten.clone.default(slice_tensor_5, memory_format = torch.contiguous_format);  slice_tensor_5 = None
    sum_dim_int_list_1 = torch.ops.aten.sum.dim_IntList(clone_default_1, [0]);  clone_default_1 = None
    view_default_22 = torch.ops.aten.view.default(sum_dim_int_list_1, [1, 2]);  sum_dim_int_list_1 = None
    constant_pad_nd_default_3 = torch.ops.aten.constant_pad_nd.default(view_default_22, [0, 2], 0.0);  view_default_22 = None
    view_default_23 = torch.ops.aten.view.default(constant_pad_nd_default_3, [1, 1, 4]);  constant_pad_nd_default_3 = None
    abs_default_2 = torch.ops.aten.abs.default(view_default_23)
    amax_default_2 = torch.ops.aten.amax.default(abs_default_2, [2], True);  abs_default_2 = None
    div_tensor_5 = torch.ops.aten.div.Tensor(amax_default_2, 127.0);  amax_default_2 = None
    clamp_min_default_4 = torch.ops.aten.clamp_min.default(div_tensor_5, 1.1754943508222875e-38);  div_tensor_5 = None
    div_tensor_6 = torch.ops.aten.div.Tensor(view_default_23, clamp_min_default_4);  view_default_23 = None
    round_default_2 = torch.ops.aten.round.default(div_tensor_6);  div_tensor_6 = None
    clamp_min_default_5 = torch.ops.aten.clamp_min.default(round_default_2, -127.0);  round_default_2 = None
    clamp_max_default_2 = torch.ops.aten.clamp_max.default(clamp_min_default_5, 127.0);  clamp_min_default_5 = None
    convert_element_type_default_16 = torch.ops.prims.convert_element_type.default(clamp_max_default_2, torch.int8);  clamp_max_default_2 = None
    view_default_24 = torch.ops.aten.view.default(convert_element_type_default_16, [1, 4]);  convert_element_type_default_16 = None
    view_dtype_8 = torch.ops.aten.view.dtype(view_default_24, torch.uint8);  view_default_24 = None
    view_default_25 = torch.ops.aten.view.default(clamp_min_default_4, [1, 1]);  clamp_min_default_4 = None
    view_dtype_9 = torch.ops.aten.view.dtype(view_default_25, torch.int32);  view_default_25 = None
    bitwise_and_scalar_8 = torch.ops.aten.bitwise_and.Scalar(view_dtype_9, 255)
    convert_element_type_default_17 = torch.ops.prims.convert_element_type.default(bitwise_and_scalar_8, torch.uint8);  bitwise_and_scalar_8 = None
    unsqueeze_default_8 = torch.ops.aten.unsqueeze.default(convert_element_type_default_17, 2);  convert_element_type_default_17 = None
    bitwise_right_shift_tensor_scalar_6 = torch.ops.aten.bitwise_right_shift.Tensor_Scalar(view_dtype_9, 8)
    bitwise_and_scalar_9 = torch.ops.aten.bitwise_and.Scalar(bitwise_right_shift_tensor_scalar_6, 255);  bitwise_right_shift_tensor_scalar_6 = None
    convert_element_type_default_18 = torch.ops.prims.convert_element_type.default(bitwise_and_scalar_9, torch.uint8);  bitwise_and_scalar_9 = None
    unsqueeze_default_9 = torch.ops.aten.unsqueeze.default(convert_element_type_default_18, 2);  convert_element_type_default_18 = None
    bitwise_right_shift_tensor_scalar_7 = torch.ops.aten.bitwise_right_shift.Tensor_Scalar(view_dtype_9, 16)
    bitwise_and_scalar_10 = torch.ops.aten.bitwise_and.Scalar(bitwise_right_shift_tensor_scalar_7, 255);  bitwise_right_shift_tensor_scalar_7 = None
    convert_element_type_default_19 = torch.ops.prims.convert_element_type.default(bitwise_and_scalar_10, torch.uint8);  bitwise_and_scalar_10 = None
    unsqueeze_default_10 = torch.ops.aten.unsqueeze.default(convert_element_type_default_19, 2);  convert_element_type_default_19 = None
    bitwise_right_shift_tensor_scalar_8 = torch.ops.aten.bitwise_right_shift.Tensor_Scalar(view_dtype_9, 24);  view_dtype_9 = None
    bitwise_and_scalar_11 = torch.ops.aten.bitwise_and.Scalar(bitwise_right_shift_tensor_scalar_8, 255);  bitwise_right_shift_tensor_scalar_8 = None
    convert_element_type_default_20 = torch.ops.prims.convert_element_type.default(bitwise_and_scalar_11, torch.uint8);  bitwise_and_scalar_11 = None
    unsqueeze_default_11 = torch.ops.aten.unsqueeze.default(convert_element_type_default_20, 2);  convert_element_type_default_20 = None
    cat_default_4 = torch.ops.aten.cat.default([unsqueeze_default_8, unsqueeze_default_9, unsqueeze_default_10, unsqueeze_default_11], 2);  unsqueeze_default_8 = unsqueeze_default_9 = unsqueeze_default_10 = unsqueeze_default_11 = None
    view_default_26 = torch.ops.aten.view.default(cat_default_4, [1, 4]);  cat_default_4 = None
    cat_default_5 = torch.ops.aten.cat.default([view_dtype_8, view_default_26], 1);  view_dtype_8 = view_default_26 = None
    view_default_27 = torch.ops.aten.view.default(cat_default_5, [-1]);  cat_default_5 = None
    all_gather_into_tensor_default = torch.ops._c10d_functional.all_gather_into_tensor.default(view_default_27, 2, 'fsdp_graph:replicate:333da4cd2324');  view_default_27 = None
    wait_tensor_default_4 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default);  all_gather_into_tensor_default = None
    view_default_28 = torch.ops.aten.view.default(wait_tensor_default_4, [2, 8]);  wait_tensor_default_4 = None
    slice_tensor_6 = torch.ops.aten.slice.Tensor(view_default_28, 1, 0, 4)
    slice_tensor_7 = torch.ops.aten.slice.Tensor(view_default_28, 1, 4, 8);  view_default_28 = None
    view_default_29 = torch.ops.aten.view.default(slice_tensor_7, [2, 1, 4]);  slice_tensor_7 = None
    convert_element_type_default_21 = torch.ops.prims.convert_element_type.default(view_default_29, torch.int64);  view_default_29 = None
    select_int_8 = torch.ops.aten.select.int(convert_element_type_default_21, 2, 0)
    select_int_9 = torch.ops.aten.select.int(convert_element_type_default_21, 2, 1)
    mul_tensor_8 = torch.ops.aten.mul.Tensor(select_int_9, 256);  select_int_9 = None
    add_tensor_6 = torch.ops.aten.add.Tensor(select_int_8, mul_tensor_8);  select_int_8 = mul_tensor_8 = None
    select_int_10 = torch.ops.aten.select.int(convert_element_type_default_21, 2, 2)
    mul_tensor_9 = torch.ops.aten.mul.Tensor(select_int_10, 65536);  select_int_10 = None
    add_tensor_7 = torch.ops.aten.add.Tensor(add_tensor_6, mul_tensor_9);  add_tensor_6 = mul_tensor_9 = None
    select_int_11 = torch.ops.aten.select.int(convert_element_type_default_21, 2, 3);  convert_element_type_default_21 = None
    mul_tensor_10 = torch.ops.aten.mul.Tensor(select_int_11, 16777216);  select_int_11 = None
    add_tensor_8 = torch.ops.aten.add.Tensor(add_tensor_7, mul_tensor_10);  add_tensor_7 = mul_tensor_10 = None
    convert_element_type_default_22 = torch.ops.prims.convert_element_type.default(add_tensor_8, torch.int32);  add_tensor_8 = None
    view_dtype_10 = torch.ops.aten.view.dtype(convert_element_type_default_22, torch.float32);  convert_element_type_default_22 = None
    view_default_30 = torch.ops.aten.view.default(view_dtype_10, [2, 1, 1]);  view_dtype_10 = None
    view_dtype_11 = torch.ops.aten.view.dtype(slice_tensor_6, torch.int8);  slice_tensor_6 = None
    convert_element_type_default_23 = torch.ops.prims.convert_element_type.default(view_dtype_11, torch.float32);  view_dtype_11 = None
    view_default_31 = torch.ops.aten.view.default(convert_element_type_default_23, [2, 1, 4]);  convert_element_type_default_23 = None
    mul_tensor_11 = torch.ops.aten.mul.Tensor(view_default_31, view_default_30);  view_default_31 = view_default_30 = None
    view_default_32 = torch.ops.aten.view.default(mul_tensor_11, [2, 4]);  mul_tensor_11 = None
    slice_tensor_8 = torch.ops.aten.slice.Tensor(view_default_32, 1, 0, 2);  view_default_32 = None
    clone_default_2 = torch.ops.aten.clone.default(slice_tensor_8, memory_format = torch.contiguous_format);  slice_tensor_8 = None
    view_default_33 = torch.ops.aten.view.default(clone_default_2, [4]);  clone_default_2 = None
    slice_tensor_9 = torch.ops.aten.slice.Tensor(view_default_33, 0, 0, 3);  view_default_33 = None
    clone_default_3 = torch.ops.aten.clone.default(slice_tensor_9, memory_format = torch.contiguous_format);  slice_tensor_9 = None
    div_tensor = torch.ops.aten.div.Tensor(clone_default_3, 4);  clone_default_3 = None
    return (None, div_tensor)""",
    )
    steps = [
        (n.target, n.meta.get(META_ALL_REDUCE_STEP), n.meta[META_COMPRESSED])
        for n in bw.graph.nodes
        if n.target in COLLECTIVES
    ]
    assert steps == [(ALL_TO_ALL, None, ("int8", 24)), (ALL_TO_ALL, 1, ("int8", 12)), (ALL_GATHER, 2, ("int8", 12))]


def test_compressed_all_reduce_is_scheduled_like_an_all_reduce(fake_pg):
    """HYBRID, every group serial (gloo): each replica all-to-all stays in flight over the next unit's backward
    compute (its wait sinks to the next replica all-to-all), like the all-reduce it replaces; its all-gather follows
    the wait, and no group ever has two collectives in flight (`check_collectives`)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    hybrid = fsdp_graph.ShardingStrategy.HYBRID_SHARD
    model = fsdp_graph.fully_shard(TwoBlock(), init_device_mesh("cpu", (2, 2)), strategy=hybrid, reuse_blocks=False)
    bw = lower_fsdp_ops(aot_stages(model, torch.randn(2, 4), tag=tag_reshard).backward)
    state = model._fsdp_states[0]
    compress_collectives(bw, grads="int8", block_size=4, replica_sizes={state.replicate_group: 2})
    serial = frozenset({dist.group.WORLD.group_name, state.replicate_group, state.group_name})
    schedule_collectives(reduce_scatter_as_all_to_all(bw, serial), serial_groups=serial)
    check_collectives(bw, serial)
    lines = []
    for n in bw.graph.nodes:
        if n.target in COLLECTIVES:
            step = n.meta.get(META_ALL_REDUCE_STEP)
            lines.append(
                f"{n.target.__name__.split('.')[0]} {n.meta[META_UNIT] or '<root>'}" + (f" step {step}" if step else "")
            )
        elif n.target is WAIT:
            lines.append(f"  wait {n.args[0].target.__name__.split('.')[0]} {n.args[0].meta[META_UNIT] or '<root>'}")
        elif n.target is torch.ops.aten.mm.default and (not lines or lines[-1] != "  mm"):
            lines.append("  mm")
    assert_expected_inline(
        "\n".join(lines),
        """\
  mm
all_gather_into_tensor <root>
  wait all_gather_into_tensor <root>
  mm
all_gather_into_tensor blocks.1
  wait all_gather_into_tensor blocks.1
all_to_all_single <root>
  mm
  wait all_to_all_single <root>
all_to_all_single <root> step 1
all_to_all_single blocks.1
  mm
  wait all_to_all_single blocks.1
  wait all_to_all_single <root>
all_gather_into_tensor <root> step 2
  wait all_gather_into_tensor <root>
all_to_all_single blocks.1 step 1
all_to_all_single blocks.0
  wait all_to_all_single blocks.0
  wait all_to_all_single blocks.1
all_gather_into_tensor blocks.1 step 2
  wait all_gather_into_tensor blocks.1
all_to_all_single blocks.0 step 1
  wait all_to_all_single blocks.0
all_gather_into_tensor blocks.0 step 2
  wait all_gather_into_tensor blocks.0""",
    )


def test_backend_compresses_replica_all_reduces_and_checks_units(fake_pg):
    """NO_SHARD: each unit's gradient all-reduce over the world (4 replicas) is compressed, no longer refused;
    `explain` counts its two collectives as sending what the ring all-reduce would have."""
    torch.manual_seed(0)
    model = fsdp_graph.fully_shard(TwoBlock(), strategy=fsdp_graph.ShardingStrategy.NO_SHARD)
    x = torch.randn(2, 4)
    plain = fsdp_graph.explain(model, x, hardware="nvlink")
    packed = fsdp_graph.explain(model, x, hardware="nvlink", compress="grads=int8,block=4")
    kinds = [
        (n.target, n.args[0].meta["val"].dtype)
        for g in packed.graphs
        for n in g.graph.graph.nodes
        if n.target in COLLECTIVES
    ]
    assert kinds == [(ALL_TO_ALL, torch.uint8), (ALL_GATHER, torch.uint8)] * 3, kinds
    assert packed.compression.collectives == 6
    assert packed.compression.uncompressed_sent_bytes == pytest.approx(plain.sent_bytes)
    assert packed.sent_bytes == pytest.approx(packed.compression.sent_bytes)
    assert packed.sent_bytes < plain.sent_bytes
    units = fsdp_graph.make_backend(inductor=False, compress=fsdp_graph.Compression(units=("block.0",)))
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"no such unit in this model; its units are \['', 'blocks.0', 'blocks.1'\]"):
        torch.compile(fsdp_graph.fully_shard(TwoBlock()), backend=units, fullgraph=True)(torch.randn(2, 4))


def test_explain_counts_compressed_bytes_and_codec_work(fake_pg):
    from tests.graphs.test_cost import _ce, _gpt

    model, idx = _gpt()
    plain = fsdp_graph.explain(model, idx, loss_fn=_ce(idx), hardware="nvlink")
    packed = fsdp_graph.explain(model, idx, loss_fn=_ce(idx), hardware="nvlink", compress="int8")
    cost = packed.compression
    assert plain.compression.collectives == 0 and "compressed" not in plain.to_text()
    assert cost.schemes == {"int8"} and cost.collectives == 9  # per unit: a gather, a re-gather, a reduction
    assert cost.uncompressed_sent_bytes == pytest.approx(plain.sent_bytes)
    assert cost.sent_bytes == pytest.approx(packed.sent_bytes) and 0.25 < cost.sent_bytes / plain.sent_bytes < 0.3
    assert cost.codec_seconds > 0 and packed.forward.compute_time > plain.forward.compute_time
    assert [(r.gathers, r.reduce_scatters) for r in packed.units] == [
        (r.gathers, r.reduce_scatters) for r in plain.units
    ]
    assert "compressed (int8): 9 collectives send" in packed.to_text()
