"""State: sharded and full state dicts, optimizer state dicts, and DCP checkpoints."""
