"""Sharded training on 2 gloo ranks equals single-process full-batch training (DESIGN §7)."""

import pytest

from fsdp_graph.train.launch import spawn
from tests.workers.training import Case, run_cases

PARAM_TOL = 2e-5  # fp32 noise after 5 steps (measured 3.7e-7 GPT/AdamW, 1e-7 MLP/SGD)
LOSS_TOL = 2e-5


def _check(cases: list[Case]) -> None:
    results = spawn(run_cases, 2, (cases,))
    for rank_results in results:
        for r in rank_results:
            loss_gap = max(abs(a - b) for a, b in zip(r.losses, r.ref_losses))
            assert r.max_param_diff < PARAM_TOL and loss_gap < LOSS_TOL, (r.case, r.max_param_diff, loss_gap)
            assert r.param_change > 1e-3, (r.case, r.param_change)  # it trained
            # On a GPU torch's optimizers and clip take their multi-tensor kernels for our parameters, as for plain
            # ones: before, the views' type made every optimizer step launch kernels one tensor at a time.
            assert r.foreach_by_default, r.case
            if r.case.mode != "eager":
                assert r.dynamo_graphs == 1, (r.case, r.dynamo_graphs)


@pytest.mark.oldest_torch
def test_compiled_full_shard():
    _check(
        [
            # One optimizer per model: the optimizer runs outside the graph on the sharded parameters, so a second
            # one compiles the same graph. GPT + SGD momentum: test_strategies.py's bf16, frozen and dynamic cases;
            # MLP + AdamW: test_eager_path (size-wrapped). The foreach and fused kernels (a GPU's defaults) write
            # the flat shards through the views as the per-tensor ones do.
            Case("gpt", "adamw"),
            Case("mlp", "sgd_foreach"),
            Case("conv", "adamw_fused"),
        ]
    )


@pytest.mark.oldest_torch
def test_compiled_shard_grad_op():
    _check(
        [
            Case("gpt", "adamw", "SHARD_GRAD_OP"),
            # The MLP: test_inductor's case (the same passes, then Inductor).
            Case("conv", "sgd", "SHARD_GRAD_OP"),
        ]
    )


@pytest.mark.oldest_torch
def test_eager_path():
    _check(
        [
            Case("gpt", "adamw_foreach", mode="eager"),
            Case("mlp", "sgd", mode="eager"),
            Case("conv", "adamw", "SHARD_GRAD_OP", mode="eager"),
            Case("mlp", "adamw", mode="eager", wrap="size"),
        ]
    )


def test_batchnorm_buffers_follow_ddp_semantics():
    """BatchNorm uses local batch statistics, so the reference is DDP on the same local batches
    (broadcast_buffers=False): parameters and each rank's running stats must match it."""
    _check(
        [
            Case("bn", reference="ddp"),
            Case("bn", "sgd", "SHARD_GRAD_OP", reference="ddp"),
            Case("bn", mode="eager", reference="ddp"),
        ]
    )


@pytest.mark.slow
def test_inductor():
    """SHARD_GRAD_OP through full Inductor on a small model. FULL_SHARD under Inductor is
    tests/numerics/test_hf_models.py::test_gpt2_eager_kernels_and_llama_inductor_train_with_parity (a transformer), tensor parallel under Inductor is
    test_tensor_parallel.py's inductor case, and the prefetch order under Inductor tests/graphs/test_inductor_order.py's: each cold
    Inductor compile costs the 2-core suite tens of seconds, so each covers what the others do not."""
    _check([Case("mlp", "sgd", "SHARD_GRAD_OP", mode="inductor")])
