"""`python -m megatron_lbp.gpu_check` is the command; its code is megatron_lbp/gpucheck/runner.py."""
if __name__ == "__main__":
    import runpy

    runpy.run_module("megatron_lbp.gpucheck.runner", run_name="__main__", alter_sys=True)
