"""`python -m megatron_lbp.pretrain_gpt` stays the command; its code is megatron_lbp/integration/pretrain_gpt.py."""
if __name__ == "__main__":
    import runpy

    runpy.run_module("megatron_lbp.integration.pretrain_gpt", run_name="__main__", alter_sys=True)
