"""`python scripts/preprocess_data.py` runs `python -m megatron_lbp.preprocess_data`
(megatron_lbp/integration/preprocess_data.py); the package holds the code."""
import runpy

if __name__ == "__main__":
    runpy.run_module("megatron_lbp.integration.preprocess_data", run_name="__main__",
                     alter_sys=True)
