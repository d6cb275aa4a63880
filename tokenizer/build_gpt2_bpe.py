"""`python tokenizer/build_gpt2_bpe.py` runs `python -m megatron_lbp.integration.build_gpt2_bpe`
(megatron_lbp/integration/build_gpt2_bpe.py); the package holds the code."""
import runpy

if __name__ == "__main__":
    runpy.run_module("megatron_lbp.integration.build_gpt2_bpe", run_name="__main__", alter_sys=True)
