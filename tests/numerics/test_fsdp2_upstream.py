"""Issues 28 and 32: torch's own FSDP2 tests (test/distributed/_composable/fsdp/ in pytorch), re-created on
`fsdp_graph.fsdp2` (written here, not copied): upstream's models (torch's test Transformer and MLP from
torch.testing._internal, or the test's own module), calls and assertions; SGD with momentum where upstream uses Adam
(the project's rule), fewer steps where a check says so, world 2. The checks run in two spawns of 2 gloo ranks
(tests/workers/fsdp2_upstream*.py: the training checks, then the others; one spawn would pass pytest's 600 s
timeout on a loaded machine); the ones that train run eager and compiled (fsdp_backend, fullgraph, inductor=False).
Every re-created check passes on torch's FSDP2 on CPU with gloo
(`tests.workers.fsdp2_upstream.upstream_checks_on_torch_fsdp2` runs them with torch's `fully_shard`). A check that
fails today because of a bug being fixed is `xfail(strict=True)` naming the issue item; it turns into a failure
when fixed, and the mark goes.

Assertions on FSDP2 internals made through public means: the reduce-scatter numel and post-backward counts of
test_fully_shard_frozen (frozen parameters get no gradient instead); `param_group.is_unsharded` of
test_partial_group_reshard_toggle (parameters are DTensors again after `reshard()`); parameters read after
`unshard()` (`full_tensor()`); `check_sharded_parity` (`full_tensor()` of parameters and gradients).

Re-created, upstream file -> test id here ([eager|compiled] where it trains):
- test_fully_shard_training.py: test_root_move_forward_input_to_device, test_root_no_forward_inputs
  (root_no_forward_inputs), test_param_registration_after_forward, test_param_registration_after_backward,
  test_to_float64_after_init (train_parity[to_float64-*]), test_train_parity_single_group_shard_dim0
  (train_parity_single_group), test_train_parity_single_group_shard_largest_dim (train_parity_shard_largest_dim),
  test_train_parity_multi_group, test_train_parity_multi_group_cpu_offload_eager (eager_train_parity[cpu_offload]),
  test_train_parity_multi_group_unshard_async_op, test_non_root_forward_backward, test_multi_forward_module,
  test_explicit_prefetching, test_train_parity_with_activation_checkpointing,
  test_partial_group_forward_then_standalone (+ its output_dtype modes), test_grouped_module_cast_forward_inputs,
  test_partial_group_forward_grad_accum_chunked, test_partial_group_reshard_toggle,
  test_reset_iter_state_after_exception, test_double_forward_with_nested_fsdp_and_checkpoint,
  test_double_partial_forward_then_backward, test_train_parity_shard_placement_fn_shard_largest_dim,
  test_shard_placement_fn_contiguous_params_grads, test_train_parity_with_shared_params,
  test_train_shared_params_uneven_shard, test_shared_params_separate_fsdp_groups_error,
  test_layer_by_layer_shard_no_false_positive, test_gradient_accumulation (gradient_accumulation: mode "all";
  _comm_counts: CommDebugMode's counts; _partial_sync: modes "root_only"/"some_mlps"; also
  train_parity[grad_accumulation-*] compiled), test_1f1b_microbatching, test_register_fsdp_forward_method.
- test_fully_shard_autograd.py: test_unused_forward_output, test_unused_forward_module, test_nontensor_activations,
  test_post_acc_grad_hook_runs, test_post_acc_grad_hook_optim_parity.
- test_fully_shard_frozen.py: test_train_mixed_requires_grad_per_group (+ _freeze_after_init),
  test_train_mixed_requires_grad_across_groups, test_multi_forward_mixed_requires_grad.
- test_fully_shard_ignore_params.py: test_ddp_A_fsdp_B_ddp_C (with DDP over the sharded model).
- test_fully_shard_clip_grad_norm_.py: test_clip_grad_norm_1d.
- test_fully_shard_mixed_precision.py: test_compute_dtype (mixed_precision_compute_dtype_matches_fsdp2),
  test_grad_acc_with_reduce_dtype, test_float16_on_one_submodule (+ _output_dtype: its third subtest),
  test_submodules_with_external_inputs, test_norm_modules_fp16/_bf16 (norm_modules, without the output_dtype case).
- test_fully_shard_state_dict.py: test_dp_state_dict_save_load (+ _largest_dim), test_cached_state_dict,
  test_dp_state_dict_cpu_offload.
- test_fully_shard_init.py: test_shard_tensor_parameters, test_raise_scalar_parameter and test_invalid_mesh_ndim
  (init_errors: the error types), test_invalid_shard_dim,
  test_reset_sharded_param_in_lazy_init, test_meta_device_1d_init, test_invalid_meta_device_init,
  test_rank0_broadcast_meta_device_init, test_old_import_training, TestFullyShardCls (fully_shard_cls).

Not re-created, and why:
- Need 4 or 8 ranks, or tensor parallelism over them (a second spawn costs more than it adds; the native HSDP and TP
  paths are tested in test_strategies.py and test_tensor_parallel.py): TestFullyShardHSDPTraining,
  TestFullyShardNDTraining, TestFullyShardHSDP3DTraining, test_gradient_accumulation's HSDP mesh,
  test_clip_grad_norm_2d, test_2d/dp_tp/hsdp_tp state-dict tests, test_shard_dtensor_parameters,
  test_meta_device_2d_init, TestFullyShardProcessGroupInit, TestFullyShardHSDPBroadcast, TestHSDPWithCustomHook,
  test_init_2d_transformer_shard_diff_dim, test_shard_placement_fn_tp_ep. World 1: TestFullyShardWorldSize1.
- CUDA only (streams, events, graphs, pinned memory, moves to the accelerator): test_post_optim_event,
  TestFullyShardCudaGraph, TestFullyShardShareCommContext, test_rank0_offload_full_state_dict,
  TestFullyShardDeviceTensor, test_cached_state_dict with a CPU->CUDA move, TestFullyShardMixedPrecisionJVP.
- test_raise_noncontiguous_parameter: FSDP2 refuses a channels_last parameter for lack of support; fsdp_graph
  accepts it.
- FSDP2's private state or functions only: test_modules_to_run_forward_empty_for_single_module,
  TestFullyShardManagedModulesAndStates, TestFullyShardParamModuleInfos, TestFullyShardLazyInit's _lazy_init tests,
  test_reduce_dtype_after_frozen_first_forward, test_2d_mesh_without_mesh_dim_names (FSDP2's AssertionError text).
- bf16 reduce-scatter numerics compared with NCCL's (upstream: NCCL only): test_reduce_dtype, test_clamp_reduce_dtype,
  test_structured_input_output's bf16 reductions, test_checkpoint_recompute_casts_*.
"""

import pytest

from fsdp_graph.train.launch import spawn
from tests.workers.fsdp2_upstream import CHECKS, MODES, upstream_checks
from tests.workers.upstream_registry import EAGER, TRAINED

_DOC = "documented difference (docs/migrating-from-fsdp2.md)"
XFAIL: dict[str, str] = {
    "reset_sharded_param_in_lazy_init": f"{_DOC}: a parameter replaced by a new nn.Parameter after the calls is not "
    "adopted; the forward refuses it, naming it, while its shard is on meta",
    "gradient_accumulation_partial_sync": f"{_DOC}: set_requires_gradient_sync on part of the model is refused",
}


@pytest.fixture(scope="module")
def trained():
    return spawn(upstream_checks, 2, ("trained",))


@pytest.fixture(scope="module")
def results():
    return spawn(upstream_checks, 2, ("eager",))


def _each(results, name: str):
    for r in results:
        assert "error" not in r[name], r[name].get("error")
        yield r[name]


def _marked(names: list[str]) -> list:
    return [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=XFAIL[n])) if n in XFAIL else n for n in names]


def _holds(name: str, r: dict[str, float]) -> None:
    """Every `*diff*` value under 1e-5 (losses and gradients relative where above 1), every other value 1.0 (an
    assertion that held), one graph where compiled."""
    assert r, name
    for key, value in r.items():
        if "diff" in key:
            assert value < 1e-5, (name, key, r)
        else:
            assert value == 1.0, (name, key, r)


@pytest.mark.parametrize("name", _marked([f"{n}[{m}]" for m in MODES for n in TRAINED]))
def test_upstream_trained(trained, name):
    for r in _each(trained, name):
        _holds(name, r)


@pytest.mark.parametrize("name", _marked(list(EAGER)))
def test_upstream_eager(results, name):
    for r in _each(results, name):
        _holds(name, r)


PARITY = [f"{name}[{mode}]" for mode in MODES for name in CHECKS if name != "mixed_precision"]


@pytest.mark.parametrize("name", PARITY)
def test_train_parity(trained, name):
    for r in _each(trained, name):
        loss_keys = [k for k in r if k.startswith("loss_diff")]
        assert loss_keys, r
        for key in loss_keys:
            suffix = key[len("loss_diff") :]
            assert r[key] < 1e-5 and r[f"param_diff{suffix}"] < 1e-5, (key, r)
            assert r[f"moved{suffix}"] == 1.0 and r[f"dtensors{suffix}"] == 1.0, r  # FSDP2's parameters: DTensors
            if name.endswith("[compiled]"):  # one graph; accumulation: first, middle, last microbatch, once each
                assert r[f"graphs{suffix}"] == (3.0 if name.startswith("grad_accumulation") else 1.0), r
        if "dtype_kept" in r:
            assert r["dtype_kept"] == 1.0, r


@pytest.mark.parametrize("mode", MODES)
def test_mixed_precision_compute_dtype_matches_fsdp2(trained, mode):
    for r in _each(trained, f"mixed_precision[{mode}]"):
        assert r["out_bf16"] == 1.0 and r.get("graphs", 1.0) == 1.0, r
        assert r["loss_diff"] < 1e-6 and r["param_diff"] < 1e-6, r


def test_eager_train_parity_cpu_offload(results):
    for r in _each(results, "cpu_offload"):
        assert r["loss_diff"] < 1e-5 and r["param_diff"] < 1e-5 and r["moved"] == 1.0, r


def test_root_no_forward_inputs(results):
    for r in _each(results, "no_forward_inputs"):
        assert r["shape"] == 1.0 and r["out_diff"] < 1e-6 and r["grad_diff"] < 1e-6, r


def test_fully_shard_cls(results):
    for r in _each(results, "classes"):
        assert all(v == 1.0 for v in r.values()), r


def test_state_dict_round_trip(results):
    for r in _each(results, "state_dict"):
        assert r["keys"] == 1.0 and r["dtensors"] == 1.0, r
        assert r["full_diff"] == 0.0 and r["load_diff"] == 0.0, r
