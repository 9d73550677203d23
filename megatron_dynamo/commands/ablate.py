"""The DynaMO ablation (paper Table 2) on one recipe: every combination of DRA, GC and UMS, over seeds.

    dynamo ablate configs/cpu_default.yaml --seeds 1,2,3
    dynamo ablate RECIPE trainer.steps=40 --variants grpo,dynamo,dynamo-p0.5 --jobs 2 --output-dir outputs/abl

Variants (``--variants``, comma-separated; default all nine). Each sets the same four keys explicitly:
dynamo.allocation.enabled (DRA, dynamic rollout allocation), dynamo.modulation.gc (GC, gradient compensation),
dynamo.modulation.ums (UMS, update-magnitude stabilisation), dynamo.allocation.power:
    grpo           DRA off, GC off, UMS off                  paper row "GRPO (w/o ALL)"
    dra, gc, ums   one component on                          "w/o GC & UMS", "w/o UMS & DRA", "w/o GC & DRA"
    dra+gc, dra+ums, gc+ums   two on                         "w/o UMS", "w/o GC", "w/o DRA"
    dynamo         all three on, power 1.0 (the paper's rule) "DynaMO"
    dynamo-p0.5    all three on, power 0.5 (n ~ sigma)       ours
(power 1.0 everywhere else; with DRA off the power is unused.)

Runs, per seed S (trainer.seed=S; data.seed stays the recipe's, so every seed trains and evaluates on the same
problems), each a subprocess ``python -m megatron_dynamo.cli train RECIPE [key=value ...] <run keys> --algo
dynamo`` writing to its own directory (its console output in train.log):
 1. SFT warm-up, when the recipe has trainer.sft_warmup_steps > 0: trainer.steps=0 and evaluation.at_start=true
    (the warm-up alone, evaluated, saved as checkpoint step 0). By default one warm-up, with the recipe's own
    trainer.seed, is the base model of every run (as the paper starts every run from one base model) ->
    <out>/sft/seed<recipe seed>/; with --sft-per-seed each seed warms up its own -> <out>/sft/seed<S>/. Every
    variant starts from its warm-up's checkpoint (model.checkpoint=<it>, trainer.sft_warmup_steps=0,
    evaluation.at_start=false): the same policy for all variants of a seed, the warm-up paid once. Its held-out
    pass@1 is the "SFT start" row.
 2. every variant: evaluation.every=trainer.steps, so the trainer evaluates the final model on the recipe's
    evaluation.benchmarks (the held-out split) with the run's own engine (the code path of ``dynamo eval``) and
    logs eval/<bench>/pass@<k> and eval/avg/pass@<k> on the last step's row -> <out>/runs/<variant>/seed<S>/.
Checked before any run: every variant's config loads (a typo fails at once), all budgets (prompts_per_step x
n_avg rollouts per step, steps) are equal, the recipe names evaluation.benchmarks, checkpoint.dir is unset.
The command sets trainer.seed, trainer.output_dir, evaluation.every and the four variant keys itself (passing
them is an error).

--jobs N runs up to N runs at once (a shared SFT run first and alone, on every core; a per-seed SFT run before the
variants of its seed; seed-major order). With N > 1
each run gets its own share of the cores (cores // N, pinned with CPU affinity; OMP_NUM_THREADS and
MKL_NUM_THREADS set to it); N = 1 leaves the environment as it is. N > 1 is refused for recipes with
rollout.tensor_parallel > 1 (vLLM's CPU shared-memory names would collide between runs). Progress: a line per run start and end with
[done/total], its wall time, final train reward and held-out pass@1.

Resume: run the same command again. A run whose metrics.jsonl has every step and the final evaluation (the SFT
run: its checkpoint step 0) is reused; one with a checkpoint continues with --resume; one without any is deleted
and rerun. <out>/ablation_plan.json records the recipe (resolved), overrides and budget: a different one is
refused (exit 2); more seeds or variants may be added. Ctrl-C stops the running runs after their current step
(their checkpoint saved; a second Ctrl-C kills them) and exits 130; nothing is left running.

Outputs in <out>: ablation.md (three tables: the paper's layout with held-out pass@1 / pass@k mean [95% CI],
Δ pass@1 vs GRPO paired by seed, rollouts to threshold, final train reward; marginal effects of DRA, GC, UMS;
eq. 23 variance ratio predicted and realised, zero-advantage groups and the modulation diagnostics), ablation.json
(every run's numbers and the aggregates), ablation.png (pass@1 per variant with CIs; the effects) and report/
(``dynamo report``'s page of every variant run's curves). Statistics and formulas: docs/ablation.md.
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from megatron_dynamo.report.ablation import SFT, VARIANTS, parse_variants
from megatron_dynamo.report.thresholds import parse_seeds

DEFAULT_VARIANTS = ",".join(VARIANTS)
VARIANT_KEYS = ("dynamo.allocation.enabled", "dynamo.modulation.gc", "dynamo.modulation.ums",
                "dynamo.allocation.power")
RESERVED_KEYS = ("trainer.seed", "trainer.output_dir", "evaluation.every", *VARIANT_KEYS)
PLAN_FILE = "ablation_plan.json"
CPUS_ENV = "DYNAMO_ABLATE_CPUS"  # the CPUs a run is pinned to (read by the launcher, left in the run's environment)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
# A run is a single-process job of its own: launcher variables of the ablation's environment must not reach it
# (it would take itself for a rank of a torchrun/Slurm job, with a job-wide MASTER_PORT shared by all runs).
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


def add_arguments(parser) -> None:
    parser.add_argument("config", help="YAML recipe shared by every run (it must set evaluation.benchmarks: the "
                                       "held-out problems the final models are evaluated on)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="recipe overrides applied to every run (not " + ", ".join(RESERVED_KEYS) +
                             ": the command sets those per run)")
    parser.add_argument("--seeds", default="1,2,3",
                        help="comma-separated seeds; each sets trainer.seed of the SFT run and the variants of "
                             "that seed (default 1,2,3)")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help=f"comma-separated subset of {DEFAULT_VARIANTS} (default: all)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once (default 1); each gets cores // N threads on its own cores")
    parser.add_argument("--threshold", type=float, default=0.6,
                        help="reward threshold on the moving mean of reward_mean for rollouts-to-threshold "
                             "(default 0.6)")
    parser.add_argument("--window", type=int, default=5,
                        help="steps in the trailing moving mean compared with the threshold (default 5)")
    parser.add_argument("--bootstrap", type=int, default=10000,
                        help="bootstrap resamples of the 95%% CIs (default 10000; the RNG is seeded)")
    parser.add_argument("--sft-per-seed", action="store_true",
                        help="one SFT warm-up per seed (trainer.seed = the seed) instead of one shared by all seeds "
                             "(the recipe's trainer.seed): seed-to-seed spread then includes the warm-up's")
    parser.add_argument("--output-dir", default="outputs/ablate",
                        help="where runs, ablation.md/.json/.png, report/ and ablation_plan.json go "
                             "(default outputs/ablate)")


# ---------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class RunSpec:
    """One training run of the ablation: the SFT warm-up of a seed (``variant == "sft"``) or a variant."""

    variant: str
    seed: int
    output_dir: str
    sft_seed: int | None = None  # a variant: the seed of the SFT run it starts from (None: no SFT run)

    @property
    def key(self) -> tuple[str, int]:
        return self.variant, self.seed

    @property
    def is_sft(self) -> bool:
        return self.variant == SFT

    def describe(self) -> str:
        return f"{'SFT warm-up' if self.is_sft else self.variant} seed {self.seed}"


def run_dir(output_dir: str, variant: str, seed: int) -> str:
    if variant == SFT:
        return os.path.join(output_dir, "sft", f"seed{seed}")
    return os.path.join(output_dir, "runs", variant, f"seed{seed}")


def plan_runs(output_dir: str, seeds: Sequence[int], variants: Sequence[str], with_sft: bool,
              shared_sft_seed: int | None = None) -> list[RunSpec]:
    """Seed-major: for each seed its SFT run (when the recipe warms up), then its variants; with
    ``shared_sft_seed``, one SFT run (that seed) first, the start of every variant of every seed."""
    specs = []
    if with_sft and shared_sft_seed is not None:
        specs.append(RunSpec(SFT, shared_sft_seed, run_dir(output_dir, SFT, shared_sft_seed)))
    for seed in seeds:
        sft_seed = None
        if with_sft:
            sft_seed = seed if shared_sft_seed is None else shared_sft_seed
            if shared_sft_seed is None:
                specs.append(RunSpec(SFT, seed, run_dir(output_dir, SFT, seed)))
        specs.extend(RunSpec(v, seed, run_dir(output_dir, v, seed), sft_seed) for v in variants)
    return specs


def run_overrides(spec: RunSpec, user_overrides: Sequence[str], steps: int,
                  sft_checkpoint: str | None = None) -> list[str]:
    """The train overrides of a run: the user's, then the run's own (later ones win)."""
    own = [f"trainer.seed={spec.seed}", f"trainer.output_dir={spec.output_dir}"]
    if spec.is_sft:
        return [*user_overrides, *own, "trainer.steps=0", "evaluation.at_start=true"]
    own.append(f"evaluation.every={steps}")
    if sft_checkpoint is not None:
        # the SFT run evaluated this very model already: no second evaluation at step 0
        own += [f"model.checkpoint={sft_checkpoint}", "trainer.sft_warmup_steps=0", "evaluation.at_start=false"]
    return [*user_overrides, *VARIANTS[spec.variant].overrides(), *own]


def train_command(config: str, overrides: Sequence[str], resume: bool = False,
                  python: str = sys.executable) -> list[str]:
    return [python, "-m", "megatron_dynamo.cli", "train", config, *overrides, "--algo", "dynamo",
            *(["--resume"] if resume else [])]


def read_run(path: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(metrics records, prompts rows or None) of a run directory; empty when it has no metrics yet."""
    from megatron_dynamo.report.runs import METRICS_FILE, load_run

    if not os.path.isfile(os.path.join(path, METRICS_FILE)):
        return [], None
    run = load_run(path)
    return run.records, run.prompts


def checkpoints_of(path: str) -> list[int]:
    """Steps of the complete checkpoints under ``<path>/checkpoints``."""
    from megatron_dynamo.trainer.checkpoint import list_checkpoints

    return [step for step, _ in list_checkpoints(os.path.join(path, "checkpoints"))]


def sft_checkpoint(path: str) -> str | None:
    from megatron_dynamo.trainer.checkpoint import latest_checkpoint

    latest = latest_checkpoint(os.path.join(path, "checkpoints"))
    return str(latest) if latest is not None else None


def run_state(spec: RunSpec, steps: int) -> str:
    """``done`` (reuse), ``resume`` (a checkpoint to continue from) or ``fresh`` (start over)."""
    from megatron_dynamo.report.ablation import has_final_eval, training_rows

    saved = checkpoints_of(spec.output_dir)
    if spec.is_sft:
        return "done" if 0 in saved else "fresh"
    records, _ = read_run(spec.output_dir)
    finished = {r["step"] for r in training_rows(records)} >= set(range(1, steps + 1))
    if finished and has_final_eval(records, steps):
        return "done"
    return "resume" if saved else "fresh"


def plan_record(config: str, overrides: Sequence[str], recipe: Mapping[str, Any], budget: Mapping[str, Any],
                seeds: Sequence[int], variants: Sequence[str]) -> dict[str, Any]:
    """What ``ablation_plan.json`` holds. ``recipe``: the resolved config (YAML + overrides) as plain data."""
    return {"config": config, "overrides": list(overrides), "recipe": json.loads(json.dumps(recipe, default=str)),
            "budget": dict(budget), "seeds": list(seeds), "variants": list(variants)}


def merge_plan(existing: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any]:
    """The plan to write: ``new`` when there is none; ValueError when the config, overrides, resolved recipe or
    budget differ from ``existing``; else seeds and variants are the union (existing first)."""
    if existing is None:
        return dict(new)
    for key in ("config", "overrides", "budget", "recipe"):
        if existing.get(key) != new.get(key):
            what = {"config": "the recipe path", "overrides": "the overrides", "budget": "the rollout budget",
                    "recipe": "the resolved recipe (the YAML file changed?)"}[key]
            detail = "" if key == "recipe" else f": {existing.get(key)!r} there, {new.get(key)!r} now"
            raise ValueError(f"{what} differs from the existing ablation's {PLAN_FILE}{detail}; use another "
                             "--output-dir (or delete that directory)")
    merged = dict(existing)
    merged["seeds"] = list(existing.get("seeds", [])) + [s for s in new["seeds"] if s not in existing.get("seeds", [])]
    merged["variants"] = list(existing.get("variants", [])) + [v for v in new["variants"]
                                                               if v not in existing.get("variants", [])]
    return merged


# ---------------------------------------------------------------------------------------------- processes
def cpu_slots(jobs: int, cpus: Sequence[int] | None = None) -> list[list[int]]:
    """The CPUs of each of ``jobs`` slots: consecutive blocks of len(cpus) // jobs (the usable CPUs, affinity
    respected); with more jobs than CPUs, one CPU each, round robin."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None and hasattr(os, "sched_getaffinity") else \
        list(cpus or range(os.cpu_count() or 1))
    if jobs <= len(cpus):
        per = len(cpus) // jobs
        return [list(cpus[i * per:(i + 1) * per]) for i in range(jobs)]
    return [[cpus[i % len(cpus)]] for i in range(jobs)]


def child_environment(base: Mapping[str, str], jobs: int, cpus: Sequence[int] | None) -> dict[str, str]:
    """A run's environment: ``base`` without launcher variables, unbuffered output; with jobs > 1 also its thread
    count (the number of its CPUs) and the CPUs to pin it to (:data:`CPUS_ENV`)."""
    env = {k: v for k, v in base.items() if k not in LAUNCH_VARIABLES}
    env.pop(CPUS_ENV, None)
    env.setdefault("PYTHONUNBUFFERED", "1")  # train.log follows the run (the step lines as they happen)
    if jobs > 1 and cpus:
        for name in THREAD_VARIABLES:
            env[name] = str(len(cpus))
        env[CPUS_ENV] = ",".join(map(str, cpus))
    return env


# The first program of a run: pin it to its CPUs, have the kernel send it SIGTERM should the thread that started it
# die (the ablation killed: the trainer then stops after its step, its watchdog cleans up), then become the train
# command (same pid). Runs with -I -S: no site import, ~20 ms.
_EXEC_WRAPPER = """\
import ctypes, os, signal, sys
cpus, parent, argv = sys.argv[1], int(sys.argv[2]), sys.argv[4:]
if cpus:
    os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
try:
    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)
except (OSError, AttributeError):
    pass
if os.getppid() != parent:
    sys.exit(143)
os.execvpe(argv[0], argv, os.environ)
"""


class SubprocessLauncher:
    """Runs a command to completion: ``launcher(command, env, log_path) -> returncode`` (its output appended to
    ``log_path``). Each run is started in a session of its own, so a Ctrl-C at the terminal reaches this process
    only; :meth:`signal_all` passes a signal on to every running run (SIGINT: stop after the current step;
    SIGKILL: at once, to its whole process group)."""

    def __init__(self) -> None:
        self._procs: dict[int, subprocess.Popen] = {}
        self._lock = threading.Lock()

    def __call__(self, command: Sequence[str], env: Mapping[str, str], log_path: str) -> int:
        wrapped = command
        if sys.platform.startswith("linux"):
            wrapped = [sys.executable, "-I", "-S", "-c", _EXEC_WRAPPER, env.get(CPUS_ENV, ""), str(os.getpid()),
                       "--", *command]
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(command)}\n")
            log.flush()
            proc = subprocess.Popen(wrapped, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=dict(env), start_new_session=True)
        with self._lock:
            self._procs[proc.pid] = proc
        try:
            return proc.wait()
        finally:
            with self._lock:
                self._procs.pop(proc.pid, None)

    def running(self) -> int:
        with self._lock:
            return len(self._procs)

    def signal_all(self, sig: int) -> None:
        with self._lock:
            procs = list(self._procs.values())
        for proc in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if sig == signal.SIGKILL:
                    os.killpg(proc.pid, sig)  # the run is its session's (and group's) leader
                else:
                    proc.send_signal(sig)


class AblationInterrupted(Exception):
    """Ctrl-C / SIGTERM: the runs were stopped; the message says how many finished."""


Launch = Callable[[Sequence[str], Mapping[str, str], str], int]


@dataclass
class RunResult:
    spec: RunSpec
    status: str  # "reused", "ok", "failed", "skipped"
    returncode: int | None = None
    seconds: float | None = None
    resumed: bool = False
    command: list[str] | None = None
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("reused", "ok")


def execute(specs: Sequence[RunSpec], steps: int, command_for: Callable[[RunSpec, bool], list[str]],
            launch: Launch, *, jobs: int = 1, env_for: Callable[[int], Mapping[str, str]] | None = None,
            report: Callable[[RunResult, int, int], None] | None = None,
            announce: Callable[[RunSpec, bool, int, int], None] | None = None) -> dict[tuple[str, int], RunResult]:
    """Run ``specs`` (seed-major) with up to ``jobs`` at once; a variant waits for the SFT run of its seed.

    Each run's state (:func:`run_state`) decides: reuse, ``--resume`` (``command_for(spec, resume=True)``), or
    start over (its directory removed). ``launch(command, env, log_path) -> returncode`` runs one command
    (:class:`SubprocessLauncher`, a fake in tests); ``env_for(slot)`` its environment. A run is ok when it exits 0
    and is then complete. KeyboardInterrupt (here or raised by ``launch``): no new run starts, the running ones are
    asked to stop (``launch.signal_all(SIGINT)`` when it has one; a second interrupt: SIGKILL), and
    :class:`AblationInterrupted` is raised once they have ended.
    """
    total = len(specs)
    results: dict[tuple[str, int], RunResult] = {}
    pending = list(specs)

    def finish(result: RunResult) -> None:
        results[result.spec.key] = result
        if report is not None:
            report(result, len(results), total)

    for spec in list(pending):
        if run_state(spec, steps) == "done":
            finish(RunResult(spec, "reused"))
            pending.remove(spec)

    def ready(spec: RunSpec) -> str | None:
        """"go", "wait", or "skip" (its SFT run failed)."""
        if spec.is_sft:
            return "go"
        if spec.sft_seed is None:
            return "go"
        sft = results.get((SFT, spec.sft_seed))
        if any(s.key == (SFT, spec.sft_seed) for s in specs) and sft is None:
            return "wait"
        return "skip" if sft is not None and not sft.ok else "go"

    free_slots = list(range(max(1, jobs)))
    running: dict[futures.Future, tuple[RunSpec, int, float, bool, list[str]]] = {}
    interrupted = False

    def dispatch(pool: futures.ThreadPoolExecutor) -> None:
        for spec in list(pending):
            if not free_slots:
                return
            state = ready(spec)
            if state == "wait":
                continue
            pending.remove(spec)
            if state == "skip":
                finish(RunResult(spec, "skipped", message=f"its SFT run (seed {spec.sft_seed}) failed"))
                continue
            resume = run_state(spec, steps) == "resume"
            try:
                if not resume and os.path.exists(spec.output_dir):
                    shutil.rmtree(spec.output_dir)  # no checkpoint: start over (train refuses to overwrite)
                os.makedirs(spec.output_dir, exist_ok=True)
                command = command_for(spec, resume)
            except (OSError, RuntimeError) as exc:
                finish(RunResult(spec, "failed", resume=resume, message=f"could not start: {exc}"))
                continue
            slot = free_slots.pop(0)
            env = dict(env_for(slot) if env_for else os.environ)
            if announce is not None:
                announce(spec, resume, len(results), total)
            future = pool.submit(launch, command, env, os.path.join(spec.output_dir, "train.log"))
            running[future] = (spec, slot, time.perf_counter(), resume, command)

    def collect_finished(done: set[futures.Future]) -> None:
        nonlocal interrupted
        for future in done:
            spec, slot, started, resume, command = running.pop(future)
            free_slots.append(slot)
            free_slots.sort()
            seconds = round(time.perf_counter() - started, 1)
            try:
                code = future.result()
            except KeyboardInterrupt:  # raised by the launcher (a test's fake): the same as Ctrl-C here
                if not interrupted:
                    interrupted = True
                    _signal(launch, signal.SIGINT)
                continue
            except Exception as exc:  # noqa: BLE001 -- a launcher failure is this run's failure
                finish(RunResult(spec, "failed", None, seconds, resume, command, f"could not run: {exc}"))
                continue
            if interrupted and code != 0:
                continue  # stopped by the interrupt: resumed next time
            if code == 0 and run_state(spec, steps) == "done":
                finish(RunResult(spec, "ok", code, seconds, resume, command))
            else:
                why = f"exit {code}" if code != 0 else "exited 0 but its metrics lack steps or the final evaluation"
                finish(RunResult(spec, "failed", code, seconds, resume, command,
                                 f"{why}; see {os.path.join(spec.output_dir, 'train.log')}"))

    pool = futures.ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="ablate-run")
    try:
        while pending or running:
            try:  # Ctrl-C anywhere in here: stop dispatching, ask the running runs to stop, wait for them
                if not interrupted:
                    dispatch(pool)
                if not running:
                    if pending and not interrupted:  # cannot happen: a waiting run's SFT run is running or done
                        raise RuntimeError(f"runs waiting on nothing: {[s.describe() for s in pending]}")
                    break
                done, _ = futures.wait(list(running), return_when=futures.FIRST_COMPLETED)
                collect_finished(done)
            except KeyboardInterrupt:
                if interrupted:  # a second one: kill the runs
                    _signal(launch, signal.SIGKILL)
                else:
                    interrupted = True
                    _signal(launch, signal.SIGINT)
    except BaseException:
        _signal(launch, signal.SIGINT)  # an error of this process: stop the runs rather than wait for them
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    if interrupted:
        raise AblationInterrupted(f"interrupted: {len(results)} of {total} runs finished; run the same command "
                                  "again to resume")
    return results


def _signal(launch: Launch, sig: int) -> None:
    send = getattr(launch, "signal_all", None)
    if send is not None:
        send(sig)


# ---------------------------------------------------------------------------------------------- analysis
def collect(specs: Sequence[RunSpec], results: Mapping[tuple[str, int], RunResult], *, steps: int, k: int,
            threshold: float, window: int, budget: int) -> dict[tuple[str, int], dict[str, Any]]:
    """:func:`~megatron_dynamo.report.ablation.run_summary` of every finished run."""
    from megatron_dynamo.report.ablation import run_summary

    summaries = {}
    for spec in specs:
        result = results.get(spec.key)
        if result is None or not result.ok:
            continue
        records, prompts = read_run(spec.output_dir)
        summaries[spec.key] = run_summary(records, None if spec.is_sft else prompts, eval_step=0 if spec.is_sft
                                          else steps, k=k, threshold=threshold, window=window, budget=budget)
    for spec in specs:  # a shared warm-up is every seed's start: its row holds the one model for each seed
        if spec.sft_seed is not None and (SFT, spec.sft_seed) in summaries:
            summaries.setdefault((SFT, spec.seed), summaries[(SFT, spec.sft_seed)])
    return summaries


def write_outputs(output_dir: str, *, specs: Sequence[RunSpec], results: Mapping[tuple[str, int], RunResult],
                  summaries: Mapping[tuple[str, int], Mapping[str, Any]], analysis: Mapping[str, Any],
                  settings: Mapping[str, Any], budget: int, curves: bool = True) -> dict[str, str]:
    """ablation.json, ablation.md, ablation.png and (``curves``) the report page of every variant run."""
    from megatron_dynamo.report.ablation import format_markdown, plot_ablation

    seeds = analysis["seeds"]
    settings_line = (f"Recipe `{settings['config']}` {' '.join(settings['overrides']) or '(no overrides)'}; "
                     f"{len(seeds)} seed(s) {', '.join(map(str, seeds))}; budget {settings['budget_per_step']} "
                     f"rollouts/step x {settings['steps']} steps = {budget} rollouts per run; SFT warm-up "
                     f"{settings['sft_warmup_steps']} steps ({settings['sft']}); held-out evaluation on "
                     f"{', '.join(settings['benchmarks'])} (n={settings['eval_n']}); threshold "
                     f"{settings['threshold']:g} on the {settings['window']}-step moving mean of reward_mean.")
    failed = [r for r in results.values() if not r.ok]
    if failed:
        settings_line += " Missing from the statistics (failed or skipped): " + ", ".join(
            r.spec.describe() for r in failed) + "."
    markdown = format_markdown(analysis, title="DynaMO ablation", settings_line=settings_line, budget=budget)
    paths = {"json": os.path.join(output_dir, "ablation.json"), "md": os.path.join(output_dir, "ablation.md"),
             "png": os.path.join(output_dir, "ablation.png")}
    runs = []
    for spec in specs:
        result = results.get(spec.key)
        entry: dict[str, Any] = {"variant": spec.variant, "seed": spec.seed, "output_dir": spec.output_dir}
        if result is not None:
            entry.update(status=result.status, returncode=result.returncode, seconds=result.seconds,
                         resumed=result.resumed, command=result.command, message=result.message)
        else:
            entry["status"] = "not run"
        summary = summaries.get(spec.key)
        if summary is not None:
            entry["summary"] = summary
        runs.append(entry)
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump({"settings": dict(settings), "runs": runs, "analysis": analysis, "markdown": markdown}, f,
                  indent=1, default=str)
    with open(paths["md"], "w", encoding="utf-8") as f:
        f.write(markdown)
    plot_ablation(analysis, paths["png"], title=f"DynaMO ablation: {os.path.basename(settings['config'])}, "
                                                f"{len(seeds)} seed(s)")
    if curves:
        from megatron_dynamo.report.page import write_report
        from megatron_dynamo.report.runs import load_run

        loaded = [load_run(spec.output_dir, f"{spec.variant} seed {spec.seed}") for spec in specs
                  if not spec.is_sft and spec.key in summaries]
        if loaded:
            manifest = write_report(loaded, os.path.join(output_dir, "report"),
                                    title=f"DynaMO ablation runs: {os.path.basename(settings['config'])}")
            paths["report"] = manifest["files"]["html"]
    return paths


# ---------------------------------------------------------------------------------------------- the command
def _fail(message: str) -> int:
    print(f"dynamo ablate: {message}", file=sys.stderr)
    return 2


def run(args, launch: Launch | None = None) -> int:
    from megatron_dynamo.config import ConfigError, apply_overrides, load_yaml, to_dict
    from megatron_dynamo.report.ablation import analyse
    from megatron_dynamo.trainer.config import load_run_config

    try:
        seeds = parse_seeds(args.seeds)
        variants = parse_variants(args.variants)
        if args.window < 1:
            raise ValueError(f"--window must be >= 1, got {args.window}")
        if args.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
        if args.bootstrap < 100:
            raise ValueError(f"--bootstrap must be >= 100, got {args.bootstrap}")
        overrides = list(args.overrides)
        for item in overrides:
            if item.split("=", 1)[0].strip() in RESERVED_KEYS:
                raise ValueError(f"override {item!r}: dynamo ablate sets {', '.join(RESERVED_KEYS)} per run")
        raw = apply_overrides(load_yaml(args.config), overrides)
        benchmarks = (raw.get("evaluation") or {}).get("benchmarks") if isinstance(raw.get("evaluation"), dict) \
            else None
        if not benchmarks:
            raise ValueError("the recipe has no evaluation.benchmarks: the final models are evaluated on them (the "
                             "held-out split); set evaluation.benchmarks in the recipe or as an override, e.g. "
                             "evaluation.benchmarks=[<name or JSONL path>]")
        base = load_run_config(args.config, overrides)
        # The recipe's files and dataset names (found in data.data_dir, else the default data directory) and its
        # prompts, before any run starts: one line, not 27 failed runs.
        from megatron_dynamo.trainer.preflight import check_run_inputs, check_training_prompts

        check_run_inputs(base)
        check_training_prompts(base)
        if base.checkpoint.dir is not None:
            raise ValueError("checkpoint.dir is set: every run keeps its checkpoints in its own output directory "
                             "(remove checkpoint.dir)")
        steps = base.trainer.steps
        if steps < 1:
            raise ValueError(f"trainer.steps must be >= 1 for the variant runs, got {steps}")
        with_sft = base.trainer.sft_warmup_steps > 0
        if args.jobs > 1 and base.rollout.tensor_parallel > 1:
            raise ValueError(f"--jobs {args.jobs} with rollout.tensor_parallel={base.rollout.tensor_parallel}: "
                             "concurrent runs would share vLLM's CPU shared-memory names; use --jobs 1")
        # Every run's config, before any compute (as the runs will load it, paths included).
        probe_seed = seeds[0]
        shared_sft_seed = None if args.sft_per_seed else base.trainer.seed
        probe_sft_seed = probe_seed if shared_sft_seed is None else shared_sft_seed
        configs = {}
        sft_dir = run_dir(args.output_dir, SFT, probe_sft_seed)
        if with_sft:
            configs[SFT] = load_run_config(args.config, run_overrides(RunSpec(SFT, probe_sft_seed, sft_dir),
                                                                      overrides, steps))
        placeholder = os.path.join(sft_dir, "checkpoints", "step_000000") if with_sft else None
        for v in variants:
            spec = RunSpec(v, probe_seed, run_dir(args.output_dir, v, probe_seed))
            configs[v] = load_run_config(args.config, run_overrides(spec, overrides, steps, placeholder))
    except (ValueError, ConfigError, OSError) as exc:
        return _fail(str(exc))
    budgets = {name: (c.data.prompts_per_step * c.dynamo.allocation.n_avg, c.trainer.steps)
               for name, c in configs.items() if name != SFT}
    if len(set(budgets.values())) != 1:  # cannot happen with the built-in variants; guards future ones
        return _fail(f"the variants' rollout budgets differ: {budgets}")
    per_step, _ = next(iter(budgets.values()))
    budget = per_step * steps
    k = max(configs[variants[0]].evaluation.k)
    plan = plan_record(args.config, overrides, to_dict(base), {"rollouts_per_step": per_step, "steps": steps,
                                                               "sft_warmup_steps": base.trainer.sft_warmup_steps,
                                                               "sft": "per seed" if args.sft_per_seed else "shared"},
                       seeds, variants)
    plan_path = os.path.join(args.output_dir, PLAN_FILE)
    try:
        existing = None
        if os.path.isfile(plan_path):
            with open(plan_path, encoding="utf-8") as f:
                existing = json.load(f)
        merged = merge_plan(existing, plan)
    except (ValueError, OSError, json.JSONDecodeError) as exc:
        return _fail(f"{plan_path}: {exc}")
    os.makedirs(args.output_dir, exist_ok=True)
    with open(plan_path, "w", encoding="utf-8") as f:
        json.dump(merged, f, indent=1)

    specs = plan_runs(args.output_dir, seeds, variants, with_sft, shared_sft_seed)

    def command_for(spec: RunSpec, resume: bool) -> list[str]:
        checkpoint = None
        if spec.sft_seed is not None:
            checkpoint = sft_checkpoint(run_dir(args.output_dir, SFT, spec.sft_seed))
            if checkpoint is None:
                raise RuntimeError(f"the SFT run of seed {spec.sft_seed} left no checkpoint")
        return train_command(args.config, run_overrides(spec, overrides, steps, checkpoint), resume=resume)

    slots = cpu_slots(args.jobs)
    env_for = lambda slot: child_environment(os.environ, args.jobs, slots[slot])  # noqa: E731
    launcher = launch or SubprocessLauncher()
    print(f"dynamo ablate: {args.config}: {len(variants)} variant(s) x {len(seeds)} seed(s)"
          f"{(' + 1 SFT warm-up per seed' if args.sft_per_seed else ' + 1 shared SFT warm-up') if with_sft else ''}"
          f" = {len(specs)} runs of {steps} steps, "
          f"{per_step} rollouts/step; {args.jobs} at once"
          + (f" ({len(slots[0])} core(s) each)" if args.jobs > 1 else "") + f" -> {args.output_dir}", flush=True)

    def announce(spec: RunSpec, resume: bool, done: int, total: int) -> None:
        print(f"[{done}/{total}] start {spec.describe()}{' (--resume)' if resume else ''}: "
              f"log {os.path.join(spec.output_dir, 'train.log')}", flush=True)

    def report(result: RunResult, done: int, total: int) -> None:
        spec = result.spec
        line = f"[{done}/{total}] {spec.describe()}: "
        if result.status == "reused":
            line += "finished before, reused"
        elif result.status == "skipped":
            line += f"skipped ({result.message})"
        elif result.status == "failed":
            line += f"FAILED ({result.message})"
        else:
            line += f"ok in {result.seconds:.0f}s"
        if result.ok:
            from megatron_dynamo.report.ablation import eval_at, training_rows
            from megatron_dynamo.report.thresholds import tail_mean

            records, _ = read_run(spec.output_dir)
            numbers = []
            if not spec.is_sft:
                final = tail_mean([float(r["reward_mean"]) for r in training_rows(records)])
                if final is not None:
                    numbers.append(f"final reward {final:.3f}")
            pass1 = eval_at(records, 0 if spec.is_sft else steps).get("eval/avg/pass@1")
            if pass1 is not None:
                numbers.append(f"held-out pass@1 {pass1:.3f}")
            if numbers:
                line += ": " + ", ".join(numbers)
        print(line, flush=True)

    previous_term = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        signal.signal(signal.SIGTERM, on_term)
    try:
        # A shared warm-up runs first and alone, on every core (no other run can start before it ends).
        shared = [s for s in specs if s.is_sft] if shared_sft_seed is not None else []
        results = execute(shared, steps, command_for, launcher, jobs=1, report=report, announce=announce,
                          env_for=lambda slot: child_environment(os.environ, 1, None)) if shared else {}
        rest = [s for s in specs if s not in shared]
        if shared and not results[shared[0].key].ok:
            results.update({s.key: RunResult(s, "skipped", message="the shared SFT run failed") for s in rest})
        else:
            results.update(execute(rest, steps, command_for, launcher, jobs=args.jobs, env_for=env_for,
                                   report=report, announce=announce))
    except AblationInterrupted as exc:
        print(f"dynamo ablate: {exc}", file=sys.stderr)
        return 130
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous_term)

    summaries = collect(specs, results, steps=steps, k=k, threshold=args.threshold, window=args.window,
                        budget=budget)
    analysis = analyse(summaries, variants, seeds, k=k, resamples=args.bootstrap)
    evaluation = configs[variants[0]].evaluation
    settings = {"config": args.config, "overrides": overrides, "seeds": seeds, "variants": variants,
                "budget_per_step": per_step, "steps": steps, "budget": budget,
                "sft_warmup_steps": base.trainer.sft_warmup_steps, "benchmarks": list(evaluation.benchmarks),
                "sft": "one per seed" if args.sft_per_seed else f"one shared by all seeds, seed {base.trainer.seed}",
                "eval_n": evaluation.n, "k": k, "threshold": args.threshold, "window": args.window,
                "bootstrap": args.bootstrap, "jobs": args.jobs,
                "variant_overrides": {v: list(VARIANTS[v].overrides()) for v in variants}}
    paths = write_outputs(args.output_dir, specs=specs, results=results, summaries=summaries, analysis=analysis,
                          settings=settings, budget=budget)
    with open(paths["md"], encoding="utf-8") as f:
        print("\n" + f.read())
    print("wrote " + ", ".join(paths.values()))
    failed = [r for r in results.values() if not r.ok]
    if failed:
        print(f"dynamo ablate: {len(failed)} run(s) failed or were skipped: "
              + ", ".join(r.spec.describe() for r in failed), file=sys.stderr)
    return 0 if not failed else 1
