"""What the launcher and the study need at run time from the benchmarks: the schedule-trace format
and reader (trace), the replay of a traced program at other link and compute figures (replay,
project_replay), the Frontier cost model (project) and the committed traces it replays (traces/).
The benchmarks that measure (link traffic, overhead, the emulated network, the report) live in the
repository's top-level ``benchmarks/`` folder, which is not installed with the package."""
