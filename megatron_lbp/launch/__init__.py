"""What the launchers (scripts/launch/lbp_launch.sh) compute in Python, one job per module.

- ``job_cli``: the launch environment resolved into a job (the planner's memory fit and
  choice, the exit time), in stages the shell calls; the shell keeps modules, srun and
  the chain's sbatch; ``rules``: its defaults, refusals and model flags; ``commands``:
  its srun, training and health-check commands;
- ``site``: the site's environment (Frontier's RCCL/libfabric settings) and its precedence;
- ``estimate``: the job's flags resolved once into a ``job.Job``, then
  ``estimate.decide(job)``: memory per GCD and step time of every candidate
  (``candidates``), the choice (``choose``), the save interval and checkpoint, printed as a
  summary and, with --verbose, in full;
- ``walltime``: the job's remaining wall time and the exit time that leaves room for
  one save (Slurm's time formats, ``SLURM_JOB_END_TIME``, ``squeue -o %L``);
- ``checkpoints``: the checkpoint directory as Megatron leaves it (tracker, complete
  and torn saves), retention, the free-space check and the job chain's decision;
- ``placement``: every task's GCD checked against the package/node layout the
  hierarchy assumes, at task start;
- ``health``: the pre-flight check of the allocated nodes (torch build, devices, one
  timed all-gather per link class against the cost model's bandwidth).

``python -m megatron_lbp.launch <command> --help`` for each command line. Every refusal
is one line on stderr starting with the command's name, and a documented exit status.
"""
