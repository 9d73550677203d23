"""Launching at scale: the cluster recipe catalog (``recipes``), the importable entry points of the nemo-run tasks
(``entry``) and the nemo-run glue (``nemo``: tasks, executors, dry runs; imports nemo-run lazily). The command is
``dynamo launch``; scripts/slurm/*.sbatch do the same without nemo-run. See docs/cluster.md."""
