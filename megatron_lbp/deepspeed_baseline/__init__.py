"""DeepSpeed ZeRO-3 / ZeRO++ as a baseline beside lbp, on the same megatron-core GPT and data.

:mod:`.schemes` (the configs, no DeepSpeed import), :mod:`.environment` (set before
DeepSpeed is imported), :mod:`.cpu_quantizer` (the one CPU-only adaptation),
:mod:`.trainer` (the GPT under ``deepspeed.initialize``, step for step like the stock
yardstick), :mod:`.pretrain` (the command-line runner). DeepSpeed is a test and benchmark
dependency (``scripts/install.sh --test``), imported only when a runner starts.
"""
