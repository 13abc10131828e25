"""IR constants shared by the runtime and `passes/` (DESIGN §3). Passes import only this module.

Node meta keys set by passes are namespaced `fsdp_*`:
- `fsdp_unit`: the unit FQN a lowered collective (or its cast / wait / scale) belongs to.
- `fsdp_role`: "unshard" or "reduce_grad" on every node a lowering produced.
- `fsdp_bucket`: on every node `passes.bucket` creates, the tuple of the merged units' FQNs in graph order; their
  `fsdp_unit` is those names joined by "+" (the root's "" included, so "+blocks.1" is the root and blocks.1).
- `fsdp_compressed`: on every node `passes.compress` creates, (scheme, bytes the uncompressed collective moved);
  the scheme reads "fp8 per row" where fp8 takes one scale per row of each parameter (the rows layout).
- `fsdp_all_reduce_step`: on the two collectives `passes.compress` puts in place of a gradient all-reduce, 1 on its
  all-to-all (the reduce half), 2 on its all-gather (the gather half); the scheduler treats them as an all-reduce.
"""

from __future__ import annotations

import torch

from fsdp_graph.ir import ops as _ops  # noqa: F401  (registers the fsdp:: ops)
from fsdp_graph.ir.ops import (  # noqa: F401  (the reduction's arithmetic, shared with passes)
    gradient_divide_factors,
    reduction_divisors,
)

UNSHARD = torch.ops.fsdp.unshard.default
REDUCE_GRAD = torch.ops.fsdp.reduce_grad.default
UNSHARD_TARGETS = (UNSHARD, torch.ops.fsdp.unshard)
REDUCE_GRAD_TARGETS = (REDUCE_GRAD, torch.ops.fsdp.reduce_grad)
# The rows layout's copy-out of one parameter from a gathered flat (`RowShardLayout.param_of`).
ROWS_COPY_OUT = torch.ops.fsdp.rows_copy_out.default
ROWS_COPY_OUT_TARGETS = (ROWS_COPY_OUT, torch.ops.fsdp.rows_copy_out)

C10D = torch.ops._c10d_functional
ALL_GATHER = C10D.all_gather_into_tensor.default
REDUCE_SCATTER = C10D.reduce_scatter_tensor.default
ALL_REDUCE = C10D.all_reduce.default
ALL_TO_ALL = C10D.all_to_all_single.default
WAIT = C10D.wait_tensor.default
COLLECTIVES = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL)

META_UNIT = "fsdp_unit"
META_ROLE = "fsdp_role"
META_BUCKET = "fsdp_bucket"
META_COMPRESSED = "fsdp_compressed"
META_ALL_REDUCE_STEP = "fsdp_all_reduce_step"
ROLE_UNSHARD = "unshard"
ROLE_REDUCE = "reduce_grad"
# meta["custom"] (torch.fx.traceback.annotate) of a parameter read inside a reused block's body (`reuse_blocks`).
REGION_PARAM_ANNOTATION = {"fsdp_graph": "region_param"}

# The ops' arguments, derived from their registered schemas (fsdp_graph/ir/ops.py defines each op once).
UNSHARD_SIGNATURE = _ops.UNSHARD_SIGNATURE
REDUCE_SIGNATURE = _ops.REDUCE_SIGNATURE
UNSHARD_ARGS = UNSHARD_SIGNATURE.names
REDUCE_ARGS = REDUCE_SIGNATURE.names
UNSHARD_DEFAULTS = UNSHARD_SIGNATURE.defaults
REDUCE_DEFAULTS = REDUCE_SIGNATURE.defaults
