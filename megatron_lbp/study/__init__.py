"""The adoption study: one result file per training run (``result``), one report over a
directory of them (``report``), the list of runs a study submits (``plan``).

``python -m megatron_lbp.study report DIR`` and ``python -m megatron_lbp.study plan ...``.
"""
