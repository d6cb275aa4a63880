"""The one-GPU check: ``python -m megatron_lbp.gpu_check`` (runner.py), parts A-E (part_*.py).

What each part proves and cannot prove, and what has run where: docs/gpu.md.
"""
