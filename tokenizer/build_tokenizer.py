"""`python tokenizer/build_tokenizer.py` runs `python -m megatron_lbp.integration.build_tokenizer`
(megatron_lbp/integration/build_tokenizer.py); the package holds the code."""
import runpy

if __name__ == "__main__":
    runpy.run_module("megatron_lbp.integration.build_tokenizer", run_name="__main__", alter_sys=True)
