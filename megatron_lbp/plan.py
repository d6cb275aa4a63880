"""`python -m megatron_lbp.plan` stays the command; its code is megatron_lbp/launch/plan.py."""
if __name__ == "__main__":
    import runpy

    runpy.run_module("megatron_lbp.launch.plan", run_name="__main__", alter_sys=True)
