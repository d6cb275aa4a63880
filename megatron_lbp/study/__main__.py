"""python -m megatron_lbp.study {report,plan,record-failure} ...  (see each command's --help)."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_lbp.study",
                                description="The adoption study: plan its runs, record a failed one, report.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("report", help="DIR/report.md and PNGs from the result files under DIR")
    r.add_argument("directory")
    r.add_argument("--no-projection", action="store_true",
                   help="leave out the comparison with bench project's cost model")
    r.add_argument("--scaling", choices=("weak", "strong"), default=None,
                   help="the study's scaling mode (default: read from the result files)")
    from megatron_lbp.study import plan

    plan.add_parser(sub)
    f = sub.add_parser("record-failure", help="write a failed result file for a run that left none")
    f.add_argument("path")
    f.add_argument("--reason", required=True)
    f.add_argument("--field", action="append", default=[], metavar="KEY=VALUE",
                   help="what the study knows of the run (scheme, nodes, gcds, seed, scaling)")
    args = p.parse_args(argv)
    if args.command == "report":
        from megatron_lbp.study.report import ReportError, report

        try:
            text, pngs = report(args.directory, project_too=not args.no_projection, mode=args.scaling)
        except ReportError as err:
            print(f"{p.prog} report: error: {err}", file=sys.stderr)
            return 2
        print(text)
        print(f"[study] wrote {args.directory}/report.md and {len(pngs)} PNGs: "
              + ", ".join(p.rsplit('/', 1)[-1] for p in pngs), file=sys.stderr)
        return 0
    if args.command == "plan":
        return plan.main(args, p)
    from megatron_lbp.integration.study_result import record_failure

    try:
        fields = dict(kv.split("=", 1) for kv in args.field)
    except ValueError:
        p.error(f"--field takes KEY=VALUE, got {args.field}")
    record_failure(args.path, args.reason, fields)
    return 0


if __name__ == "__main__":
    sys.exit(main())
