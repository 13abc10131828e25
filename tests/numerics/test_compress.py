"""`make_backend(compress=...)` on 2 and 4 gloo ranks against a single-process reference that quantizes the same way."""

from fsdp_graph.train.launch import spawn
from tests.workers.compression import CompressCase, run_cases


def test_compressed_gathers_and_gradients_match_a_quantizing_reference():
    cases = [
        CompressCase("FULL_SHARD", "int8", "int8"),
        CompressCase("SHARD_GRAD_OP", "fp8", "int4"),
        CompressCase("FULL_SHARD", None, None),
        CompressCase("HYBRID_SHARD", "int8", "int8"),  # a (2, 1) mesh: the replica all-reduce alone
    ]
    full, zero2, plain, hybrid = spawn(run_cases, 2, (cases,))[0]
    for r in (full, zero2, plain, hybrid):
        # Eager kernels: the graph runs the reference's quantizers on the same values, so 3 SGD steps agree exactly.
        assert r.max_grad_diff == 0 and r.max_param_diff == 0 and r.max_loss_diff < 1e-6, r
    for r in (full, zero2, hybrid):
        assert r.max_uncompressed_gap > 1e-3, r  # the quantization is visible: the comparison is not vacuous
        assert all("uint8" in line for line in r.gathered_dtypes), r.gathered_dtypes
    assert plain.max_uncompressed_gap == 0
    # Codes and scales (blocks of 64) against fp32: int8 ~0.27x; int4 gradients without re-gathers, less.
    assert full.collective_bytes / plain.collective_bytes < 0.30
    assert zero2.collective_bytes < full.collective_bytes


def test_compression_on_four_ranks_hybrid_and_secondary_copies_match_a_quantizing_reference():
    """4 ranks, what 2 cannot show: HYBRID_SHARD on a (2, 2) mesh (quantized reduce-scatter in each replica, then
    the quantized all-reduce across them); NO_SHARD (that all-reduce alone, over the world, with padding);
    FULL_SHARD with `reshard_after_forward=2`, against the same reference as FULL_SHARD: its node gather re-packs
    each shard's blocks, so the weights are quantized once."""
    # FULL_SHARD int8 and SHARD_GRAD_OP fp8/int4 on 4 ranks ran the 2-rank test's cases on more shards (the same
    # code paths): covered by test_compressed_gathers_and_gradients_match_a_quantizing_reference.
    cases = [
        CompressCase("HYBRID_SHARD", "int8", "int8", steps=2),
        CompressCase("FULL_SHARD", "int8", "int8", steps=2, reshard_after_forward=2),
        # The all-reduce over 4 replicas; layers.1's 154 elements are padded to 4 pieces of 39.
        CompressCase("NO_SHARD", None, "int4", steps=2, model="mlp"),
    ]
    results = spawn(run_cases, 4, (cases,))[0]
    for r in results:
        assert r.max_grad_diff == 0 and r.max_param_diff == 0 and r.max_loss_diff < 1e-6, r
        assert r.max_uncompressed_gap > 1e-3, r
        assert all("uint8" in line for line in r.gathered_dtypes), r.gathered_dtypes
