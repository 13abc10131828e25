"""Planning and measurement: `explain()`'s cost model report, its picture, and executed-collective counters."""
