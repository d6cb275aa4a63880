"""The README's main job: `python -m megatron_lbp.demo`."""
