"""python -m benchmarks <command> [options]; commands: overhead, traffic, project, network, report,
trace, construction, study-network, network-choice,
survey-network, headline, compare-checkouts."""
import importlib
import sys

COMMANDS = {"overhead": "benchmarks.overhead",
            "report": "benchmarks.report",
            "traffic": "benchmarks.traffic",
            "project": "megatron_lbp.projection.project_cli",
            "network": "benchmarks.network",
            "network-choice": "benchmarks.network_choice",
            "trace": "megatron_lbp.projection.trace",
            "construction": "benchmarks.construction",
            "study-network": "benchmarks.study_network",
            "survey-network": "benchmarks.survey_network",
            "headline": "benchmarks.headline",
            "compare-checkouts": "benchmarks.compare_checkouts"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        given = argv[0] if argv else "(none)"
        print(f"python -m benchmarks: error: command {given} is not one of "
              f"{', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    if "--json" in argv[1:]:
        from megatron_lbp.projection import json_out

        json_out.reserve_stdout()
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
