"""Evaluation stage: the pass@k estimator, the benchmark runner (n samples per problem, scored by the training
reward code, resumable) and the paper-layout table. ``dynamo eval`` is its command; the trainer calls
:func:`evaluate` every ``evaluation.every`` steps with its own rollout engine."""

from megatron_dynamo.eval.passk import mean_pass_at_k, pass_at_k
from megatron_dynamo.eval.runner import (
    EvalConfig,
    EvalError,
    evaluate,
    format_table,
    load_benchmarks,
    summary_metrics,
)

__all__ = ["EvalConfig", "EvalError", "evaluate", "format_table", "load_benchmarks", "mean_pass_at_k",
           "pass_at_k", "summary_metrics"]
