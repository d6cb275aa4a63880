"""Launch-time check for scripts/launch/lbp_launch.sh: parameters, per-GCD memory, fit.

    python scripts/launch/lbp_check.py --nodes N --tasks-per-node T --num-layers L \\
        --hidden-size H --num-attention-heads A --seq-length S --vocab-size V \\
        --micro-batch-size B --hier-secondary-group-size 8 [--gcd-memory-gb 64]

Prints the parameter count (megatron_lbp.costs.gpt_param_count), the command of
the plan tool (python -m megatron_lbp.plan) it evaluates and that tool's
per-GCD memory by state for W = N*T data-parallel ranks, an estimate of the
activation and transient memory the plan does not count, and the total against
the GCD's memory. Exit status: 0 fits, 3 does not fit (message says the smallest
node count that does), 2 bad input (one line saying which value).
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron_lbp import costs, plan  # noqa: E402

GB = 1e9
PROG = "lbp_launch"


def gb(x: float) -> str:
    return f"{x / GB:.2f} GB" if x >= 0.1 * GB else f"{x / 1e6:.2f} MB"


def plan_argv(a, world_size: int) -> list[str]:
    argv = ["--world-size", str(world_size), "--gpus-per-node", str(a.tasks_per_node),
            "--gcds-per-package", str(a.gcds_per_package), "--preset", a.preset,
            "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
            "--vocab-size", str(a.vocab_size), "--seq-length", str(a.seq_length),
            "--position-embedding-type", a.position_embedding_type,
            "--params-dtype", a.params_dtype,
            "--hier-secondary-group-size", str(a.hier_secondary_group_size)]
    if a.hier_secondary_group_size:
        argv += ["--hier-secondary-dtype", a.hier_secondary_dtype]
    if a.ffn_hidden_size:
        argv += ["--ffn-hidden-size", str(a.ffn_hidden_size)]
    return argv


def activation_bytes(a) -> int:
    """Activations and transient buffers the plan does not count (estimate, bytes per GCD).

    Korthikanti et al. (2022), bf16, no tensor parallelism, micro-batch b,
    sequence s, hidden h, heads n, layers L:
      full recomputation: 2sbh per layer (each layer's input) + one layer
                          rebuilt in backward: 34sbh + 5ns^2b;
      none:               (34sbh + 5ns^2b) per layer.
    Plus the logits (bf16) and their fp32 softmax/gradient (~10 bytes * s*b*V),
    and two gathered weight buckets in flight (2 x bucket x 2 bytes) with one
    full fp32 gradient bucket (4 x bucket).
    """
    s, b, h, n, L, V = (a.seq_length, a.micro_batch_size, a.hidden_size,
                        a.num_attention_heads, a.num_layers, a.vocab_size)
    layer = 34 * s * b * h + 5 * n * s * s * b
    acts = (2 * s * b * h * L + layer) if a.recompute == "full" else layer * L
    logits = 10 * s * b * V
    bucket = a.bucket_size
    return acts + logits + 2 * bucket * 2 + 4 * bucket


def per_gcd(a, nodes: int) -> tuple[dict, int]:
    p = plan.make_plan(plan_argv(a, nodes * a.tasks_per_node))
    return p, p["memory_bytes"]["total"] + activation_bytes(a)


def smallest_fitting_nodes(a, p: dict, total: int, limit: float) -> int | None:
    """Smallest node count that fits, when only the optimizer shard shrinks with more nodes
    (O = all ranks, one replica, as lbp): the rest is fixed per GCD. None if none fits."""
    g = p["group_sizes"]
    if g["optim"] != p["world_size"] or g["replicas"] != 1:
        return None
    opt = p["memory_bytes"]["optimizer"]
    fixed = total - opt
    if fixed >= limit:
        return None
    n = a.nodes + 1
    while fixed + opt * a.nodes / n > limit:
        n += 1
    # Confirm with the plan itself (padding rounds per bucket) for moderate sizes.
    while n * a.tasks_per_node <= 4096 and per_gcd(a, n)[1] > limit:
        n += 1
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="lbp_check.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag in ("nodes", "tasks-per-node", "num-layers", "hidden-size", "num-attention-heads",
                 "seq-length", "vocab-size", "micro-batch-size"):
        ap.add_argument(f"--{flag}", type=int, required=True)
    ap.add_argument("--ffn-hidden-size", type=int, default=0)
    ap.add_argument("--gcds-per-package", type=int, default=2)
    ap.add_argument("--preset", default="lbp")
    ap.add_argument("--hier-secondary-group-size", type=int, default=0)
    ap.add_argument("--hier-secondary-dtype", default="int8")
    ap.add_argument("--position-embedding-type", default="rope")
    ap.add_argument("--params-dtype", default="bf16")
    ap.add_argument("--recompute", choices=("full", "none"), default="full")
    ap.add_argument("--bucket-size", type=int, default=40_000_000)
    ap.add_argument("--gcd-memory-gb", type=float, default=64.0)
    a = ap.parse_args(argv)
    if a.nodes < 1 or a.tasks_per_node < 1:
        print(f"{PROG}: error: NNODES={a.nodes} and TASKS_PER_NODE={a.tasks_per_node} must be >= 1",
              file=sys.stderr)
        return 2

    params = costs.gpt_param_count(a.num_layers, a.hidden_size, a.vocab_size,
                                   seq_length=a.seq_length,
                                   ffn_hidden_size=a.ffn_hidden_size or None,
                                   position_embedding_type=a.position_embedding_type)
    try:
        p, total = per_gcd(a, a.nodes)
    except plan.UsageError as exc:
        print(f"{PROG}: error: the hierarchy does not fit {a.nodes} node(s) x {a.tasks_per_node} "
              f"tasks: {exc}", file=sys.stderr)
        return 2
    m = p["memory_bytes"]
    g = p["group_sizes"]
    act = activation_bytes(a)
    limit = a.gcd_memory_gb * GB
    size = f"{params / 1e9:.2f} B" if params >= 1e8 else f"{params / 1e6:.2f} M"
    print(f"parameters: {params:,} ({size}), padded vocabulary {a.vocab_size}")
    print(f"hierarchy: W={p['world_size']} ranks, P={g['param']} G={g['grad']} O={g['optim']} "
          f"S={g['secondary']} ({p['secondary_dtype'] if g['secondary'] else 'no secondary'}), "
          f"R={g['replicas']}")
    print("plan: python -m megatron_lbp.plan " + shlex.join(plan_argv(a, p["world_size"])))
    print(f"memory per GCD (plan): primary {gb(m['primary'])}, secondary {gb(m['secondary'])}, "
          f"grad {gb(m['grad'])}, optimizer {gb(m['optimizer'])} = {gb(m['total'])}")
    rc = "full recomputation" if a.recompute == "full" else "no recomputation"
    print(f"memory per GCD (activations, {rc}, micro-batch {a.micro_batch_size}, + buffers, "
          f"estimate): {gb(act)}")
    print(f"memory per GCD total: {gb(total)} of {a.gcd_memory_gb:g} GB "
          f"({'fits' if total <= limit else 'DOES NOT FIT'})")
    for w in p.get("warnings", []):
        print(f"plan warning: {w}")
    if total <= limit:
        return 0
    need = smallest_fitting_nodes(a, p, total, limit)
    hint = (f"use at least NNODES={need} (sbatch -N {need})" if need else
            "no node count fits these settings")
    if a.micro_batch_size > 1:
        hint += f", or lower MICRO_BATCH_SIZE={a.micro_batch_size}"
    if a.hier_secondary_group_size and a.hier_secondary_group_size < a.tasks_per_node:
        hint += (f", or set HIER_SECONDARY_GROUP_SIZE={a.tasks_per_node} (a smaller secondary "
                 "copy)")
    if a.recompute != "full":
        hint += ", or set RECOMPUTE=full"
    print(f"{PROG}: error: refusing to launch: {total / GB:.2f} GB per GCD exceeds the GCD's "
          f"{a.gcd_memory_gb:g} GB on {a.nodes} node(s) (GCD_MEMORY_GB); {hint}",
          file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
