"""`python -m megatron_lbp.tokenizer_check` stays the command; its code is megatron_lbp/integration/tokenizer_check.py."""
if __name__ == "__main__":
    import runpy

    runpy.run_module("megatron_lbp.integration.tokenizer_check", run_name="__main__", alter_sys=True)
