"""`python -m megatron_lbp.preprocess_data` is the command; its code is
megatron_lbp/integration/preprocess_data.py."""
if __name__ == "__main__":
    import runpy

    runpy.run_module("megatron_lbp.integration.preprocess_data", run_name="__main__", alter_sys=True)
