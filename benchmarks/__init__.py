"""Benchmark code kept outside the runtime package: importing megatron_lbp never needs it."""
