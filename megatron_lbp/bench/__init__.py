"""Benchmarks: each subcommand measures side by side in one run and can print --json."""
