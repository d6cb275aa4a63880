"""What the launchers (scripts/launch/lbp_launch.sh) compute in Python, one job per module.

``job_cli`` (with ``rules`` and ``commands``): the launch environment resolved into a
job; ``site``: the site's environment; ``estimate`` (with ``candidates``, ``choose``):
memory, step time and the choice; ``walltime``: the exit time; ``checkpoints``:
retention, space and the chain's decision; ``placement`` and ``health``: the
task and node checks. ``python -m megatron_lbp.launch <command> --help`` for each.
Invariant: every refusal is one line on stderr starting with the command's name,
with a documented exit status. See docs/frontier.md.
"""
