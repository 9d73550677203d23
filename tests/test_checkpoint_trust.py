"""Loading never runs code from a checkpoint, and a key makes the manifest a signature (issue 33).

The payloads (tests/payloads.py) are pickles that run ``touch MARKER`` and then are the value the loader expected:
in ``model/.metadata`` and ``optimizer/.metadata`` (torch DCP: plain pickle.load), in a model ``_extra_state`` byte
item (torch DCP: torch.load(weights_only=False)), in ``common.pt`` (Megatron: torch.load without weights_only, so
TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 made it unsafe). Each is planted in step 2 with the manifest re-hashed, as an
attacker without the key can. Before the change each ran on ``--resume`` (the marker appeared and step 2 loaded);
now each is refused in one line naming the global, the run falls back to step 1 and loads it exactly, and the
loaders refuse it even when called directly (the converter's path). Real Megatron on gloo.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_reference import REPO, TINY_QWEN2
from payloads import inject_common, inject_extra_state, inject_metadata, rehash

KEY, OTHER_KEY = "k" * 16 + "-the-user's-key", "another-key-of-32-bytes-0123456"
PAYLOADS = {  # case -> (plant it in step 2, the phrase the skip line must hold)
    "model_metadata": (lambda d, m: inject_metadata(d, "model", m), "model/.metadata: refused to unpickle"),
    "optimizer_metadata": (lambda d, m: inject_metadata(d, "optimizer", m), "optimizer/.metadata: refused"),
    "extra_state": (lambda d, m: inject_extra_state(d, m), "_extra_state"),
    "model_common": (lambda d, m: inject_common(d, "model", m), "model/common.pt: refused to unpickle"),
    "optimizer_common": (lambda d, m: inject_common(d, "optimizer", m), "optimizer/common.pt: refused"),
}
# Damage a checksum-only check cannot see once the manifest is re-hashed (or in a checkpoint signed that way).
GARBLED = {"garbled_common": (lambda d, m: (d / "model" / "common.pt").write_bytes(b"PK\x03\x04" + os.urandom(64)),
                              "model/common.pt: not a readable torch archive"),
           "garbled_metadata": (lambda d, m: (d / "optimizer" / ".metadata").write_bytes(os.urandom(64)),
                                "optimizer/.metadata: not a readable pickle")}


def _save_two_steps(root: str, world_size: int):
    from megatron_dynamo.models.qwen import load_hf_config
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer import checkpoint as ckpt
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig

    runtime.init_distributed(runtime.ParallelConfig(tensor_parallel=world_size), seed=0)
    actor = MegatronActor(TINY_QWEN2, optim=OptimConfig(lr=1e-3))
    batch = {"input_ids": torch.arange(1, 9).unsqueeze(0)}
    saved = {}
    for step in (1, 2):
        actor.forward_backward([batch], lambda logits, mb: (logits.square().mean(), {}))
        actor.optimizer_step()
        saved[step] = {n: p.detach().clone() for n, p in actor.named_parameters()}
        ckpt.save_checkpoint(root, step, actor.chunks, actor.optimizer, {"history": {"s": step}},
                             load_hf_config(TINY_QWEN2), "fp32", 3, {"tp": world_size})
    return actor, saved


def _resume_and_load(actor, saved, case_root):
    """What --resume picks and says, and whether that step then loads exactly (or the error, in one line)."""
    from megatron_dynamo.trainer import checkpoint as ckpt

    try:
        path, lines = ckpt.resume_checkpoint(case_root)
    except ckpt.NoIntactCheckpoint as exc:
        return {"error": str(exc)}
    with torch.no_grad():
        for _, p in actor.named_parameters():
            p.add_(1.0)
    step = ckpt.load_checkpoint(path, actor.chunks, actor.optimizer)["step"]
    return {"path": os.path.basename(path), "lines": lines, "step": step,
            "exact": all(torch.equal(saved[step][n], p) for n, p in actor.named_parameters())}


def _payload_worker(rank, world_size, root):
    """Steps 1 and 2 saved; per payload a copy with it in step 2 and the manifest re-hashed: what --resume does,
    then the payload's step loaded directly (no scan first: what the converter's ranks do)."""
    import torch.distributed as dist

    from megatron_dynamo.trainer import checkpoint as ckpt

    os.environ.pop("DYNAMO_CHECKPOINT_KEY", None)
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"  # torch.load's unsafe default, as a user may have it
    actor, saved = _save_two_steps(root, world_size)
    out = {}
    for case, (plant, _) in {**PAYLOADS, **GARBLED}.items():
        case_root = Path(f"{root}_{case}")
        marker = Path(f"{root}_{case}.ran")
        if rank == 0:
            shutil.copytree(root, case_root)
            plant(case_root / "step_000002", marker)
            rehash(case_root / "step_000002")
        dist.barrier()
        out[case] = _resume_and_load(actor, saved, case_root)
        try:
            ckpt.load_checkpoint(case_root / "step_000002", actor.chunks, actor.optimizer)
            out[case]["direct"] = "loaded"
        except BaseException as exc:  # noqa: BLE001 (torch DCP wraps failures in a BaseException)
            out[case]["direct"] = f"{type(exc).__name__}: {exc}"
        try:  # a run's model.checkpoint (the ablation's shared start) is verified the same way
            ckpt.load_start_checkpoint(case_root / "step_000002", actor.chunks)
            out[case]["start"] = "loaded"
        except ckpt.NoIntactCheckpoint as exc:
            out[case]["start"] = str(exc)
        dist.barrier()
        out[case]["ran"] = marker.exists()
    return out


@pytest.mark.distributed
def test_payloads_are_refused_and_resume_falls_back_to_the_previous_checkpoint(tmp_path):
    from multiproc import run_on_ranks

    (out,) = run_on_ranks(_payload_worker, 1, str(tmp_path / "ckpt"))

    def result_root(case):
        return tmp_path / f"ckpt_{case}" / "step_000002"

    for case, (_, phrase) in PAYLOADS.items():
        result = out[case]
        assert not result["ran"], f"{case}: the payload ran"
        assert result.get("path") == "step_000001" and result["step"] == 1 and result["exact"], (case, result)
        skips = [line for line in result["lines"] if "skipping damaged checkpoint" in line]
        assert len(skips) == 1 and "step_000002" in skips[0] and phrase in skips[0], (case, result["lines"])
        assert "posix.system" in skips[0] or "_operator.getitem" in skips[0], skips[0]
        assert "\n" not in skips[0]
        # The loader itself refuses it, in one line naming the global (the converter and eval load this way).
        direct = result["direct"]
        assert direct.startswith("UnsafeCheckpointError: ") and "\n" not in direct, (case, direct)
        assert "refused to unpickle" in direct, (case, direct)
        start = result["start"]
        assert start.startswith(f"model.checkpoint: not loaded: {result_root(case)}") and phrase in start, start
    for case, (_, phrase) in GARBLED.items():  # falls back like any other damage
        result = out[case]
        assert result.get("path") == "step_000001" and result["exact"], (case, result)
        skips = [line for line in result["lines"] if "skipping damaged checkpoint" in line]
        assert len(skips) == 1 and phrase in skips[0] and "\n" not in skips[0], (case, result["lines"])
        assert result["direct"].startswith("UnsafeCheckpointError: ") and "\n" not in result["direct"], result


def _signing_worker(rank, world_size, root):
    """Steps 1 and 2 saved with a key; cases of step 2 (or a step 3) that must not verify with it."""
    import torch.distributed as dist

    from megatron_dynamo.models.checkpoint_io.manifest import load_manifest, write_manifest
    from megatron_dynamo.models.checkpoint_io.signing import signing_key
    from megatron_dynamo.trainer import checkpoint as ckpt

    os.environ["DYNAMO_CHECKPOINT_KEY"] = KEY
    actor, saved = _save_two_steps(root, world_size)
    out = {"signed": _resume_and_load(actor, saved, root),
           "manifest": json.loads((Path(root) / "step_000002" / "manifest.json").read_text())}

    def unsigned(step2):  # an attacker without the key: a changed file, the manifest re-hashed
        (step2 / "hf" / "config.json").write_text("{}")
        rehash(step2)
        manifest = json.loads((step2 / "manifest.json").read_text())
        del manifest["signature"]
        (step2 / "manifest.json").write_text(json.dumps(manifest))

    def forged(step2):  # the same, the old signature kept
        (step2 / "hf" / "config.json").write_text("{}")
        rehash(step2)

    def other_key(step2):  # signed, but with somebody else's key
        write_manifest(step2, load_manifest(step2).files, signing_key({"DYNAMO_CHECKPOINT_KEY": OTHER_KEY}))

    def renamed(step2):  # step 1's signed checkpoint under the newest step's name
        shutil.copytree(step2.parent / "step_000001", step2.parent / "step_000003")

    for case, change in {"unsigned": unsigned, "forged": forged, "other_key": other_key,
                         "renamed": renamed}.items():
        case_root = Path(f"{root}_{case}")
        if rank == 0:
            shutil.copytree(root, case_root)
            change(case_root / "step_000002")
        dist.barrier()
        out[case] = _resume_and_load(actor, saved, case_root)
    os.environ.pop("DYNAMO_CHECKPOINT_KEY")
    out["without_key"] = _resume_and_load(actor, saved, root)
    return out


@pytest.mark.distributed
def test_a_key_signs_the_manifest_and_resume_refuses_what_it_does_not_verify(tmp_path):
    from multiproc import run_on_ranks

    (out,) = run_on_ranks(_signing_worker, 1, str(tmp_path / "ckpt"))
    signature = out["manifest"]["signature"]
    assert signature["algorithm"] == "hmac-sha256" and len(signature["hmac"]) == 64
    signed = out["signed"]
    assert signed["path"] == "step_000002" and signed["exact"]
    assert signed["lines"][0].startswith("--resume: checkpoints are signed and verified with HMAC-SHA256 (key ")
    assert KEY not in json.dumps(out["manifest"]) and KEY not in " ".join(signed["lines"])
    expected = {"unsigned": "manifest.json is not signed (a key is configured: $DYNAMO_CHECKPOINT_KEY)",
                "forged": "manifest.json's signature does not match its content",
                "other_key": "manifest.json is signed with another key",
                "renamed": "trainer_state.json says step 1: the directory was renamed"}
    for case, phrase in expected.items():
        result = out[case]
        want = "step_000002" if case == "renamed" else "step_000001"
        assert result["path"] == want and result["exact"], (case, result)
        skips = [line for line in result["lines"] if "skipping damaged checkpoint" in line]
        assert len(skips) == 1 and phrase in skips[0], (case, result["lines"])
    plain = out["without_key"]  # a signed checkpoint without the key: integrity checked, and said so
    assert plain["path"] == "step_000002" and plain["lines"][0].startswith(
        "--resume: checkpoints are checked for integrity only")


# ------------------------------------------------------------------------------ files: no torch.distributed
def _plain_checkpoint(root: Path, key=None) -> Path:
    """A checkpoint directory of plain files with a manifest (no distributed checkpoint inside)."""
    from megatron_dynamo.models.checkpoint_io.verify import write_full_manifest

    (root / "hf").mkdir(parents=True)
    (root / "hf" / "config.json").write_text("{}")
    (root / "trainer_state.json").write_text('{"step": 1}')
    write_full_manifest(root, key)
    return root


@pytest.mark.parametrize("entry", ["../outside", "/etc/hostname", "hf/../../outside", "./hf/config.json", ""])
def test_manifest_entries_must_name_paths_inside_the_checkpoint(tmp_path, entry):
    from megatron_dynamo.models.checkpoint_io.verify import checkpoint_problem

    root = _plain_checkpoint(tmp_path / "step_000001")
    (tmp_path / "outside").write_text("secret")
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["files"][entry] = {"size": 6, "sha256": "0" * 64, "rank": 0}
    (root / "manifest.json").write_text(json.dumps(manifest))
    assert checkpoint_problem(root, None) == f"manifest.json names {entry!r}, not a path inside the checkpoint"


def test_unlisted_files_and_symbolic_links_are_refused(tmp_path):
    from megatron_dynamo.models.checkpoint_io.verify import checkpoint_problem

    root = _plain_checkpoint(tmp_path / "ckpt")
    assert checkpoint_problem(root, None) is None
    (root / "hf" / "tokenizer.json").write_text("{}")
    assert checkpoint_problem(root, None) == "hf/tokenizer.json is not listed in manifest.json (added after the save)"
    (root / "hf" / "tokenizer.json").unlink()
    (tmp_path / "elsewhere.json").write_text("{}")
    (root / "hf" / "config.json").unlink()
    (root / "hf" / "config.json").symlink_to(tmp_path / "elsewhere.json")
    assert checkpoint_problem(root, None) == ("hf/config.json is a symbolic link (a checkpoint holds plain files "
                                              "only)")


def test_latest_must_name_a_step_directory_of_its_own_root(tmp_path):
    from megatron_dynamo.models.checkpoint_dirs import latest_checkpoint

    root = tmp_path / "run" / "checkpoints"
    for step in (1, 2):
        _plain_checkpoint(root / f"step_{step:06d}")
    victim = _plain_checkpoint(tmp_path / "victim")
    for pointer in ("../../victim", str(victim), "step_000001/../../../victim", "step_1"):
        (root / "latest").write_text(pointer + "\n")
        assert latest_checkpoint(root) == root / "step_000002", pointer  # the newest complete one instead
    (root / "latest").write_text("step_000001\n")
    assert latest_checkpoint(root) == root / "step_000001"
    (root / "step_000009").symlink_to(victim)
    (root / "latest").write_text("step_000009\n")
    assert latest_checkpoint(root) == root / "step_000002"


def test_key_from_a_file_outside_the_checkpoint_and_bad_keys_in_one_line(tmp_path):
    from megatron_dynamo.models.checkpoint_io.signing import CheckpointKeyError, signing_key
    from megatron_dynamo.models.checkpoint_io.verify import checkpoint_problem

    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    key = signing_key({"DYNAMO_CHECKPOINT_KEY_FILE": str(key_file)})
    assert key.secret == KEY.encode() and key.key_id == signing_key({"DYNAMO_CHECKPOINT_KEY": KEY}).key_id
    root = _plain_checkpoint(tmp_path / "ckpt", key)
    assert checkpoint_problem(root, key) is None
    assert checkpoint_problem(root, None) is None  # integrity still checked without the key
    inside = root / "hf" / "key"
    shutil.copy(key_file, inside)
    assert "lies inside the checkpoint it would verify" in checkpoint_problem(
        root, signing_key({"DYNAMO_CHECKPOINT_KEY_FILE": str(inside)}))
    for environ, phrase in (({"DYNAMO_CHECKPOINT_KEY": "short"}, "has 5 bytes; use at least 16"),
                            ({"DYNAMO_CHECKPOINT_KEY_FILE": str(tmp_path / "missing")}, "No such file"),
                            ({"DYNAMO_CHECKPOINT_KEY": KEY, "DYNAMO_CHECKPOINT_KEY_FILE": str(key_file)},
                             "both DYNAMO_CHECKPOINT_KEY and DYNAMO_CHECKPOINT_KEY_FILE are set")):
        with pytest.raises(CheckpointKeyError, match=phrase) as info:
            signing_key(environ)
        assert "\n" not in str(info.value)


def _train(output_dir, *extra, env=None):
    cmd = [sys.executable, "-m", "megatron_dynamo.cli", "train", os.path.join(REPO, "configs", "cpu_default.yaml"),
           f"trainer.output_dir={output_dir}", "trainer.sft_warmup_steps=5", "data.prompts_per_step=8",
           "trainer.mini_batch_prompts=4", "dynamo.allocation.n_avg=4", "dynamo.allocation.n_min=2",
           "dynamo.allocation.n_max=6", "data.synthetic_problems=16", "checkpoint.every=1", "checkpoint.keep_last=3",
           "logging.plot=false", "logging.tensorboard=false", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)


@pytest.mark.slow
def test_cli_resume_the_converter_and_eval_refuse_the_issues_payload(tmp_path):
    """The issue's case end to end: a .metadata payload in step 2 with the manifest re-hashed ran on --resume
    ("--resume: loaded step 2", exit 0) and in `python -m checkpoints_convert megatron-to-hf` (which dynamo eval and
    the trainer's export run). Now the converter refuses it in one line and writes nothing, dynamo eval's model
    source says the same, and --resume skips it in one line, loads step 1 and trains on; the payload never runs."""
    from megatron_dynamo.eval.model_source import prepare_model
    from megatron_dynamo.eval.runner import EvalError

    out, marker = tmp_path / "run", tmp_path / "payload_ran"
    first = _train(out, "trainer.steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "checkpoints are checked for integrity only" in first.stdout
    step2 = out / "checkpoints" / "step_000002"
    inject_metadata(step2, "model", marker)
    rehash(step2)

    converted = subprocess.run([sys.executable, "-m", "checkpoints_convert", "megatron-to-hf", "--megatron",
                                str(step2), "--out", str(tmp_path / "hf")], capture_output=True, text=True,
                               cwd=REPO, timeout=300)
    errors = [line for line in converted.stderr.splitlines() if line.startswith("error: ")]
    assert converted.returncode == 1 and len(errors) == 1, converted.stderr[-3000:]
    assert "model/.metadata: refused to unpickle _operator.getitem" in errors[0], errors
    assert "Traceback" not in converted.stderr and not (tmp_path / "hf").exists()
    with pytest.raises(EvalError, match="refused to unpickle _operator.getitem") as info:
        prepare_model(step2, tmp_path / "eval")
    assert "\n" not in str(info.value)

    resumed = _train(out, "trainer.steps=3", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    console = resumed.stdout + resumed.stderr
    skips = [line for line in console.splitlines() if "skipping damaged checkpoint" in line]
    assert len(skips) == 1 and "step_000002: model/.metadata: refused to unpickle" in skips[0], console[-3000:]
    assert f"--resume: loaded step 1 from {out / 'checkpoints' / 'step_000001'}" in console
    assert not marker.exists(), "the payload ran"


def test_transformer_engine_extra_state_is_checked_before_te_unpickles_it(tmp_path):
    """Transformer Engine keeps its FP8 state as pickle.dumps(...) in a uint8 tensor and pickle.loads it in
    set_extra_state: a byte item holding such a tensor passes only if its bytes hold tensors and containers (TE is
    not installed here: the state is built the way TE builds it)."""
    import io
    import pickle

    from megatron_dynamo.models.checkpoint_io.safe_pickle import UnsafeCheckpointError, load_byte_item
    from payloads import touching

    def item(state) -> bytes:
        buffer = io.BytesIO()
        torch.save(torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8), buffer)
        return buffer.getvalue()

    key = "decoder.layers.self_attention.linear_qkv._extra_state/shard_0_4"
    fp8 = {"scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(4, 3), "extra_fp8_variables": {"num_gemms": 3}}
    loaded = load_byte_item(item(fp8), key, "model/__0_0.distcp")
    assert loaded.dtype == torch.uint8 and pickle.loads(loaded.numpy().tobytes())["amax_history_fwd"].shape == (4, 3)
    assert load_byte_item(item({}), "other._extra_state", "x").numel() > 0
    marker = tmp_path / "ran"
    with pytest.raises(UnsafeCheckpointError, match=r"\(its bytes\): refused to unpickle (posix\.system|_operator)"):
        load_byte_item(item(touching(marker, fp8)), key, "model/__0_0.distcp")
    assert not marker.exists()
