"""The re-created FSDP2 tests of issue 32 by name: TRAINED checks take a mode (eager or compiled), EAGER ones not.
The names are the pytest ids of tests/numerics/test_fsdp2_upstream.py."""

from __future__ import annotations

from collections.abc import Callable

from tests.workers import fsdp2_upstream_autograd as autograd
from tests.workers import fsdp2_upstream_compose as compose
from tests.workers import fsdp2_upstream_extra as extra
from tests.workers import fsdp2_upstream_mp as mp
from tests.workers import fsdp2_upstream_state as state
from tests.workers import fsdp2_upstream_train as train

TRAINED: dict[str, Callable[..., dict[str, float]]] = {
    "train_parity_single_group": train.train_parity_single_group,
    "train_parity_shard_largest_dim": train.train_parity_shard_largest_dim,
    "train_parity_multi_group": train.train_parity_multi_group,
    "multi_forward_module": train.multi_forward_module,
    "train_parity_with_activation_checkpointing": train.train_parity_with_activation_checkpointing,
    "train_parity_with_shared_params": train.train_shared_params,
    "unused_forward_output": autograd.unused_forward_output,
    "unused_forward_module": autograd.unused_forward_module,
    "nontensor_activations": autograd.nontensor_activations,
    "train_mixed_requires_grad_per_group": state.mixed_requires_grad_per_group,
}

EAGER: dict[str, Callable[..., dict[str, float]]] = {
    "root_move_forward_input_to_device": train.root_move_forward_input,
    "param_registration_after_forward": train.param_registration_after_forward,
    "param_registration_after_backward": train.param_registration_after_backward,
    "train_parity_multi_group_unshard_async_op": train.train_parity_unshard_async_op,
    "non_root_forward_backward": train.non_root_forward_backward,
    "explicit_prefetching": train.explicit_prefetching,
    "train_shared_params_uneven_shard": train.train_shared_params_uneven_shard,
    "shared_params_separate_fsdp_groups_error": train.shared_params_separate_groups_error,
    "layer_by_layer_shard_no_false_positive": train.layer_by_layer_shard,
    "train_parity_shard_placement_fn_shard_largest_dim": train.shard_placement_fn_largest_dim,
    "shard_placement_fn_contiguous_params_grads": train.shard_placement_fn_contiguous,
    "register_fsdp_forward_method": train.register_fsdp_forward_method,
    "partial_group_forward_then_standalone": compose.partial_group_forward_then_standalone,
    "partial_group_forward_then_standalone_output_dtype": compose.partial_group_output_dtype,
    "grouped_module_cast_forward_inputs": compose.grouped_module_cast_forward_inputs,
    "partial_group_forward_grad_accum_chunked": compose.partial_group_grad_accum_chunked,
    "partial_group_reshard_toggle": compose.partial_group_reshard_toggle,
    "reset_iter_state_after_exception": compose.reset_iter_state_after_exception,
    "double_forward_with_nested_fsdp_and_checkpoint": compose.double_forward_nested_checkpoint,
    "double_partial_forward_then_backward": compose.double_partial_forward_then_backward,
    "gradient_accumulation": compose.gradient_accumulation,
    "gradient_accumulation_comm_counts": compose.gradient_accumulation_comm_counts,
    "gradient_accumulation_partial_sync": compose.partial_gradient_sync,
    "1f1b_microbatching": compose.one_f_one_b_microbatching,
    "post_acc_grad_hook_runs": autograd.post_acc_grad_hook_runs,
    "post_acc_grad_hook_optim_parity": autograd.post_acc_grad_hook_optim_parity,
    "train_mixed_requires_grad_per_group_freeze_after_init": state.mixed_requires_grad_freeze_after_init,
    "train_mixed_requires_grad_across_groups": state.mixed_requires_grad_across_groups,
    "multi_forward_mixed_requires_grad": state.multi_forward_mixed_requires_grad,
    "dp_state_dict_save_load": state.dp_state_dict_save_load,
    "dp_state_dict_save_load_largest_dim": state.dp_state_dict_largest_dim,
    "cached_state_dict": state.cached_state_dict,
    "dp_state_dict_cpu_offload": state.dp_state_dict_cpu_offload,
    "shard_tensor_parameters": state.shard_tensor_parameters,
    "clip_grad_norm_1d": extra.clip_grad_norm_1d,
    "ddp_A_fsdp_B_ddp_C": extra.ddp_a_fsdp_b_ddp_c,
    "init_errors": state.init_errors,
    "invalid_shard_dim": state.invalid_shard_dim,
    "reset_sharded_param_in_lazy_init": state.reset_sharded_param_in_lazy_init,
    "meta_device_1d_init": state.meta_device_1d_init,
    "invalid_meta_device_init": state.invalid_meta_device_init,
    "rank0_broadcast_meta_device_init": state.rank0_broadcast_meta_device_init,
    "old_import_training": state.old_import_training,
    "float16_on_one_submodule": mp.float16_on_one_submodule,
    "float16_on_one_submodule_output_dtype": mp.float16_output_dtype,
    "submodules_with_external_inputs": mp.submodules_with_external_inputs,
    "norm_modules": mp.norm_modules,
    "grad_acc_with_reduce_dtype": mp.grad_acc_with_reduce_dtype,
}
