"""python -m megatron_lbp.projection [options]: the Frontier projection (the flags of
``python -m benchmarks project``); python -m megatron_lbp.projection trace PATH ...: a schedule
trace's exposed communication (the flags of ``python -m benchmarks trace``);
python -m megatron_lbp.projection program ...: one step's communication program, for one unit."""
import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--json" in argv:
        from megatron_lbp.projection import json_out

        json_out.reserve_stdout()
    if argv[:1] == ["trace"]:
        from megatron_lbp.projection import trace

        return trace.main(argv[1:])
    if argv[:1] == ["program"]:
        from megatron_lbp.projection import program_cli

        return program_cli.main(argv[1:])
    from megatron_lbp.projection import project_cli

    return project_cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
