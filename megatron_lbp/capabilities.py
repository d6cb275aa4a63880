"""`python -m megatron_lbp.capabilities` stays the command; its code is megatron_lbp/integration/capabilities.py."""
if __name__ == "__main__":
    import runpy

    runpy.run_module("megatron_lbp.integration.capabilities", run_name="__main__", alter_sys=True)
