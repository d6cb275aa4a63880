"""The DeepSpeed baseline's benchmarks (:mod:`.traffic`: bytes per link class); the runner
itself is megatron_lbp/deepspeed_baseline."""
