"""Real jobs on a real Slurm: two nodes (n1, n2) on this host, brought up by ``scripts/local_slurm.sh up``
(scripts/run_tests.sh does it where it can: root and apt). Without a cluster these tests skip with the reason.

The CPU recipe is kept short (few steps, few prompts, a short warm-up): the whole module must fit in CI's budget.
Every job is checked against a run of the same recipe without Slurm (``dynamo train --nproc 2``): the metrics that
are not timings must be equal.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_dynamo.launch.nemo import STOP_GRACE_S

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slurm

# Short CPU runs: 4 RL steps of 16 prompts after 10 warm-up steps, no periodic checkpoint (only the stop's and the
# last step's), no plots.
STEPS = 4
RECIPE = ["configs/cpu_default.yaml"]
OVERRIDES = [f"trainer.steps={STEPS}", "trainer.sft_warmup_steps=10", "data.prompts_per_step=16",
             "trainer.mini_batch_prompts=16", "checkpoint.every=100", "logging.progress=false",
             "logging.plot=false", "logging.tensorboard=false"]
# Keys that differ from run to run without meaning (wall-clock timings, throughput, start-up phases), the weight
# transfer's counts (engines on ranks of their own get no weights after the step a run stops at: they generate
# nothing more), and the reward's cache counts (a resumed run starts with an empty cache of verdicts; the rewards
# are the same).
TIMING = re.compile(r"^(time/|startup/|phase/|weight_sync/|.*seconds|.*per_s|.*_s$|perf/|throughput|"
                    r"reward/(cache_hits|num_verified)$)")


def _slurm_state() -> str | None:
    """None when the local cluster answers with both nodes usable, else why not."""
    if shutil.which("sinfo") is None:
        return "Slurm is not installed (scripts/local_slurm.sh up installs it as root)"
    proc = subprocess.run(["bash", str(ROOT / "scripts/local_slurm.sh"), "status"], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"the local Slurm cluster is not up (scripts/local_slurm.sh up): {proc.stdout.strip()}"
    return None


@pytest.fixture(scope="module")
def slurm():
    reason = _slurm_state()
    if reason:
        pytest.skip(reason)
    return True


def _env(**extra: str) -> dict[str, str]:
    """The submission environment (sbatch exports it to the job): this Python's bin first, no launcher variables."""
    from megatron_dynamo.parallel.runtime import single_process_environment

    env = single_process_environment()
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **extra}


def sbatch(script: str, *options: str, **variables: str) -> int:
    proc = subprocess.run(["sbatch", "--parsable", *options, str(ROOT / script)], capture_output=True, text=True,
                          env=_env(**variables), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.strip().split(";")[0])


def job_info(job: int) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", str(job)], capture_output=True, text=True).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def wait_for(condition, timeout: float, what: str, job: int | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    details = f"\njob: {job_info(job)}" if job else ""
    details += f"\nlog:\n{log.read_text()[-4000:]}" if log and log.exists() else ""
    for rank_log in sorted(log.parent.glob("log-*.out")) if log else ():  # nemo-run's per-start rank logs
        details += f"\n{rank_log.name}:\n{rank_log.read_text()[-3000:]}"
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}{details}")


def release(job: int, log: Path | None = None) -> float:
    """A requeued job waits about 2 minutes (its BeginTime) before it starts again: let it start now, once its
    last start has ended on every node (released while the nodes still complete it, Slurm kills the new start:
    "Job credential revoked"). The wait allows the ranks what the launchers allow them to stop (torchrun's agent:
    launch/nemo.STOP_GRACE_S, 270 s) plus a minute; a failure shows the ranks' logs beside the batch log."""
    def idle() -> bool:
        states = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True).stdout.split()
        return bool(states) and all(state == "idle" for state in states)

    def settled() -> bool:
        # Every node idle, and still idle a moment later: right after the requeue the nodes can still show the
        # last start as allocated before they pass through "completing" (released then: credential revoked).
        if job_info(job).get("JobState") != "PENDING" or not idle():
            return False
        time.sleep(2)
        return idle()

    signalled = time.monotonic()
    wait_for(settled, STOP_GRACE_S + 60, "the requeued job to be pending on idle nodes", job, log)
    print(f"\nrequeued and settled {time.monotonic() - signalled:.0f} s after the signal")
    start = time.monotonic()
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True, capture_output=True)
    return start


def finished(job: int) -> str | None:
    state = job_info(job).get("JobState")
    return state if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY") else None


def metrics(run_dir: Path) -> dict[int, dict]:
    """Each step's last metrics line (a resumed run writes the steps after its checkpoint again)."""
    rows = {}
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows[row["step"]] = row
    return rows


def assert_same_metrics(got: dict[int, dict], want: dict[int, dict]) -> None:
    """Same steps; counts, rewards and allocations exactly equal (the same samples were drawn and scored); float
    statistics of the model within rel 1e-5 or abs 1e-6 (the two launchers run the same computation on differently
    threaded CPU kernels: 1e-7 apart here)."""
    assert sorted(got) == sorted(want)
    for step in want:
        keys = {k for k in want[step] if not TIMING.match(k)} - {"rollout/engine_tokens_max_over_mean"}
        assert keys <= set(got[step]), (step, keys - set(got[step]))
        for key in sorted(keys):
            a, b = got[step][key], want[step][key]
            if isinstance(b, float) and not key.startswith(("reward", "alloc")):
                # abs 1e-6: statistics that are float noise themselves; the engine-trainer log-prob gap is float32
                # rounding of log-probs up to ~10 in size (eps x 10 = 1.2e-6): 1e-5 for it (on one AMD EPYC the
                # two launchers' maxima were 8.3e-7 and 1.9e-6)
                noise = 1e-5 if key.startswith("rollout/logp_gap") else 1e-6
                assert a == pytest.approx(b, rel=1e-5, abs=noise), (step, key, a, b)
            else:
                assert a == b, (step, key, a, b)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same recipe without Slurm: `dynamo train --nproc 2`, uninterrupted."""
    out = tmp_path_factory.mktemp("reference") / "run"
    proc = subprocess.run([sys.executable, "-m", "megatron_dynamo.cli", "train", *RECIPE, *OVERRIDES,
                           f"trainer.output_dir={out}", "--nproc", "2"], capture_output=True, text=True,
                          env=_env(), cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = metrics(out)
    assert sorted(rows) == list(range(1, STEPS + 1))
    return rows


def train_job(run_dir: Path, log: Path, *extra_overrides: str, stop_grace: int = 120) -> int:
    """train.sbatch with the CPU recipe on 2 nodes x 1 rank (torchrun on each node)."""
    return sbatch("scripts/slurm/train.sbatch", "--nodes=2", "--gpus-per-node=0", f"--output={log}",
                  "--job-name=dynamo-test", CONFIG=RECIPE[0], GPUS_PER_NODE="1", OUTPUT_DIR=str(run_dir),
                  OVERRIDES=" ".join([*OVERRIDES, *extra_overrides]), CODE_DIR=str(ROOT),
                  MASTER_PORT=str(29600 + os.getpid() % 1000), STOP_GRACE=str(stop_grace))


def test_train_sbatch_two_nodes_time_limit_saves_requeues_and_resumes_exactly(slurm, reference, tmp_path):
    """One job shows three things: train.sbatch on 2 nodes x 1 rank equals `--nproc 2`; the time-limit signal
    (what --signal=B:USR1@300 delivers, sent with `scancel --signal=USR1 --batch`) makes the ranks save the step
    they are on, the job requeues and resumes from that checkpoint to the same final metrics; and the trainer's
    HF export (checkpoint.export_hf) works from a rank of a torchrun job (the converter runs as one process)."""
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    started = time.monotonic()
    job = train_job(run_dir, log, "checkpoint.export_hf=true")
    # Signal while step 3 runs (steps 1 and 2 are logged).
    wait_for(lambda: 2 in metrics(run_dir), 300, "step 2 of the job", job, log)
    signalled_after = max(metrics(run_dir))
    subprocess.run(["scancel", "--signal=USR1", "--batch", str(job)], check=True)
    release_started = release(job, log)
    state = wait_for(lambda: finished(job), 400, "the requeued job to finish", job, log)
    wall = time.monotonic() - started
    text = log.read_text()
    assert state == "COMPLETED", text[-4000:]
    assert job_info(job).get("Restarts") == "1", job_info(job)
    saved = re.search(r"stopped by SIGTERM after step (\d+): its checkpoint is saved", text)
    assert saved, text[-4000:]
    saved_step = int(saved.group(1))
    assert saved_step in (signalled_after, signalled_after + 1), (signalled_after, saved_step)
    assert "ranks stopped (exit" in text and "requeue job" in text
    # The second start resumed from the saved step, not from the last periodic checkpoint (there is none).
    second = text[text.index("(restart 1)"):]
    assert f"--resume: loaded step {saved_step} from" in second, second[:2000]
    ran_again = re.findall(r'"step": (\d+)', (run_dir / "metrics.jsonl").read_text())
    recomputed = len(ran_again) - STEPS
    assert recomputed in (0, 1), ran_again
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    assert_same_metrics(metrics(run_dir), reference)
    assert (run_dir / "hf" / "config.json").is_file() and any((run_dir / "hf").glob("*.safetensors"))
    print(f"\nrequeue: signal during step {signalled_after + 1}, saved step {saved_step}, resumed from step "
          f"{saved_step}, steps recomputed {recomputed}; job wall {wall:.0f} s (released "
          f"{time.monotonic() - release_started:.0f} s before the end); second start log:\n{second[:300]}")


@pytest.mark.extended
def test_srun_per_rank_preempted_mid_checkpoint_resumes_and_scancel_leaves_nothing(slurm, tmp_path):
    """srun with one task per rank (no torchrun, as the README shows): the job trains on 2 nodes; `scontrol
    requeue` while a checkpoint is being written (preemption) restarts it; the next start ignores the partial
    checkpoint and resumes from the last complete one; `scancel` then leaves no process of the job on either
    node."""
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    steps = 300  # never reached: the job is cancelled; a checkpoint after every step
    train = [sys.executable, "-m", "megatron_dynamo.cli", "train", *RECIPE, *OVERRIDES, f"trainer.steps={steps}",
             "trainer.sft_warmup_steps=0", "checkpoint.every=1", "checkpoint.keep_last=3",
             f"trainer.output_dir={run_dir}", "--resume"]
    command = "srun --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 " + " ".join(train)
    job = sbatch_wrap(command, "--nodes=2", "--requeue", "--open-mode=append", f"--output={log}",
                      "--job-name=dynamo-preempt")
    checkpoints = run_dir / "checkpoints"

    def writing():
        return list(checkpoints.glob("step_*.tmp")) if 1 in metrics(run_dir) else []

    partial = wait_for(writing, 400, "a checkpoint being written", job, log)
    subprocess.run(["scontrol", "requeue", str(job)], check=True)
    complete_then = sorted(p.name for p in checkpoints.glob("step_??????"))
    release(job)
    header = "dynamo train: 2 ranks (srun)"

    def second_start():
        parts = log.read_text().split(header)
        if len(parts) < 3:
            return None
        return re.search(r"--resume: (loaded step (\d+) from \S+|no checkpoint under \S+; starting from scratch)",
                         parts[2])

    resumed = wait_for(second_start, 300, "the restarted job to load a checkpoint or start anew", job, log)
    second = log.read_text().split(header)[2]
    cut = int(partial[0].name[5:11])
    if resumed.group(2) is not None:  # a complete checkpoint: the one being written (finished within KillWait)
        step = int(resumed.group(2))    # or the one before it
        assert step in (cut, cut - 1) and (checkpoints / f"step_{step:06d}").is_dir(), (step, partial)
    else:  # the save was cut short and there was no earlier checkpoint
        step = 0
        assert cut == 1 and f"ignoring {partial[0]}, the leftover of an interrupted save" in second, second[:3000]
    def lines() -> int:
        path = run_dir / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    before = lines()
    wait_for(lambda: lines() > before, 300, "a step after the restart", job, log)
    subprocess.run(["scancel", str(job)], check=True)
    wait_for(lambda: finished(job), 120, "the cancelled job to end", job, log)

    def survivors():
        ps = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
        return [line for line in ps.splitlines() if str(run_dir) in line]

    # Slurm sends SIGTERM, then SIGKILL after KillWait (30 s) to every process of the job's steps on every node.
    deadline = time.monotonic() + 45
    while survivors() and time.monotonic() < deadline:
        time.sleep(1)
    assert not survivors(), survivors()
    print(f"\npreemption: requeued while writing {partial[0].name}; complete then: {complete_then}; "
          f"restarted from step {step} ({resumed.group(1)})")


def sbatch_wrap(command: str, *options: str) -> int:
    proc = subprocess.run(["sbatch", "--parsable", *options, "--wrap", command], capture_output=True, text=True,
                          env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.strip().split(";")[0])


PROBE = """
import os
from megatron_dynamo.parallel import runtime
from megatron_dynamo.rollout import vllm_setup
from megatron_dynamo.parallel.topology import EngineLayout
kind = runtime.launcher()
info = runtime.init_distributed()
os.environ.pop("LOCAL_RANK", None)
vllm_setup.launch_environment(EngineLayout(info.rank, info.world_size, 1))
print("PROBE", kind, info.rank, info.world_size, info.local_rank, os.environ["SLURM_LOCALID"],
      os.environ["LOCAL_RANK"], flush=True)
runtime.shutdown()
"""


def test_srun_task_per_rank_maps_slurm_localid_to_the_local_rank(slurm):
    """4 srun tasks on 2 nodes (2 per node): ranks 2 and 3 are local ranks 0 and 1 of n2, for the trainer's runtime
    and for vLLM's LOCAL_RANK (it was the global rank: a GPU index the node does not have)."""
    proc = subprocess.run(["srun", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--overcommit",
                           sys.executable, "-c", PROBE], capture_output=True, text=True, env=_env(), cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = sorted(tuple(line.split()[1:]) for line in proc.stdout.splitlines() if line.startswith("PROBE"))
    assert rows == [("slurm", str(r), "4", str(r % 2), str(r % 2), str(r % 2)) for r in range(4)], proc.stdout


@pytest.mark.extended
def test_convert_sbatch_both_directions_with_its_own_workers(slurm, tmp_path):
    """convert.sbatch's one srun task converts HF -> Megatron at TP 2 (it spawns its 2 workers itself: a launch of
    one task is no launcher of ranks) and back; the round trip is bit-identical."""
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_reference import TINY_QWEN2, hf_model
    from safetensors.torch import load_file

    hf_model(TINY_QWEN2, seed=0).save_pretrained(tmp_path / "hf")
    for direction, src, out, extra in (("hf-to-megatron", "hf", "meg", {"TP": "2"}),
                                       ("megatron-to-hf", "meg", "back", {})):
        log = tmp_path / f"{direction}.out"
        job = sbatch("scripts/slurm/convert.sbatch", f"--output={log}", DIRECTION=direction,
                     SRC=str(tmp_path / src), OUT=str(tmp_path / out), CODE_DIR=str(ROOT), **extra)
        state = wait_for(lambda: finished(job), 300, f"{direction} to finish", job, log)
        assert state == "COMPLETED", log.read_text()[-3000:]
    original = load_file(tmp_path / "hf" / "model.safetensors")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(original) == sorted(back)
    assert all(original[k].dtype == back[k].dtype and (original[k] == back[k]).all() for k in original)


def test_launch_run_yaml_through_nemo_run_slurm_executor_saves_on_usr1_and_finishes(slurm, tmp_path):
    """`dynamo launch run configs/cpu_default.yaml --executor slurm` (nemo-run's SlurmExecutor, LocalTunnel, the
    checkout linked as the job's code) on 2 nodes x 1 CPU rank: nemo-run's `--signal=USR1@300` (no `B:`) sent by
    hand mid-run reaches torchrun and the ranks; the ranks save the step they are on, nemo-run's script requeues,
    the next start resumes from that step and the job COMPLETES with every step logged."""
    run_dir, job_dir = tmp_path / "run", tmp_path / "jobs"
    proc = subprocess.run([sys.executable, "-m", "megatron_dynamo.cli", "launch", "run", *RECIPE, "--executor",
                           "slurm", "--nodes", "2", "--gpus-per-node", "0", "--code-dir", str(ROOT), "--job-dir",
                           str(job_dir), "--rdzv-port", str(29700 + os.getpid() % 1000), *OVERRIDES,
                           f"trainer.output_dir={run_dir}"], capture_output=True, text=True, env=_env(), cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0 and "# cpu_default: SUBMITTED" in proc.stdout, proc.stdout + proc.stderr
    # nemo-run's batch log: <job dir>/experiments/cpu_default/<experiment>/cpu_default/sbatch_dynamo-..._<id>.out
    found = wait_for(lambda: list(job_dir.glob("experiments/cpu_default/*/cpu_default/sbatch_*.out")), 60,
                     "nemo-run's batch log")
    log = found[0]
    job = int(log.stem.rsplit("_", 1)[1])
    wait_for(lambda: 2 in metrics(run_dir), 300, "step 2 of the job", job, log)
    signalled_after = max(metrics(run_dir))
    subprocess.run(["scancel", "--signal=USR1", str(job)], check=True)  # what --signal=USR1@300 delivers
    release(job, log)
    state = wait_for(lambda: finished(job), 400, "the requeued job to finish", job, log)
    ranks = "".join(p.read_text() for p in sorted(log.parent.glob("log-*.out")))
    assert state == "COMPLETED", log.read_text()[-3000:] + ranks[-3000:]
    assert job_info(job).get("Restarts") == "1", job_info(job)
    saved = re.search(r"stopped by SIGUSR1 after step (\d+): its checkpoint is saved", ranks)
    assert saved, ranks[-4000:]
    saved_step = int(saved.group(1))
    assert saved_step in (signalled_after, signalled_after + 1), (signalled_after, saved_step)
    assert f"--resume: loaded step {saved_step} from" in ranks, ranks[-4000:]
    assert sorted(metrics(run_dir)) == list(range(1, STEPS + 1))
    assert (run_dir / "checkpoints" / f"step_{STEPS:06d}").is_dir()
    print(f"\nnemo-run: signal during step {signalled_after + 1}, saved step {saved_step}, resumed from it")


SEPARATE = ["rollout.placement=separate", "rollout.engine_ranks=1", "rollout.max_staleness=1"]


@pytest.fixture(scope="module")
def separate_reference(tmp_path_factory):
    """The recipe with its engine on a rank of its own, one step ahead, without Slurm (`--nproc 2`)."""
    out = tmp_path_factory.mktemp("separate_reference") / "run"
    proc = subprocess.run([sys.executable, "-m", "megatron_dynamo.cli", "train", *RECIPE, *OVERRIDES, *SEPARATE,
                           f"trainer.output_dir={out}", "--nproc", "2"], capture_output=True, text=True,
                          env=_env(), cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = metrics(out)
    assert [rows[s]["rollout/staleness_max"] for s in sorted(rows)] == [0, 1, 1, 1]
    return rows


@pytest.mark.extended
def test_train_sbatch_engine_node_one_step_ahead_requeues_and_resumes_exactly(slurm, separate_reference, tmp_path):
    """train.sbatch on 2 nodes x 1 rank with the engine on the second node (rollout.placement=separate, one step
    off-policy): the time-limit signal makes the trainer save the step it is on with the batch generated ahead,
    the job requeues, and the resumed run is the uninterrupted one, step for step."""
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    job = train_job(run_dir, log, *SEPARATE)
    wait_for(lambda: 2 in metrics(run_dir), 300, "step 2 of the job", job, log)
    subprocess.run(["scancel", "--signal=USR1", "--batch", str(job)], check=True)
    release(job, log)
    state = wait_for(lambda: finished(job), 400, "the requeued job to finish", job, log)
    text = log.read_text()
    assert state == "COMPLETED", text[-4000:]
    saved = re.search(r"stopped by SIGTERM after step (\d+): its checkpoint is saved", text)
    assert saved, text[-4000:]
    second = text[text.index("(restart 1)"):]
    assert f"--resume: loaded step {saved.group(1)} from" in second, second[:2000]
    assert "rollout engine of 1 rank on rank 1 of its own" in text
    assert_same_metrics(metrics(run_dir), separate_reference)


def _launch_cpu_default(job_dir: Path, *overrides: str) -> tuple[int, Path]:
    """`dynamo launch run configs/cpu_default.yaml --executor slurm` on one node (retries 3): (job id, batch log)."""
    proc = subprocess.run([sys.executable, "-m", "megatron_dynamo.cli", "launch", "run", *RECIPE, "--executor",
                           "slurm", "--gpus-per-node", "0", "--code-dir", str(ROOT), "--job-dir", str(job_dir),
                           "--retries", "3", "--rdzv-port", str(29800 + os.getpid() % 100), *OVERRIDES,
                           *overrides], capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=180)
    assert proc.returncode == 0 and "SUBMITTED" in proc.stdout, proc.stdout + proc.stderr
    # The batch log appears when the job starts (other jobs may hold the nodes).
    found = wait_for(lambda: list(job_dir.glob("experiments/cpu_default/*/cpu_default/sbatch_*.out")), 900,
                     "the job to start")
    return int(found[0].stem.rsplit("_", 1)[1]), found[0]


def _rank_of(job: int) -> int:
    """The pid of this job's training rank (torchrun's worker: fdl_runner, SLURM_JOB_ID in its environment)."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"nemo_run.core.runners.fdl_runner" in cmdline and not any(b"torchrun" in part for part in cmdline) \
                and f"SLURM_JOB_ID={job}".encode() in environ:
            return int(proc.name)
    pytest.fail(f"no rank of job {job} found")


def test_launch_a_config_error_ends_the_job_at_once_and_a_killed_rank_requeues(slurm, tmp_path):
    """Issue 33: nemo-run's batch script requeued on any non-zero exit (TORCHX_MAX_RETRIES), so a config error
    (exit 2) ran --retries times. Now the job ends FAILED at once with the line in its log; a rank killed by
    SIGKILL (a node failure, the OOM killer: no line from it) still requeues (tests/test_requeue.py: every case)."""
    # A config error the launcher cannot see: the data file is looked for on the cluster, when the job starts.
    job, log = _launch_cpu_default(tmp_path / "bad" / "jobs", "data.train=/nonexistent/train.jsonl",
                                   f"trainer.output_dir={tmp_path / 'bad' / 'run'}")
    # Before: FAILED, then requeued (Restarts 1, PENDING for its 2-minute BeginTime), 3 times.
    wait_for(lambda: finished(job) or job_info(job).get("Restarts") not in (None, "0"), 300,
             "the job to end or requeue", job, log)
    info = job_info(job)
    steps = "".join(p.read_text() for p in log.parent.glob("log-*.out"))
    assert (info.get("JobState"), info.get("Restarts")) == ("FAILED", "0"), (info, log.read_text()[-3000:])
    assert "/nonexistent/train.jsonl" in steps and "not requeued: bad input (exit 2)" in steps, steps[-3000:]
    assert f"dynamo: job {job} is not requeued: bad input (exit 2)" in log.read_text()

    run_dir = tmp_path / "kill" / "run"
    job, log = _launch_cpu_default(tmp_path / "kill" / "jobs", "trainer.steps=200", f"trainer.output_dir={run_dir}")
    wait_for(lambda: (run_dir / "metrics.jsonl").exists(), 400, "the first step", job, log)
    os.kill(_rank_of(job), 9)  # the job's rank, which this test started through Slurm
    wait_for(lambda: job_info(job).get("Restarts") == "1", 300, "the requeue", job, log)
    subprocess.run(["scancel", str(job)], check=True)
    wait_for(lambda: finished(job), 120, "the cancelled job to end", job, log)
    assert f"dynamo: job {job} is not requeued" not in log.read_text()
