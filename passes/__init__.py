"""Pure FX passes of fsdp_graph. They meet the runtime only through `fsdp_graph.ir` (DESIGN §3)."""

from passes.all_to_all import reduce_scatter_as_all_to_all
from passes.bucket import bucket_collectives
from passes.collective_counts import collective_summary
from passes.compress import compress_collectives
from passes.conjugates import materialize_conjugates
from passes.dedup import dedup_unshard
from passes.fingerprint import collective_fingerprint
from passes.flat_grad import cat_flat_grads
from passes.grad_reads import gathered_reads
from passes.group_names import rename_groups
from passes.lower import lower_fsdp_ops
from passes.region_mutation import lift_region_mutations
from passes.reshard import tag_reshard
from passes.schedule import schedule_collectives
from passes.verify import check_collectives

__all__ = [
    "bucket_collectives",
    "cat_flat_grads",
    "check_collectives",
    "collective_fingerprint",
    "collective_summary",
    "compress_collectives",
    "dedup_unshard",
    "gathered_reads",
    "lift_region_mutations",
    "lower_fsdp_ops",
    "materialize_conjugates",
    "reduce_scatter_as_all_to_all",
    "rename_groups",
    "schedule_collectives",
    "tag_reshard",
]
