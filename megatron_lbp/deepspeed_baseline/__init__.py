"""DeepSpeed ZeRO-3 / ZeRO++ as a baseline beside lbp, on the same megatron-core GPT and data.

- :mod:`.schemes`: the named schemes (``ds-zero3``, ``ds-hpz``, ``ds-zeropp``) as
  DeepSpeed configs; no DeepSpeed import.
- :mod:`.environment`: what DeepSpeed needs set before it is imported on CPU ranks.
- :mod:`.cpu_quantizer`: the one CPU-only adaptation (qwZ/qgZ's quantizer op).
- :mod:`.trainer`: a megatron-core GPT under ``deepspeed.initialize``, trained with the
  same loop, batches and optimizer maths as the project's stock-Megatron yardstick.
- :mod:`.pretrain`: the command-line runner (Megatron's flags and indexed dataset).

DeepSpeed is a test/benchmark dependency (``scripts/install.sh --test``), imported only
when a runner starts; the launcher runs ``python -m megatron_lbp.deepspeed_baseline.pretrain``
for HIER_PRESET=ds-*.
"""
