"""When a Slurm job of ``dynamo launch`` goes back to the queue: after a signal or a node failure, never after a
deterministic failure.

nemo-run's batch script ends with ``if exit status != 0 and retries are left: scontrol requeue``, so a config error
(exit 2) was requeued ``--retries`` (20) times. The entry points (``launch/entry.py``) print :data:`NOT_REQUEUED`
with the reason when they fail in a way a new start would repeat: bad input (exit 2), a run that cannot go on (no
intact checkpoint, a checkpoint that cannot be saved, a data set too small), a failed conversion. The lines of
:func:`requeue_policy` go into the batch script (nemo-run's ``setup_lines``, before the job step) and define
``scontrol`` as a shell function that refuses ``requeue`` when the job step's log holds that line: the job ends at
once with the ranks' exit status and says why in its batch log. Everything else still requeues: the ranks stopped
by the time-limit signal (they saved their step), a process killed (a node failure, the OOM killer), an
unexpected exception (a lost peer rank shows as one).

The job step's log is nemo-run's ``log-<job>_<id>_<restart>.out`` beside the batch log, which is this shell's
standard output (``/proc/$$/fd/1``).
"""

from __future__ import annotations

NOT_REQUEUED = "dynamo launch: not requeued:"


def requeue_policy() -> str:
    """Bash lines for the batch script (see the module doc)."""
    return f"""\
# dynamo: requeue after a signal or a node failure only (megatron_dynamo/launch/requeue.py)
scontrol() {{
  if [ "${{1:-}}" = requeue ]; then
    dynamo_logs="$(dirname "$(readlink -f /proc/$$/fd/1)")/log-*_${{SLURM_JOB_ID}}_${{SLURM_RESTART_COUNT:-0}}.out"
    dynamo_why=$(grep -h -F "{NOT_REQUEUED}" $dynamo_logs 2>/dev/null | head -n 1)
    if [ -n "$dynamo_why" ]; then
      echo "dynamo: job $SLURM_JOB_ID is not requeued: ${{dynamo_why#*{NOT_REQUEUED} }}"
      return 0
    fi
  fi
  command scontrol "$@"
}}"""


def not_requeued(reason: str) -> str:
    """The line an entry point prints (stderr) before it exits with a failure a new start would repeat."""
    return f"{NOT_REQUEUED} {reason}"
