"""Continued pretraining from a Hugging Face model: import, export, and the mapping between them.

    python -m megatron_lbp.hf import HF_DIR OUT_DIR     # -> OUT_DIR/release + megatron_args.txt
    python -m megatron_lbp.hf export RUN_DIR OUT_HF_DIR --hf-files OUT_DIR/hf

Modules: ``arch`` (config.json -> what Megatron builds, its flags, refusals),
``mapping`` (names and layouts), ``reader`` (HF weights one tensor at a time),
``dcp_write``/``dcp_read`` (torch_dist written and read a piece at a time),
``importer``, ``exporter``. Nothing here imports transformers.
"""
