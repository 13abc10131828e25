"""Pure FX passes of fsdp_graph. They meet the runtime only through `fsdp_graph.ir` (DESIGN §3)."""

from passes.dedup import dedup_unshard
from passes.inspect import collective_summary
from passes.lower import lower_fsdp_ops
from passes.reshard import tag_reshard

__all__ = ["collective_summary", "dedup_unshard", "lower_fsdp_ops", "tag_reshard"]
