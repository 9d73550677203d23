"""The trainer: config checks, batch layout, atomic checkpoints, and end-to-end runs of `dynamo train` with the
real vLLM (CPU build), real math-verify and Megatron on CPU: metrics, checkpoints, and exact resume."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from hf_reference import REPO, TINY_QWEN2
from samples import synthetic_eval_args
from megatron_dynamo.config import ConfigError
from megatron_dynamo.trainer.batch import Sample, make_micro_batches, shard_for_rank, split_mini_batches
from megatron_dynamo.trainer.config import load_run_config

CPU_DEFAULT = os.path.join(REPO, "configs", "cpu_default.yaml")


def test_cpu_default_and_grpo_switch():
    run = load_run_config(CPU_DEFAULT)
    assert run.dynamo.allocation.enabled and run.dynamo.modulation.gc and run.dynamo.modulation.ums
    grpo = load_run_config(CPU_DEFAULT, algo="grpo")
    assert not grpo.dynamo.allocation.enabled and not grpo.dynamo.modulation.enabled
    assert grpo.dynamo.loss == run.dynamo.loss


@pytest.mark.parametrize("override,message", [
    ("trainer.stpes=3", r"^trainer.stpes: no such key \(did you mean trainer.steps\?\)"),
    ("dynamo.allocation.n_avg=30", "n_avg"),
    ("dynamo.loss.clip_low=2", "clip_low"),
    ("rollout.temperature=0", "temperature"),
    ("data.prompts_per_step=33", "multiple of trainer.mini_batch_prompts"),
    ("dynamo.loss.kl_coef=0.1", "kl_coef"),
    ("rollout.engine=vlm", r"^rollout.engine: must be one of \['vllm'\], got 'vlm'$"),
    ("rollout.sleep_level=3", r"^rollout.sleep_level: must be 1 or 2, got 3$"),
    ("rollout.weight_sync_bucket_mb=64", "weight_sync_bucket_mb"),  # removed: weights are loaded in process
])
def test_bad_config_is_rejected_before_compute(override, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(CPU_DEFAULT, [override])


@pytest.mark.slow
def test_bad_evaluation_settings_are_rejected_before_compute(tmp_path):
    with pytest.raises(ConfigError, match=r"evaluation: every k must lie in \[1, n=4\]"):
        load_run_config(CPU_DEFAULT, ["evaluation.every=2", "evaluation.n=4", "evaluation.k=[8]"])
    with pytest.raises(ConfigError, match=r"^evaluation.every: must be >= 0"):
        load_run_config(CPU_DEFAULT, ["evaluation.every=-1"])
    # A benchmark whose prompts do not fit the rollout engine fails when the trainer starts, not at step N.
    proc = subprocess.run([sys.executable, "-m", "megatron_dynamo.cli", "train", CPU_DEFAULT,
                           f"trainer.output_dir={tmp_path}", "evaluation.every=1", "evaluation.benchmarks=[aime24]",
                           f"evaluation.data_dir={REPO}/tests/fixtures/math"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 1 and "exceed the engine's 21 prompt tokens" in proc.stderr, proc.stderr[-2000:]
    assert not os.path.exists(tmp_path / "checkpoints")


def _samples():
    return [Sample(0, "a", (5, 6, 7), (8, 9), 1.0, 0.5), Sample(1, "b", (5,), (1, 2, 3), 0.0, -1.0),
            Sample(2, "a", (5, 6, 7), (4,), 0.0, -0.5), Sample(3, "c", (9, 9), (7,), 1.0, 0.0)]


def test_micro_batch_layout_marks_exactly_the_response_labels():
    (mb,) = make_micro_batches(_samples()[:2], micro_batch_size=3, pad_token_id=0)
    assert mb.input_ids.shape == (3, 4)
    assert mb.input_ids[0].tolist() == [5, 6, 7, 8] and mb.labels[0].tolist() == [6, 7, 8, 9]
    assert mb.loss_mask[0].tolist() == [0, 0, 1, 1]
    assert mb.labels[1][:3].tolist() == [1, 2, 3] and mb.loss_mask[1].tolist() == [1, 1, 1, 0]
    assert mb.sample_index.tolist() == [0, 1, -1] and mb.loss_mask[2].sum() == 0
    assert mb.advantages.tolist() == [0.5, -1.0, 0.0]


def test_mini_batches_follow_prompt_ids_and_shards_cover_everything():
    minis = split_mini_batches(_samples(), ["a", "b", "c"], prompts_per_mini_batch=2)
    assert [[s.index for s in m] for m in minis] == [[0, 2, 1], [3]]
    shards = [shard_for_rank(minis[0], r, 2) for r in range(2)]
    assert sorted(s.index for shard in shards for s in shard) == [0, 1, 2]


def _checkpoint_worker(rank, world_size, root):
    from megatron.core import dist_checkpointing

    from megatron_dynamo.models.qwen import load_hf_config
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer import checkpoint as ckpt
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig

    runtime.init_distributed(runtime.ParallelConfig(), seed=0)
    actor = MegatronActor(TINY_QWEN2, optim=OptimConfig(lr=1e-3))
    batch = {"input_ids": torch.arange(1, 9).unsqueeze(0)}
    actor.forward_backward([batch], lambda logits, mb: (logits.square().mean(), {}))
    actor.optimizer_step()  # the optimizer has Adam state to save, as in training
    saved = {n: p.detach().clone() for n, p in actor.named_parameters()}
    args = (actor.chunks, actor.optimizer, {"history": {"x": 1}}, load_hf_config(TINY_QWEN2), "fp32", 2, {"tp": 1})
    ckpt.save_checkpoint(root, 1, *args)

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    original, dist_checkpointing.save = dist_checkpointing.save, full_disk
    try:
        ckpt.save_checkpoint(root, 2, *args)
        failed = None
    except ckpt.CheckpointSaveError as exc:
        failed = str(exc)
    finally:
        dist_checkpointing.save = original
    with torch.no_grad():
        for _, p in actor.named_parameters():
            p.add_(1.0)
    latest = ckpt.latest_checkpoint(root)
    state = ckpt.load_checkpoint(latest, actor.chunks, actor.optimizer)
    restored = all(torch.equal(saved[n], p) for n, p in actor.named_parameters())
    return {"failed": failed, "latest": os.path.basename(latest), "state": state["history"],
            "restored": restored, "entries": sorted(os.listdir(root))}


@pytest.mark.distributed
def test_full_disk_during_save_keeps_the_previous_checkpoint(tmp_path):
    from multiproc import run_on_ranks

    (out,) = run_on_ranks(_checkpoint_worker, 1, str(tmp_path / "ckpt"))
    # (an ENOSPC raised by hand: the real full disk is tests/test_checkpoint_faults.py's)
    assert out["failed"].startswith(f"checkpoint of step 2 not saved in {tmp_path / 'ckpt'}: no space left on device")
    assert out["failed"].endswith("step_000002.tmp removed, latest is still step_000001")
    assert out["latest"] == "step_000001" and out["entries"] == ["latest", "step_000001"]
    assert out["restored"] and out["state"] == {"x": 1}


def _train(output_dir, *extra, env=None):
    cmd = [sys.executable, "-m", "megatron_dynamo.cli", "train", CPU_DEFAULT, f"trainer.output_dir={output_dir}",
           "trainer.sft_warmup_steps=30", "data.prompts_per_step=8", "trainer.mini_batch_prompts=4",
           "dynamo.allocation.n_avg=4", "dynamo.allocation.n_min=2", "dynamo.allocation.n_max=6",
           "data.synthetic_problems=16", "checkpoint.every=2", "logging.tensorboard=true", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], proc.stdout


def _eval_args(output_dir):
    """Periodic evaluation (before training and every 2 steps) on a JSONL benchmark of synthetic problems."""
    return synthetic_eval_args(output_dir, n=4, k=(2, 4))


HAS_WANDB = importlib.util.find_spec("wandb") is not None


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    extra, env = [], None
    if HAS_WANDB:  # W&B offline (no network, nothing outside the test's directories) next to TensorBoard
        wandb_home = tmp_path_factory.mktemp("wandb_home")
        env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(wandb_home),
               "WANDB_CONFIG_DIR": str(wandb_home / "config"), "WANDB_CACHE_DIR": str(wandb_home / "cache")}
        extra = ["logging.wandb.mode=offline"]
    metrics, stdout = _train(out, "trainer.steps=4", "checkpoint.export_hf=true", "logging.rollouts=true",
                             *_eval_args(out), *extra, env=env)
    return out, metrics, stdout


def _documented_metrics() -> dict[str, str]:
    """docs/metrics.md's tables: ``{key pattern: "logged" column}``."""
    documented = {}
    with open(os.path.join(REPO, "docs", "metrics.md"), encoding="utf-8") as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("| `") and len(cells) == 4:
                documented[cells[0].strip("`")] = cells[3]
    return documented


def _key_regex(pattern: str):
    return re.compile(re.escape(pattern).replace("<benchmark>", "[^/]+").replace("<k>", r"\d+")
                      .replace("<layer>", r"\d+"))


@pytest.mark.slow
def test_metrics_jsonl_holds_exactly_the_documented_keys(uninterrupted):
    # The run has what a key can depend on: DynaMO with GC and UMS, evaluation (step 0 and every 2 steps).
    _, metrics, _ = uninterrupted
    documented = _documented_metrics()
    assert len(documented) > 50 and "reward_mean" in documented and "eval/<benchmark>/pass@<k>" in documented
    logged = set().union(*metrics)
    regexes = {pattern: _key_regex(pattern) for pattern in documented}
    undocumented = sorted(k for k in logged if not any(r.fullmatch(k) for r in regexes.values()))
    never_logged = sorted(p for p, r in regexes.items()
                          if not documented[p].startswith("only") and not any(r.fullmatch(k) for k in logged))
    assert not undocumented and not never_logged, (undocumented, never_logged)
    assert not any(k.count("/") > 1 and k.split("/")[0] == k.split("/")[1] for k in logged)  # no reward/reward/...
    # eq. 3: beta_comp >= 1 on every positive-advantage token, so its mean over them too (a micro-batch without
    # positive tokens has no mean to add)
    compensation = [m["modulation/beta_comp_mean_pos"] for m in metrics if "modulation/beta_comp_mean_pos" in m]
    assert compensation and min(compensation) >= 1.0


def _wandb_records(path):
    """The protobuf records of an offline W&B run file (``run-<id>.wandb``: W&B's header, then LevelDB-log framed
    ``wandb_internal_pb2.Record`` messages in 32 KiB blocks)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL, or LAST of a fragmented record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending + chunk if kind == 4 else chunk)
            pending = b""
            yield record
        elif kind in (2, 3):  # FIRST / MIDDLE
            pending = chunk if kind == 2 else pending + chunk
        else:
            pos += block - pos % block if length == 0 else 0


@pytest.mark.slow
@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed (the `wandb` extra)")
def test_wandb_offline_run_logs_the_same_keys_steps_and_config(uninterrupted):
    import glob

    out, metrics, _ = uninterrupted
    (run_file,) = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    history, config, exit_code = {}, {}, None
    for record in _wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
            keys = {k for k in items if not k.startswith("_")}
            # A histogram (alloc_counts) is stored as <key>/_type, <key>/values, <key>/bins.
            histograms = {k.rsplit("/", 1)[0] for k in keys if k.endswith("/_type")}
            keys = {k for k in keys if k.rsplit("/", 1)[0] not in histograms} | histograms
            history[int(items["_step"])] = keys
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({u.key: json.loads(u.value_json) for u in updates if u.key != "_wandb"})
        elif kind == "exit":
            exit_code = record.exit.exit_code
    assert history == {m["step"]: set(m) - {"step"} for m in metrics}
    assert config == json.loads((out / "config.json").read_text())
    assert exit_code == 0  # finished cleanly
    assert (out / "wandb_run_id").read_text().strip() in run_file


@pytest.mark.slow
def test_training_run_writes_metrics_checkpoints_and_plot(uninterrupted):
    out, all_metrics, stdout = uninterrupted
    metrics = [m for m in all_metrics if m["step"] > 0]
    assert [m["step"] for m in all_metrics] == [0, 1, 2, 3, 4]
    for key in ("reward_mean", "rollouts", "alloc_min", "alloc_max", "variance_ratio", "entropy_mean", "grad_norm",
                "step_seconds", "time/rollout", "time/reward", "time/train", "time/weight_sync"):
        assert all(key in m for m in metrics), key
    assert all(m["rollouts"] == 8 * 4 == sum(m["alloc_counts"]) for m in metrics)
    assert all(2 <= c <= 6 for m in metrics for c in m["alloc_counts"])
    # Per-prompt rows for `dynamo report`: each step's prompts, their allocated counts, their correct responses.
    prompts = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    for m in metrics:
        rows = [p for p in prompts if p["step"] == m["step"]]
        assert [p["count"] for p in rows] == m["alloc_counts"] and all(0 <= p["correct"] <= p["count"] for p in rows)
        assert sum(p["correct"] for p in rows) / m["rollouts"] == pytest.approx(m["reward_mean"])
        assert 0.6 <= m["modulation/scale_p10"] <= m["modulation/scale_p90"] <= 1.3
    assert stdout.count("step ") >= 4 and "| reward " in stdout
    assert os.path.isfile(out / "reward_curve.png")
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step_000002", "step_000004"]
    assert os.listdir(out / "tensorboard")
    # The final model, exported with the checkpoint converter, loads in HF transformers.
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "hf")
    ids = tokenizer("12+7=", return_tensors="pt").input_ids
    assert torch.isfinite(model(ids).logits).all()
    # Periodic evaluation: before training, after step 2 and after the last step, logged with the step.
    evaluated = {m["step"]: m for m in all_metrics if "eval/avg/pass@1" in m}
    assert sorted(evaluated) == [0, 2, 4]
    for m in evaluated.values():
        assert 0 <= m["eval/synthetic_eval/pass@1"] <= m["eval/synthetic_eval/pass@2"] <= m["eval/avg/pass@4"] <= 1
        assert m["eval/avg/pass@4"] == m["eval/synthetic_eval/pass@4"]
    assert evaluated[4]["eval/avg/pass@1"] > 0  # the SFT-warmed model solves some of its training problems
    lines = (out / "eval" / "step_000004" / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 8 * 4
    summary = json.loads((out / "eval" / "step_000004" / "summary.json").read_text())
    assert summary["benchmarks"]["synthetic_eval"]["pass@1"] == evaluated[4]["eval/avg/pass@1"]


@pytest.mark.slow
@pytest.mark.extended
def test_a_warm_up_only_run_is_the_start_of_the_next(tmp_path):
    """trainer.steps=0: the warm-up alone, saved as step 0 (what dynamo ablate shares between variants); a run
    started from that checkpoint without a warm-up holds the very same policy: its evaluation before step 1 draws
    the same responses as the warm-up run's evaluation after it."""
    evaluation = _eval_args(tmp_path)
    at_start = [a for a in evaluation if not a.startswith("evaluation.every")]
    _train(tmp_path / "sft", "trainer.steps=0", *at_start)
    checkpoint = tmp_path / "sft" / "checkpoints" / "step_000000"
    assert checkpoint.is_dir() and sorted(p.name for p in (tmp_path / "sft" / "checkpoints").iterdir()) == [
        "latest", "step_000000"]
    metrics, _ = _train(tmp_path / "rl", "trainer.steps=1", "trainer.sft_warmup_steps=0",
                        f"model.checkpoint={checkpoint}", *at_start)
    assert [m["step"] for m in metrics] == [0, 1]

    def samples(run):
        with open(tmp_path / run / "eval" / "step_000000" / "samples.jsonl") as f:
            return sorted((r["problem_id"], r["sample_index"], r["response"]) for r in map(json.loads, f))

    assert samples("sft") == samples("rl") and len(samples("sft")) == 8 * 4


@pytest.mark.slow
def test_resume_continues_exactly(uninterrupted, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    _, full, _ = uninterrupted
    # The interrupted and the resumed run sleep as CUDA vLLM does (rollout.emulate_sleep, level 2: weights poisoned
    # (NaN) until a weight update, wake_up restores nothing); the uninterrupted run does not. Evaluations before
    # training, between steps and at the end, rollouts and updates under it must equal the run without sleep (a
    # resume, or an evaluation, that generated before syncing would differ).
    asleep = ["rollout.emulate_sleep=true", "rollout.sleep_level=2", "logging.rollouts=true"]
    first, _ = _train(tmp_path, "trainer.steps=2", *asleep, *_eval_args(tmp_path))
    # A crash after step 3 was logged but before its checkpoint: its row and scalars are on disk, then a torn line.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "reward_mean": -1.0}) + '\n{"step": 4, "rew')
    with SummaryWriter(str(tmp_path / "tensorboard")) as writer:
        writer.add_scalar("reward_mean", -1.0, 3)
    with open(tmp_path / "prompts.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "prompt_id": "crashed", "count": 1, "correct": 0}) + "\n")
    resumed, _ = _train(tmp_path, "trainer.steps=4", "--resume", *asleep, *_eval_args(tmp_path))
    assert [m["step"] for m in first] == [0, 1, 2] and [m["step"] for m in resumed] == [0, 1, 2, 3, 4]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = [(e.step, e.value) for e in events.Scalars("reward_mean")]
    assert [step for step, _ in scalars] == [1, 2, 3, 4] and -1.0 not in [value for _, value in scalars]
    # The crashed step's per-prompt rows are dropped too: each step's prompts appear once, as in the full run.
    assert (tmp_path / "prompts.jsonl").read_text() == (uninterrupted[0] / "prompts.jsonl").read_text()
    assert (tmp_path / "rollouts.jsonl").read_text() == (uninterrupted[0] / "rollouts.jsonl").read_text()
    for step in ("step_000000", "step_000002", "step_000004"):
        samples = [(run / "eval" / step / "samples.jsonl").read_text() for run in (tmp_path, uninterrupted[0])]
        assert samples[0] == samples[1], step
    for a, b in zip(full, resumed):
        assert a.get("alloc_counts") == b.get("alloc_counts"), a["step"]
        for key in ("reward_mean", "loss", "entropy_mean", "grad_norm", "eval/avg/pass@1", "eval/avg/pass@4"):
            # The step-0 row holds only the evaluation: a key absent from one run must be absent from the other.
            assert (key in a) == (key in b), (a["step"], key)
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)


def _fault_worker(rank, world_size, output_dir):
    from megatron_dynamo.trainer import update as update_module
    from megatron_dynamo.trainer.config import load_run_config
    from megatron_dynamo.trainer.errors import RolloutError
    from megatron_dynamo.trainer.trainer import Trainer

    run = load_run_config(CPU_DEFAULT, [f"trainer.output_dir={output_dir}", "trainer.sft_warmup_steps=0",
                                        "data.prompts_per_step=8", "trainer.mini_batch_prompts=8",
                                        "dynamo.allocation.n_avg=4", "dynamo.allocation.n_min=2",
                                        "dynamo.allocation.n_max=6", "logging.tensorboard=false"])
    trainer = Trainer(run)
    real_loss_fn = update_module.dynamo_loss_fn

    def nan_loss_fn(*args, **kwargs):
        inner = real_loss_fn(*args, **kwargs)

        def loss_fn(logits, mb):
            loss, metrics = inner(logits, mb)
            return loss * float("nan"), {**metrics, "loss": loss.detach() * float("nan")}

        return loss_fn

    from megatron_dynamo.rollout.weight_sync import sync_weights

    sync_weights(trainer.engine, trainer.actor, dtype=trainer.rollout_dtype)
    before = {n: p.detach().clone() for n, p in trainer.actor.named_parameters()}
    update_module.dynamo_loss_fn = nan_loss_fn
    try:
        nan_metrics = trainer.runner.run_step(1)
    finally:
        update_module.dynamo_loss_fn = real_loss_fn
    unchanged = all(torch.equal(before[n], p) for n, p in trainer.actor.named_parameters())
    good_metrics = trainer.runner.run_step(2)

    # A failure inside one rank's engine (the last rank's): an exception there that every rank learns of, as a
    # RolloutError naming that rank, while no rank waits in a collective the failed one never joins.
    def broken(*args, **kwargs):
        raise RuntimeError("engine refused the request")

    errors = {}
    for what, method, action in (("sync", "update_weights", lambda: trainer.runner._sync_weights(2)),
                                 ("generate", "generate", lambda: trainer.runner.run_step(3))):
        if rank == world_size - 1:
            setattr(trainer.engine, method, broken)
        try:
            action()
            errors[what] = None
        except RolloutError as exc:
            errors[what] = str(exc)
        finally:
            vars(trainer.engine).pop(method, None)
    trainer.close()
    return {"nan": {k: nan_metrics.get(k) for k in ("skipped", "optimizer_steps")}, "unchanged": unchanged,
            "good_steps": good_metrics["optimizer_steps"], "engines": good_metrics["rollout/engines"], **errors}


@pytest.mark.slow
@pytest.mark.distributed
def test_nan_loss_is_skipped_and_an_engine_failure_reaches_every_rank(tmp_path):
    from multiproc import run_on_ranks

    results = run_on_ranks(_fault_worker, 2, str(tmp_path / "run"))
    for out in results:
        assert out["engines"] == 2
        assert out["nan"]["optimizer_steps"] == 0 and "non-finite loss" in out["nan"]["skipped"]
        assert out["unchanged"] and out["good_steps"] == 1
        assert ("step 2: loading the new weights into the rollout engines failed (rank 1: RuntimeError: engine "
                "refused the request)") in out["sync"], out["sync"]
        assert "step 3: the rollout failed (rank 1: RuntimeError: engine refused the request)" in out["generate"]
        assert "--resume" in out["generate"]


@pytest.mark.extended
@pytest.mark.slow
def test_tp2_pp2_and_dp2_runs_match_tp1(uninterrupted, tmp_path):
    # Every layout starts from the same trained model (the module's run, exported to HF), so the weights are equal
    # by construction (a random init is not: each pipeline stage draws its own layers) and the rewards are mixed,
    # so losses and gradients are not trivially 0. Every 2-rank layout generates on both ranks: two engines
    # (rollout TP=1) or one engine over both (rollout TP=2). Allocations, response token ids and rewards must equal
    # the one-engine run's exactly, and the updates must agree.
    common = ["trainer.steps=2", "trainer.sft_warmup_steps=0", "checkpoint.every=100", "logging.tensorboard=false",
              "logging.rollouts=true", f"model.checkpoint={uninterrupted[0] / 'hf'}"]
    # tp1 and dp2 also evaluate during training: on two engines, the problems split over them, the same samples.
    # The micro-batch layout must not change the update either (losses carry the mini-batch's global denominator):
    # tp1 runs the CPU default's 64 sequences per micro-batch, the others one sequence, a token budget (padded,
    # samples balanced over the DP ranks by tokens; under PP one shape for all micro-batches) or packed sequences
    # on the local spec (block-diagonal mask; under PP the padding tail as a segment of its own).
    layouts = {"tp1": _eval_args(tmp_path / "tp1"),
               "tp2": ["parallel.tensor_parallel=2", "trainer.micro_batch_size=1", "trainer.micro_batch_tokens=0"],
               "pp2": ["parallel.pipeline_parallel=2", "trainer.pack_sequences=true", "trainer.micro_batch_tokens=96",
                       "dynamo.loss.engine_is=truncate"],
               "dp2": ["--nproc", "2", *_eval_args(tmp_path / "dp2"), "trainer.micro_batch_tokens=64",
                       "dynamo.loss.engine_is=mask"],
               "tp2_rollout_tp2": ["parallel.tensor_parallel=2", "rollout.tensor_parallel=2",
                                   "trainer.pack_sequences=true", "trainer.micro_batch_size=5",
                                   "trainer.micro_batch_tokens=0"]}
    runs = {name: _train(tmp_path / name, *common, *extra)[0] for name, extra in layouts.items()}
    rollouts = {name: (tmp_path / name / "rollouts.jsonl").read_text() for name in layouts}
    for step in ("step_000000", "step_000002"):
        samples = [(tmp_path / name / "eval" / step / "samples.jsonl").read_text() for name in ("tp1", "dp2")]
        assert samples[0] == samples[1] and samples[0].count("\n") == 8 * 4, step
    runs = {name: [m for m in rows if "loss" in m] for name, rows in runs.items()}  # without the step-0 eval row
    assert all(m["loss"] != 0 and m["grad_norm"] > 0 and 0 < m["reward_mean"] < 1 for m in runs["tp1"])
    assert [m["rollout/engines"] for m in runs["tp1"]] == [1, 1]
    # The engine (fp32 vLLM) and the trainer agree on every sampled token's log-prob at every layout, so the
    # engine/trainer correction (truncate under PP, mask on two DP ranks) leaves the update as tp1's.
    for name in layouts:
        assert all(m["rollout/logp_gap_max"] < 1e-4 and m["rollout/engine_kl_k3"] < 1e-8 for m in runs[name]), name
    assert all(m["actor/engine_is_capped_frac"] == 0 for name in ("pp2", "dp2") for m in runs[name])
    for name in layouts:
        if name == "tp1":
            continue
        assert [m["rollout/engines"] for m in runs[name]] == [1 if "rollout_tp2" in name else 2] * 2, name
        assert rollouts[name] == rollouts["tp1"], name  # token ids, order and rewards of every response
        for a, b in zip(runs["tp1"], runs[name]):
            assert a["alloc_counts"] == b["alloc_counts"] and a["reward_mean"] == b["reward_mean"], name
            for key in ("loss", "entropy_mean", "grad_norm"):
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (name, a["step"], key)


@pytest.mark.parametrize("override,message", [
    ("data.train=/nonexistent/train.jsonl", "data.train: dataset file not found: /nonexistent/train.jsonl"),
    ("model.checkpoint=/nonexistent/model", "model.checkpoint: /nonexistent/model: no such directory; the nearest "
                                            "existing one is /"),
    ("model.config=/nonexistent/config.json", "model.config: no such file: /nonexistent/config.json"),
    ("model.tokenizer=/nonexistent/tok", "model.tokenizer: /nonexistent/tok: no such directory; the nearest "
                                         "existing one is /"),
    ("data.prompts_per_step=256", "data.prompts_per_step (256) exceeds data.synthetic_problems (128)"),
    ("rollout.tensor_parallel=2", "rollout.tensor_parallel=2 does not divide the 1 ranks"),
])
@pytest.mark.slow
def test_missing_inputs_fail_in_one_line_before_any_rank_starts(tmp_path, override, message):
    extra = ["trainer.mini_batch_prompts=256"] if "prompts_per_step" in override else []
    proc = subprocess.run([sys.executable, "-m", "megatron_dynamo.cli", "train", CPU_DEFAULT,
                           f"trainer.output_dir={tmp_path / 'run'}", override, *extra],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dynamo train: ") and message in lines[0], proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # nothing was built or written


def test_a_checkpoint_directory_that_is_not_a_model_is_refused(tmp_path):
    from megatron_dynamo.trainer.preflight import check_run_inputs

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="neither an HF model directory"):
        check_run_inputs(load_run_config(CPU_DEFAULT, [f"model.checkpoint={tmp_path / 'ckpt'}"]))
    (tmp_path / "ckpt" / "megatron_dynamo.json").write_text("not json")
    with pytest.raises(ConfigError, match="model.checkpoint: .*not valid JSON"):
        check_run_inputs(load_run_config(CPU_DEFAULT, [f"model.checkpoint={tmp_path / 'ckpt'}"]))
    check_run_inputs(load_run_config(CPU_DEFAULT))  # the CPU default's inputs are all there


@pytest.mark.slow
def test_a_data_set_smaller_than_a_step_is_refused_before_the_model(tmp_path):
    from megatron_dynamo.trainer.preflight import check_run_inputs

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"id": i, "problem": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(5)))
    run = load_run_config(CPU_DEFAULT, ["data.train=" + str(path), "data.prompts_per_step=8",
                                        "trainer.mini_batch_prompts=8", f"trainer.output_dir={tmp_path / 'run'}"])
    check_run_inputs(run)  # the file exists; its size is checked with the prompts (check_training_prompts)
    proc = subprocess.run([sys.executable, "-m", "megatron_dynamo.cli", "train", CPU_DEFAULT,
                           f"trainer.output_dir={tmp_path / 'run'}", "data.train=" + str(path),
                           "data.prompts_per_step=8", "trainer.mini_batch_prompts=8"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2 and "data.train has 5 usable prompts, fewer than data.prompts_per_step (8" in \
        proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # failed before any rank started: nothing written
