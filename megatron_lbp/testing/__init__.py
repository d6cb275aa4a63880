"""Helpers for running megatron-lbp on real gloo ranks (tests and benchmarks)."""
