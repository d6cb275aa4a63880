"""python -m megatron_lbp.bench <command> [options]; commands: overhead, traffic, project, network, report,
trace, construction, study-network."""
import importlib
import sys

COMMANDS = {"overhead": "megatron_lbp.bench.overhead",
            "report": "megatron_lbp.bench.report",
            "traffic": "megatron_lbp.bench.traffic",
            "project": "megatron_lbp.bench.project",
            "network": "megatron_lbp.bench.network",
            "trace": "megatron_lbp.bench.trace",
            "construction": "megatron_lbp.bench.construction",
            "study-network": "megatron_lbp.bench.study_network"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        given = argv[0] if argv else "(none)"
        print(f"python -m megatron_lbp.bench: error: command {given} is not one of "
              f"{', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    if "--json" in argv[1:]:
        from megatron_lbp.bench import json_out

        json_out.reserve_stdout()
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
