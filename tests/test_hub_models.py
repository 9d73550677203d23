"""Hub model ids for model.checkpoint / model.tokenizer / dynamo eval, and model.config taken from the checkpoint.

Offline throughout: a tiny HF model directory is built here and put into a fake Hugging Face cache under tmp, in
huggingface_hub's layout (``models--org--name/{blobs,snapshots/<commit>,refs/main}``, checked with its own
``scan_cache_dir``); HF_HUB_OFFLINE=1 and HF_HUB_CACHE / HF_HOME point there. The one test that leaves offline
mode points HF_ENDPOINT at a closed local port (the hub is unreachable, nothing leaves the machine).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_reference import REPO, TINY_QWEN2
from megatron_dynamo.config import ConfigError
from megatron_dynamo.trainer.config import load_run_config

CPU_DEFAULT = os.path.join(REPO, "configs", "cpu_default.yaml")
HUB_ID = "tiny-org/tiny-qwen2-hub"
MISSING_ID = "tiny-org/not-cached"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
SHAPE = {"num_hidden_layers": 2, "intermediate_size": 256}  # not the CPU default's tiny-qwen2.json (4 and 384)


def _prime_cache(cache: Path, repo_id: str, source: Path, commit: str = COMMIT) -> Path:
    """Put ``source``'s files into ``cache`` as huggingface_hub stores a download: content-addressed blobs,
    the snapshot's files as relative symlinks to them, and refs/main holding the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(cache, snapshot, model dir): the tiny model (random weights, SHAPE) with the character tokenizer,
    cached as HUB_ID."""
    from hf_reference import hf_model
    from megatron_dynamo.data.tokenizer import build_char_tokenizer

    root = tmp_path_factory.mktemp("hub")
    model_dir = root / "model"
    hf_model(TINY_QWEN2, seed=0, **SHAPE).save_pretrained(str(model_dir))
    build_char_tokenizer(model_dir)
    cache = root / "cache"
    return cache, _prime_cache(cache, HUB_ID, model_dir), model_dir


@pytest.fixture
def offline(monkeypatch, hub):
    cache = hub[0]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return hub


def test_the_fake_cache_has_huggingface_hubs_layout(hub):
    from huggingface_hub import scan_cache_dir

    cache, snapshot, model_dir = hub
    info = scan_cache_dir(cache)
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert (repo.repo_id, repo.repo_type) == (HUB_ID, "model")
    (revision,) = repo.revisions
    assert revision.commit_hash == COMMIT and revision.refs == frozenset({"main"})
    assert {f.file_name for f in revision.files} == {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= \
        {p.name for p in snapshot.iterdir()}


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(offline, monkeypatch, tmp_path):
    from megatron_dynamo.models.hub import hub_cache_dir, resolve_model_dir

    cache, snapshot, model_dir = offline
    assert hub_cache_dir() == cache
    assert resolve_model_dir(HUB_ID, "checkpoint") == snapshot
    assert resolve_model_dir(HUB_ID, "tokenizer") == snapshot
    # HF_HOME: the cache is $HF_HOME/hub when HF_HUB_CACHE is not set.
    home = tmp_path / "home"
    other = _prime_cache(home / "hub", HUB_ID, model_dir, commit="f" * 40)
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(home))
    assert hub_cache_dir() == home / "hub"
    assert resolve_model_dir(HUB_ID, "tokenizer") == other
    assert resolve_model_dir(HUB_ID, "checkpoint", local_only=True) == other


def test_local_paths_win_and_missing_ones_say_no_such_directory(offline, monkeypatch, tmp_path):
    from megatron_dynamo.models.hub import HubModelError, is_hub_id, is_hub_reference, resolve_model_dir

    for text in ("Qwen/Qwen2.5-Math-1.5B", "tiny-org/tiny_model.v2", "checkpoints/Qwen3-14B"):
        assert is_hub_id(text), text
    for text in ("char", "Qwen", "/abs/path", "a/b/c", "./x", "../x/y", "x/", "a--b/c", "a/b..c", "-a/b", "a/b.git",
                 "~/models"):
        assert not is_hub_id(text), text
    with pytest.raises(HubModelError, match="^/nonexistent/model: no such directory; the nearest existing one is /$"):
        resolve_model_dir("/nonexistent/model", "checkpoint")
    with pytest.raises(ConfigError, match="^model.checkpoint: /nonexistent/model: no such directory"):
        from megatron_dynamo.trainer.preflight import check_run_inputs

        check_run_inputs(load_run_config(CPU_DEFAULT, ["model.checkpoint=/nonexistent/model"]))
    monkeypatch.chdir(tmp_path)
    # Spelled like an id but a path: a mistyped run directory (was: "fill it with `hf download outputs/cpu_defualt`")
    (tmp_path / "outputs" / "cpu_default").mkdir(parents=True)
    assert not is_hub_reference("outputs/cpu_defualt") and not is_hub_reference("runs/x")
    with pytest.raises(HubModelError, match=r"^outputs/cpu_defualt: no such directory \(did you mean "
                                            r"outputs/cpu_default\?\)$"):
        resolve_model_dir("outputs/cpu_defualt", "checkpoint")
    with pytest.raises(HubModelError, match="^runs/x: no such directory; the nearest existing one is ./$"):
        resolve_model_dir("runs/x", "checkpoint")
    (tmp_path / "tiny-org" / "tiny-qwen2-hub").mkdir(parents=True)  # a local directory spelled like the id
    assert resolve_model_dir(HUB_ID, "checkpoint") == Path(HUB_ID)


def test_preflight_resolves_hub_ids_and_takes_the_architecture_from_the_checkpoint(offline):
    from megatron_dynamo.models.qwen import load_hf_config
    from megatron_dynamo.trainer.preflight import check_run_inputs

    _, snapshot, _ = offline
    run = load_run_config(CPU_DEFAULT, ["model.config=null", f"model.checkpoint={HUB_ID}",
                                        f"model.tokenizer={HUB_ID}"])
    assert run.model.config is None
    resolved = check_run_inputs(run)
    assert resolved.model.checkpoint == resolved.model.tokenizer == str(snapshot)
    assert resolved.model.config is None and resolved.model.config_source() == str(snapshot)
    assert {k: load_hf_config(resolved.model.config_source())[k] for k in SHAPE} == SHAPE
    assert resolved.data == run.data and resolved.trainer == run.trainer
    # A local path is passed on exactly as it was given.
    local = load_run_config(CPU_DEFAULT)
    assert check_run_inputs(local) == local


def test_neither_model_config_nor_checkpoint_is_a_one_line_error():
    with pytest.raises(ConfigError) as info:
        load_run_config(CPU_DEFAULT, ["model.config=null"])
    message = str(info.value)
    assert message.startswith("model: neither config nor checkpoint is given") and "\n" not in message


def test_the_architecture_of_a_megatron_checkpoint_comes_from_its_hf_dir(tmp_path):
    from megatron_dynamo.models.checkpoint_io import write_checkpoint_info
    from megatron_dynamo.models.qwen import load_hf_config
    from megatron_dynamo.trainer.preflight import check_run_inputs

    config = {**load_hf_config(TINY_QWEN2), **SHAPE}
    checkpoint = tmp_path / "step_000001"
    (checkpoint / "model").mkdir(parents=True)
    (checkpoint / "model" / "metadata.json").write_text("{}")  # the distributed checkpoint's marker file
    write_checkpoint_info(checkpoint, config, "fp32", source={}, saved_with={"tp": 1, "pp": 1, "dp": 1})
    run = check_run_inputs(load_run_config(CPU_DEFAULT, ["model.config=null", f"model.checkpoint={checkpoint}"]))
    assert run.model.config_source() == str(checkpoint / "hf")
    assert {k: load_hf_config(run.model.config_source())[k] for k in SHAPE} == SHAPE
    (checkpoint / "hf" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="^model.checkpoint: "):
        check_run_inputs(load_run_config(CPU_DEFAULT, ["model.config=null", f"model.checkpoint={checkpoint}"]))


@pytest.mark.parametrize("key", ["checkpoint", "tokenizer"])
def test_an_id_that_is_not_cached_is_one_line_naming_it_and_the_cache(offline, key):
    from megatron_dynamo.trainer.preflight import check_run_inputs

    cache = offline[0]
    with pytest.raises(ConfigError) as info:
        check_run_inputs(load_run_config(CPU_DEFAULT, [f"model.{key}={MISSING_ID}"]))
    message = str(info.value)
    assert message.startswith(f"model.{key}: {MISSING_ID} is no local directory") and "\n" not in message
    assert str(cache) in message and "HF_HUB_OFFLINE" in message and f"hf download {MISSING_ID}" in message


def test_a_rank_of_a_multi_process_launch_only_reads_the_cache(monkeypatch, hub):
    from megatron_dynamo.trainer.preflight import check_run_inputs

    cache, snapshot, _ = hub
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # should anything reach for the network
    monkeypatch.setenv("WORLD_SIZE", "8")
    run = check_run_inputs(load_run_config(CPU_DEFAULT, [f"model.tokenizer={HUB_ID}"]))
    assert run.model.tokenizer == str(snapshot)
    with pytest.raises(ConfigError, match="ranks only read the cache"):
        check_run_inputs(load_run_config(CPU_DEFAULT, [f"model.tokenizer={MISSING_ID}"]))


@pytest.mark.parametrize("hub_env", [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}],
                         ids=["offline", "hub-unreachable"])
def test_dynamo_train_with_an_uncached_id_exits_2_in_one_line(hub, tmp_path, hub_env):
    cache = hub[0]
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME")}
    env.update(HF_HUB_CACHE=str(cache), **hub_env)
    proc = subprocess.run([sys.executable, "-m", "megatron_dynamo.cli", "train", CPU_DEFAULT,
                           f"trainer.output_dir={tmp_path / 'run'}", "model.config=null",
                           f"model.checkpoint={MISSING_ID}"],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith(f"dynamo train: model.checkpoint: {MISSING_ID} is no local directory")
    assert str(cache) in lines[0] and f"hf download {MISSING_ID}" in lines[0]
    assert ("HF_HUB_OFFLINE is set" if "HF_HUB_OFFLINE" in hub_env else "the hub could not be reached") in lines[0]
    assert not (tmp_path / "run").exists()


def test_dynamo_eval_takes_hub_ids(offline, tmp_path, capsys):
    from megatron_dynamo.commands import eval as eval_command
    from megatron_dynamo.eval.model_source import resolve_checkpoint

    cache, snapshot, model_dir = offline
    assert resolve_checkpoint(HUB_ID) == snapshot
    parser = argparse.ArgumentParser()
    eval_command.add_arguments(parser)
    for argv, flag in ((["--checkpoint", MISSING_ID], "--checkpoint"),
                       (["--checkpoint", str(model_dir), "--tokenizer", MISSING_ID], "--tokenizer")):
        assert eval_command.main(parser.parse_args([*argv, "--output", str(tmp_path / "eval")])) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"dynamo eval: {flag} {MISSING_ID} is no local directory")
        assert str(cache) in lines[0]


def _trainer_worker(rank, world_size, output_dir):
    """The Trainer's model part from a config naming the hub id for checkpoint and tokenizer and no model.config
    (the engine and the reward workers are not started)."""
    import torch
    from safetensors.torch import load_file

    from megatron_dynamo.models.mappings import unwrap_model
    from megatron_dynamo.reward import math_reward
    from megatron_dynamo.trainer.trainer import Trainer

    math_reward.MathRewardScorer = lambda *args, **kwargs: None
    from types import SimpleNamespace

    from megatron_dynamo.parallel.topology import EngineLayout

    Trainer._build_engine = lambda self: SimpleNamespace(layout=EngineLayout(0, 1, 1), close=lambda: None)
    run = load_run_config(CPU_DEFAULT, [f"trainer.output_dir={output_dir}", "model.config=null",
                                        f"model.checkpoint={HUB_ID}", f"model.tokenizer={HUB_ID}"])
    trainer = Trainer(run)
    model = unwrap_model(trainer.actor.chunks[0])
    hf = load_file(str(Path(trainer.run.model.checkpoint) / "model.safetensors"))
    embedding = model.embedding.word_embeddings.weight.detach()
    return {"checkpoint": trainer.run.model.checkpoint, "tokenizer": trainer.run.model.tokenizer,
            "layers": len(model.decoder.layers), "hf_config": trainer.hf_config,
            "fc1": tuple(model.decoder.layers[0].mlp.linear_fc1.weight.shape),
            "embedding_equal": bool(torch.equal(embedding, hf["model.embed_tokens.weight"].to(embedding.dtype))),
            "vocab": len(trainer.tokenizer)}


@pytest.mark.distributed
def test_the_trainer_builds_its_model_from_a_cached_hub_id(offline, tmp_path):
    from multiproc import run_on_ranks

    _, snapshot, _ = offline
    (result,) = run_on_ranks(_trainer_worker, 1, str(tmp_path / "run"))  # a fresh process: the env goes with it
    assert result["checkpoint"] == result["tokenizer"] == str(snapshot)
    assert result["layers"] == SHAPE["num_hidden_layers"] and result["fc1"] == (2 * SHAPE["intermediate_size"], 128)
    assert {k: result["hf_config"][k] for k in SHAPE} == SHAPE
    assert result["embedding_equal"] and result["vocab"] == 100
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    assert recorded["checkpoint"] == str(snapshot) and recorded["config"] is None  # the snapshot pins the commit
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").is_file()
