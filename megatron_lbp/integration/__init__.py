"""megatron-core plugged in: adapter, training hooks, runtime patches, the entry's checks."""
