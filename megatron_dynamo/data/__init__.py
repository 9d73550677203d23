"""Data stage: math prompts, prompt templates, the synthetic CPU task and the offline character tokenizer.

- ``dataset``: ``MathExample``, ``load_math_file`` / ``load_math_jsonl`` (validated JSONL or parquet rows, verl's
  layout included; public dataset names resolved to local files), ``PromptSampler`` (seeded per-epoch
  shuffling, exactly resumable).
- ``hub`` (imported on use: it pulls in ``datasets``): ``prepare`` converts a hub dataset to the JSONL rows.
- ``templates``: prompt template registry (``qwen_math_boxed`` default, ``plain``, ``plain_boxed``, ``synthetic``).
- ``synthetic``: ``make_synthetic_task`` (seeded integer arithmetic with spread difficulty), ``sft_pairs``.
- ``reasoning``: ``make_reasoning_task`` (running sums written out step by step, 20-71 tokens; held-out split
  ``reasoning_test``), the task of the CPU ablation testbed.
- ``testbed``: ``make_testbed_task`` (sums of 4-8 one-digit terms added in any order: a decision point per line;
  the warm-up covers 4-6 terms only; held-out split ``testbed_test``), the task of ``configs/cpu_testbed.yaml``.
- Generated tasks register in ``GENERATED_TASKS`` (``data.train: synthetic`` / ``reasoning`` / ``testbed``).
- ``tokenizer``: ``build_char_tokenizer`` (imported lazily: it pulls in ``transformers``).
"""

from megatron_dynamo.data.dataset import (
    BENCHMARKS,
    DATA_DIR_ENV,
    DATASETS,
    DatasetNotAvailableError,
    DatasetSpec,
    GENERATED_TASKS,
    GeneratedTask,
    MathDataset,
    MathExample,
    PromptSampler,
    SkippedRow,
    load_math_file,
    load_math_jsonl,
    resolve_dataset_path,
)
from megatron_dynamo.data.reasoning import make_reasoning_task
from megatron_dynamo.data.synthetic import SYNTHETIC_LEVELS, make_synthetic_task, sft_pairs
from megatron_dynamo.data.testbed import make_testbed_task
from megatron_dynamo.data.templates import (
    DEFAULT_TEMPLATE,
    PromptTemplate,
    get_template,
    list_templates,
    register_template,
    render,
)

_LAZY = {"build_char_tokenizer", "save_char_tokenizer", "SPECIAL_TOKENS", "CHARACTERS"}


def __getattr__(name: str):
    if name in _LAZY:  # tokenizer imports transformers (about 0.7 s): only for the callers that build one
        from megatron_dynamo.data import tokenizer

        return getattr(tokenizer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BENCHMARKS", "CHARACTERS", "DATASETS", "DATA_DIR_ENV", "DEFAULT_TEMPLATE", "DatasetNotAvailableError",
    "DatasetSpec", "GENERATED_TASKS", "GeneratedTask", "MathDataset", "MathExample", "PromptSampler", "PromptTemplate",
    "SPECIAL_TOKENS", "SYNTHETIC_LEVELS", "SkippedRow", "build_char_tokenizer", "get_template", "list_templates",
    "load_math_file", "load_math_jsonl", "make_reasoning_task", "make_synthetic_task", "make_testbed_task",
    "register_template", "render", "resolve_dataset_path", "save_char_tokenizer", "sft_pairs",
]
