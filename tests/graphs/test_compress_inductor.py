"""The block quantizers (`passes.quantize`) under Inductor, in one process: the bits the ranks' compiled kernels
give (the multi-rank runs of compression: tests/numerics/test_compress.py)."""

import pytest
import torch

from passes.quantize import pack_rows, unpack_rows


@pytest.mark.oldest_torch
def test_inductor_round_trips_give_the_eager_quantizers_bits():
    """Inductor's kernels (as `make_backend` runs them) give the eager quantizers' bits, one compile for every case:
    - a padded last block (1000 = 15 blocks of 64 + a padded one), which used to get garbage scales under Inductor
      (a sliced uint8 -> float32 bitcast), int8 and int4 (whose codes go through int8);
    - one row of one block (a norm weight's shard under 8 ranks), whose (1, 1) scale torch 2.11's Inductor refused
      to bitcast to bytes (stride 0; first seen on an H200), now packed to eager's bytes."""
    x = torch.randn(2, 1000) * torch.logspace(-3, 3, 2)[:, None]
    small = torch.randn(1, 8)

    def cases(t: torch.Tensor, s: torch.Tensor) -> list[torch.Tensor]:
        rows = [unpack_rows(pack_rows(t, 2, 1000, q, 64), 2, 1000, torch.float32, q, 64) for q in ("int8", "int4")]
        packed = pack_rows(s * 2, 1, 8, "int8", 256)
        return [*rows, packed, unpack_rows(packed, 1, 8, torch.float32, "int8", 256)]

    torch._dynamo.reset()
    compiled, eager = torch.compile(cases, backend="inductor", fullgraph=True)(x, small), cases(x, small)
    assert [torch.equal(c, e) for c, e in zip(compiled, eager)] == [True] * 4
    assert (eager[3] - 2 * small).abs().max() <= 2 * small.abs().max() / 127
