"""python -m megatron_lbp.projection program [--hier-* flags] [--layers N] [--unit U] ...:
one optimizer step's communication program (megatron_lbp.core.program) for a GPT's
units, listed for one unit: every collective it issues (program point, communicator,
what its stream waits for) and where the engine waits for each; and the schedule
trace's format version, the trace that records what the engine did run.

    python -m megatron_lbp.projection program --hier-world-size 8 --hier-gpus-per-node 4 \\
        --hier-preset lbp --hier-secondary-group-size 4 --hier-quantize-grad-reduce --unit 1
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from megatron_lbp.core import costs, program
from megatron_lbp.core.config import (HierConfigError, add_hier_arguments,
                                      hier_config_from_args, max_pending_reduces_from_args,
                                      prefetch_units_from_args)
from megatron_lbp.core.topology import (TopologyError, emulated_locations,
                                        family_link_classes, hierarchy_groups)
from megatron_lbp.projection.trace_records import TRACE_FORMAT_VERSION

PROG = "python -m megatron_lbp.projection program"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block
        print(f"{PROG}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def spec_of(cfg, layers: int, micro_batches: int, prefetch_units: int,
            max_pending_reduces: int) -> program.ProgramSpec:
    """The program's spec for a tied GPT of ``layers`` layers on ``cfg``'s hierarchy."""
    locations = emulated_locations(cfg.world_size, cfg.gpus_per_node, cfg.gcds_per_package)
    classes = family_link_classes(hierarchy_groups(range(cfg.world_size), cfg), locations)
    return program.ProgramSpec(
        unit_kinds=("embedding",) + ("layer",) * layers + ("output",),
        group_sizes=program.group_sizes(cfg), tied_embedding=True,
        micro_batches=micro_batches, prefetch_units=prefetch_units,
        max_pending_reduces=max_pending_reduces,
        quantized_grad_families=costs.quantized_grad_families(cfg, dict(classes)),
        secondary_serves_step=bool(cfg.secondary_group_size)
        and cfg.secondary_scope == "step")


def main(argv: Sequence[str] | None = None) -> int:
    p = _Parser(prog=PROG, description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_hier_arguments(p, include_world=True)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--unit", type=int, default=1,
                   help="the unit listed: 0 the embedding, 1..layers the layers (default 1)")
    p.add_argument("--micro-batches", type=int, default=1)
    args = p.parse_args(argv)
    for flag, value, low in (("--layers", args.layers, 1), ("--micro-batches",
                                                            args.micro_batches, 1)):
        if value < low:
            p.error(f"{flag}={value}: must be >= {low}")
    if not 0 <= args.unit <= args.layers + 1:
        p.error(f"--unit={args.unit}: must be 0..{args.layers + 1} (embedding, layers, output)")
    try:
        cfg = hier_config_from_args(args)
        spec = spec_of(cfg, args.layers, args.micro_batches, prefetch_units_from_args(args),
                       max_pending_reduces_from_args(args))
    except (HierConfigError, TopologyError, ValueError) as exc:
        p.error(str(exc))
    sizes = ", ".join(f"{f}={n}" for f, n in spec.group_sizes.items() if n and n > 1)
    print(f"step program, unit {args.unit} ({spec.unit_kinds[args.unit]}) of "
          f"{len(spec.unit_kinds)} units; groups {sizes}; "
          f"{args.micro_batches} micro-batch(es); schedule trace format "
          f"{TRACE_FORMAT_VERSION}")
    print(program.step_program(spec).listing(args.unit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
