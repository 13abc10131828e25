"""The user API: `fully_shard`, its configuration and wrap policies, and the controls users call on a sharded model."""
