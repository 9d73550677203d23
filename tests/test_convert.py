"""HF <-> Megatron checkpoint conversion, checked against HF transformers (never against itself).

Tiny random Qwen2/Qwen3 models are built with transformers offline and saved with ``save_pretrained``:
- round trip HF -> Megatron (saved at TP=1, TP=2, PP=2) -> HF is bit-identical tensor by tensor;
- Megatron logits from each converted checkpoint equal HF transformers' logits within 1e-4 (fp32);
- tied and untied embeddings, GQA with 1, 2 and 4 query groups, single-file and sharded safetensors input;
- a checkpoint saved at TP=2 loads at TP=1 and PP=2 with logits identical to the same layout's own conversion;
- the streaming exporter (all ranks / one destination rank) reproduces the HF tensors at every layout;
- errors (missing / unexpected tensor, shape mismatch, MoE, sliding window, layout, existing output) name the
  tensor or field, exit non-zero, and leave nothing at the output path;
- the CLI itself (spawned gloo workers, exit codes) for hf-to-megatron --pp 2, verify --tp 2, and a failing verify.

Each layout is one spawned run that converts every model (batching keeps the module around a couple of minutes).
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from converter_cli import converter_cli, converter_program
from hf_reference import TINY_QWEN2, TINY_QWEN3, assert_bit_identical, bits, hf_model
from multiproc import run_on_ranks

BATCH, SEQ = 2, 16

# name -> (base config, overrides, save_pretrained max_shard_size or None)
MODELS = {
    "qwen2_untied_g2": (TINY_QWEN2, {}, None),
    "qwen2_tied_g1": (TINY_QWEN2, {"num_key_value_heads": 1, "tie_word_embeddings": True}, None),
    "qwen3_tied_g2_sharded": (TINY_QWEN3, {}, "200KB"),
    "qwen3_untied_g4_sharded": (TINY_QWEN3, {"num_key_value_heads": 4, "tie_word_embeddings": False}, "300KB"),
}
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}


def token_batch(vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(11))


def read_hf_dir(directory: str) -> dict[str, torch.Tensor]:
    from megatron_dynamo.models.checkpoint_io import HFCheckpointReader

    reader = HFCheckpointReader(directory)
    return {name: reader.get(name).clone() for name in reader.names()}


def stored_items(megatron_dir: str) -> dict[str, int]:
    """How many stored pieces each tensor of a Megatron checkpoint has (torch DCP metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(os.path.join(megatron_dir, "model")).read_metadata()
    return {key: len(getattr(md, "chunks", [])) for key, md in metadata.state_dict_metadata.items()}


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Save each tiny model with save_pretrained; keep its HF logits on the token batch as the reference."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for seed, (name, (config, overrides, shard)) in enumerate(MODELS.items()):
        model = hf_model(config, seed=seed, **overrides)
        directory = str(root / name)
        model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
        with torch.no_grad():
            logits = model(input_ids=token_batch()).logits
        out[name] = {"dir": directory, "logits": logits, "config": config, "overrides": overrides, "seed": seed}
    # The inputs really are what the tests claim: sharded where asked, tied without lm_head.
    assert os.path.exists(os.path.join(out["qwen3_tied_g2_sharded"]["dir"], "model.safetensors.index.json"))
    assert "lm_head.weight" not in read_hf_dir(out["qwen3_tied_g2_sharded"]["dir"])
    assert "lm_head.weight" in read_hf_dir(out["qwen3_untied_g4_sharded"]["dir"])
    return out


def _layout_worker(rank, world_size, tp, pp, jobs, extra_loads, ids, max_item_bytes):
    """Per model: hf-to-megatron at this layout, megatron-to-hf from it, logits and streamed export from the
    checkpoint; then load checkpoints saved at other layouts. Runs under the launcher (torchrun-like) path."""
    from checkpoints_convert import convert
    from checkpoints_convert.launch import Layout
    from checkpoints_convert.verify import _verify_rank
    from megatron.core import parallel_state
    from megatron_dynamo.models.checkpoint_io import HFCheckpointReader, load_model_checkpoint, read_checkpoint_info
    from megatron_dynamo.models.export import iter_hf_weights
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.actor import MegatronActor

    def load_and_check(meg_dir, hf_dir, dtype_cast=None):
        runtime.init_distributed(runtime.ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp), seed=0)
        ckpt = read_checkpoint_info(meg_dir)
        actor = MegatronActor(ckpt.arch, dtype=ckpt.dtype, perform_initialization=False)
        load_model_checkpoint(actor.chunks, meg_dir)
        reader = HFCheckpointReader(hf_dir)

        def differs(name, tensor):
            want = reader.get(name)
            want = want.to(dtype_cast) if dtype_cast is not None else want
            return tensor.dtype != want.dtype or tensor.shape != want.shape or not torch.equal(bits(tensor), bits(want))

        # Every rank receives every tensor...
        names, bad = [], []
        for name, tensor in iter_hf_weights(actor.chunks, ckpt.arch):
            names.append(name)
            if differs(name, tensor):
                bad.append(name)
        # ...or only the last rank does (it sits on the last stage / TP rank 1 here).
        dst = world_size - 1
        dst_names = []
        for name, tensor in iter_hf_weights(actor.chunks, ckpt.arch, dst_rank=dst):
            dst_names.append(name)
            if differs(name, tensor):
                bad.append("dst:" + name)
        logits = None
        if dtype_cast is None:
            logits = _verify_rank(meg_dir, Layout(tp, pp), ids)
        return {"names": names, "dst_names": dst_names, "bad": bad, "logits": logits,
                "tp_rank": parallel_state.get_tensor_model_parallel_rank()}

    results = {}
    for name, hf_dir, meg_dir, hf_out, dtype in jobs:
        convert.hf_to_megatron(hf_dir, meg_dir, tp=tp, pp=pp, dtype=dtype, quiet=True, max_item_bytes=max_item_bytes)
        convert.megatron_to_hf(meg_dir, hf_out, tp=tp, pp=pp, quiet=True)
        cast = torch.bfloat16 if dtype == "bf16" else None
        results[name] = load_and_check(meg_dir, hf_dir, cast)
    for name, hf_dir, meg_dir in extra_loads:
        results["load:" + name] = load_and_check(meg_dir, hf_dir)
    return results


def _run_layout(models, tmp_path_factory, layout, extra_loads=(), bf16_job=False, max_item_bytes=16 * 2**20):
    tp, pp = LAYOUTS[layout]
    root = tmp_path_factory.mktemp(layout)
    jobs, dirs = [], {}
    for name, info in models.items():
        if info["overrides"].get("num_key_value_heads", 2) % tp:
            continue  # 1 query group cannot be split over 2 TP ranks (an error case, tested below)
        meg, hf_out = str(root / f"{name}.megatron"), str(root / f"{name}.hf")
        jobs.append((name, info["dir"], meg, hf_out, "fp32"))
        dirs[name] = (meg, hf_out)
    if bf16_job:
        name = "qwen2_untied_g2"
        meg, hf_out = str(root / "bf16.megatron"), str(root / "bf16.hf")
        jobs.append(("bf16", models[name]["dir"], meg, hf_out, "bf16"))
        dirs["bf16"] = (meg, hf_out)
    per_rank = run_on_ranks(_layout_worker, tp * pp, tp, pp, jobs, list(extra_loads), token_batch(), max_item_bytes)
    return {"dirs": dirs, "ranks": per_rank, "tp": tp, "pp": pp, "max_item_bytes": max_item_bytes}


# TP=2 and PP=2 store tensors above 20 kB as row pieces (embeddings, fc1 halves, QKV, tied copies: the
# fragmentation must agree across ranks and reshard on load); TP=1 keeps the default (nothing split).
SMALL_ITEMS = 20_000


@pytest.fixture(scope="module")
def tp2_run(models, tmp_path_factory):
    return _run_layout(models, tmp_path_factory, "tp2", max_item_bytes=SMALL_ITEMS)


@pytest.fixture(scope="module")
def tp1_run(models, tmp_path_factory, tp2_run):
    loads = [(n, models[n]["dir"], tp2_run["dirs"][n][0]) for n in tp2_run["dirs"]]
    return _run_layout(models, tmp_path_factory, "tp1", loads, bf16_job=True)


@pytest.fixture(scope="module")
def pp2_run(models, tmp_path_factory, tp2_run):
    loads = [(n, models[n]["dir"], tp2_run["dirs"][n][0]) for n in tp2_run["dirs"]]
    return _run_layout(models, tmp_path_factory, "pp2", loads, max_item_bytes=SMALL_ITEMS)


def _logits(run, key):
    found = [r[key]["logits"] for r in run["ranks"] if r[key]["logits"] is not None]
    assert len(found) == 1, f"{key}: expected logits from exactly one rank, got {len(found)}"
    return found[0]


@pytest.fixture(params=list(LAYOUTS))
def run(request, tp1_run, tp2_run, pp2_run):
    return {"tp1": tp1_run, "tp2": tp2_run, "pp2": pp2_run}[request.param]


# ---------------------------------------------------------------------------------------------- round trip & parity
@pytest.mark.distributed
def test_round_trip_is_bit_identical(models, run):
    assert run["dirs"], "no model was converted"
    for name, (meg, hf_out) in run["dirs"].items():
        source = models["qwen2_untied_g2" if name == "bf16" else name]["dir"]
        want = read_hf_dir(source)
        if name == "bf16":
            want = {k: v.to(torch.bfloat16) for k, v in want.items()}  # fp32 -> bf16 rounds once, then exact
        assert_bit_identical(read_hf_dir(hf_out), want, f"{name} at tp={run['tp']} pp={run['pp']}")
        config = json.load(open(os.path.join(hf_out, "config.json")))
        assert config.get("dtype", config.get("torch_dtype")) == ("bfloat16" if name == "bf16" else "float32")
        assert os.path.exists(os.path.join(hf_out, "model.safetensors.index.json"))
        assert os.path.exists(os.path.join(hf_out, "generation_config.json"))
        meta = json.load(open(os.path.join(meg, "megatron_dynamo.json")))
        assert meta["saved_with"] == {"tensor_parallel": run["tp"], "pipeline_parallel": run["pp"]}
        if name != "bf16":
            items = stored_items(meg)
            split = run["max_item_bytes"] < 2**20
            # Unsplit: one item per TP shard (embedding), two halves per layer and TP shard (fc1).
            assert (items["embedding.word_embeddings.weight"] > run["tp"]) == split, (name, items)
            assert (items["decoder.layers.mlp.linear_fc1.weight"] > 2 * 4 * run["tp"]) == split, (name, items)


@pytest.mark.distributed
def test_megatron_logits_match_hf_transformers(models, run):
    for name in (n for n in run["dirs"] if n != "bf16"):
        logits = _logits(run, name)
        diff = (logits - models[name]["logits"]).abs().max().item()
        assert diff <= 1e-4, f"{name} at tp={run['tp']} pp={run['pp']}: max |logit diff| {diff}"


@pytest.mark.distributed
def test_streamed_export_matches_hf_on_every_rank(models, run):
    from megatron_dynamo.models.checkpoint_io import parse_qwen_config, read_hf_config
    from megatron_dynamo.models.mappings import hf_parameter_names

    world = run["tp"] * run["pp"]
    for name in run["dirs"]:
        source = models["qwen2_untied_g2" if name == "bf16" else name]["dir"]
        expected = hf_parameter_names(parse_qwen_config(read_hf_config(source)))
        for rank, result in enumerate(run["ranks"]):
            r = result[name]
            assert r["bad"] == [], f"{name} rank {rank}: exported tensors differ: {r['bad']}"
            assert r["names"] == expected, f"{name} rank {rank}: wrong names or order"
            assert r["dst_names"] == (expected if rank == world - 1 else []), f"{name} rank {rank}: dst_rank mode"


@pytest.mark.distributed
def test_tp2_checkpoint_loads_at_tp1_and_pp2_with_identical_logits(models, tp1_run, tp2_run, pp2_run):
    for run in (tp1_run, pp2_run):
        for name in tp2_run["dirs"]:
            from_tp2 = _logits(run, "load:" + name)
            own = _logits(run, name)
            # Same weights, same layout -> the very same numbers; and still HF's logits.
            assert torch.equal(from_tp2, own), f"{name}: TP=2 checkpoint at tp={run['tp']} pp={run['pp']}"
            assert (from_tp2 - models[name]["logits"]).abs().max().item() <= 1e-4
            for rank, result in enumerate(run["ranks"]):
                assert result["load:" + name]["bad"] == [], f"{name} rank {rank}"


@pytest.mark.distributed
def test_exported_dir_loads_in_transformers(models, tp2_run):
    import transformers

    for name in ("qwen2_untied_g2", "qwen3_tied_g2_sharded"):
        model = transformers.AutoModelForCausalLM.from_pretrained(tp2_run["dirs"][name][1], dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
        with torch.no_grad():
            logits = model(input_ids=token_batch()).logits
        assert torch.equal(logits, models[name]["logits"]), name


# ---------------------------------------------------------------------------------------------- errors
def _copy_with(src: str, dst, change_tensors=None, change_config=None) -> str:
    """A copy of an HF directory (single-file safetensors) with tensors and/or config edited."""
    import shutil

    shutil.copytree(src, dst)
    if change_tensors:
        tensors = load_file(os.path.join(dst, "model.safetensors"))
        change_tensors(tensors)
        save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    if change_config:
        path = os.path.join(dst, "config.json")
        config = json.load(open(path))
        change_config(config)
        json.dump(config, open(path, "w"))
    return str(dst)


def _no_trace(out) -> None:
    parent, base = os.path.dirname(str(out)), os.path.basename(str(out))
    assert not os.path.exists(out), f"{out} was left behind"
    leftovers = [n for n in os.listdir(parent) if n.startswith(f".{base}.")]
    assert leftovers == [], f"temporary directories left: {leftovers}"


ERROR_CASES = {
    "missing_tensor": (dict(change_tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
                       "model.layers.1.mlp.up_proj.weight"),
    "unexpected_tensor": (dict(change_tensors=lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)})),
                          "model.layers.0.mlp.extra.weight"),
    "shape_mismatch": (dict(change_tensors=lambda t: t.update(
        {"model.layers.2.self_attn.k_proj.weight": t["model.layers.2.self_attn.k_proj.weight"][:32]})),
        "model.layers.2.self_attn.k_proj.weight"),
    "moe_model_type": (dict(change_config=lambda c: c.update(model_type="qwen2_moe")), "model_type"),
    "moe_experts": (dict(change_config=lambda c: c.update(num_experts=8)), "num_experts"),
    "sliding_window": (dict(change_config=lambda c: c.update(use_sliding_window=True, sliding_window=64)),
                       "use_sliding_window"),
    "rope_scaling": (dict(change_config=lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                            "rope_theta": 1e4})), "yarn"),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_hf_to_megatron_errors_name_the_problem_and_leave_nothing(models, tmp_path, case):
    change, needle = ERROR_CASES[case]
    src = _copy_with(models["qwen2_untied_g2"]["dir"], tmp_path / "src", **change)
    out = tmp_path / "out"
    code, err = converter_cli("hf-to-megatron", "--hf", src, "--out", out)
    assert code == 1, err
    assert needle in err and err.startswith("error:"), err
    _no_trace(out)


def test_tied_model_with_a_different_lm_head_is_refused(models, tmp_path):
    """A tied config may come with an lm_head.weight only if it equals the embedding."""
    src = _copy_with(models["qwen2_tied_g1"]["dir"], tmp_path / "src",
                     change_tensors=lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1}))
    out = tmp_path / "out"
    code, err = converter_cli("hf-to-megatron", "--hf", src, "--out", out)
    assert code == 1 and "lm_head.weight differs from model.embed_tokens.weight" in err, err
    _no_trace(out)


def test_layout_that_does_not_divide_the_model_is_refused(models, tmp_path):
    out = tmp_path / "out"
    code, err = converter_cli("hf-to-megatron", "--hf", models["qwen2_tied_g1"]["dir"], "--out", out, "--tp", "2")
    assert code == 1 and "num_key_value_heads=1" in err, err
    _no_trace(out)


def test_existing_output_is_refused_without_force(models, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = converter_cli("hf-to-megatron", "--hf", models["qwen2_untied_g2"]["dir"], "--out", out)
    assert code == 1 and "--force" in err, err
    assert (out / "keep.txt").read_text() == "mine"


def test_help_explains_every_option():
    from checkpoints_convert.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    assert set(subparsers) == {"hf-to-megatron", "megatron-to-hf", "verify", "sign"}
    for name, sub in subparsers.items():
        for action in sub._actions:
            assert action.help and len(action.help) > 10, f"{name} {action.option_strings}: no help"


@pytest.mark.parametrize("config,overrides", [(TINY_QWEN2, {"num_key_value_heads": 1}), (TINY_QWEN2, {}),
                                             (TINY_QWEN3, {"num_key_value_heads": 4})], ids=["qwen2_g1", "qwen2_g2", "qwen3_g4"])
def test_row_pieces_agree_with_to_megatron_and_to_hf_inverts_it(config, overrides):
    """The row-streaming loader (row_pieces) and the tensor path (to_megatron) build the same shards, and
    to_hf of all ranks' shards gives back the HF tensors, for every mapping of a layer and every TP size."""
    from megatron_dynamo.models.checkpoint_io import parse_qwen_config, read_hf_config
    from megatron_dynamo.models.mappings import global_mappings

    arch = parse_qwen_config({**read_hf_config(config), **overrides})
    g = torch.Generator().manual_seed(0)
    checked = set()
    for mapping in global_mappings(arch)[:12] + global_mappings(arch)[-2:]:
        hf = [torch.randn(shape, generator=g) for shape in mapping.hf_shapes]
        for tp in (1, 2, 4):
            if arch.num_key_value_heads % tp:
                continue
            shards = [mapping.to_megatron(hf, r, tp) for r in range(tp)]
            for rank, shard in enumerate(shards):
                pieces = mapping.row_pieces(rank, tp)
                if pieces is None:
                    continue
                built = torch.full_like(shard, float("nan"))
                for p in pieces:
                    built[p.dst_start:p.dst_start + p.rows] = hf[p.hf_index][p.src_start:p.src_start + p.rows]
                assert torch.equal(built, shard), f"{mapping.megatron_name} tp={tp} rank={rank}"
                checked.add(type(mapping).__name__)
            back = mapping.to_hf(shards)
            assert all(torch.equal(a, b) for a, b in zip(back, hf)), f"{mapping.megatron_name} tp={tp}"
    assert {"QKVMapping", "GatedMLPMapping", "SplitMapping", "ReplicatedMapping"} <= checked


def test_shard_writer_plan_checks_and_atomic_dir(tmp_path):
    from megatron_dynamo.models.checkpoint_io import (CheckpointError, HFCheckpointReader, SafetensorsShardWriter,
                                                      atomic_output_dir)

    tensors = {f"t{i}": torch.randn(10 + i, 7) for i in range(5)}
    tensors["b"] = torch.randn(3, dtype=torch.float32).to(torch.bfloat16)
    plan = [(k, v.shape, v.dtype) for k, v in tensors.items()]
    with atomic_output_dir(tmp_path / "ok") as tmp:
        writer = SafetensorsShardWriter(tmp, plan, max_shard_bytes=700)
        for name in reversed(list(tensors)):  # any order
            writer.write(name, tensors[name])
        writer.close()
        with pytest.raises(CheckpointError, match="'nope'"):
            writer.write("nope", torch.zeros(1))
    assert len(writer.files) > 2
    reader = HFCheckpointReader(tmp_path / "ok")
    for name, tensor in tensors.items():
        assert torch.equal(bits(reader.get(name)), bits(tensor)), name
    assert load_file(str(tmp_path / "ok" / writer.files[0]))  # the safetensors library reads our files too

    with pytest.raises(CheckpointError, match="'t3' was never written"):
        with atomic_output_dir(tmp_path / "bad") as tmp:
            writer = SafetensorsShardWriter(tmp, plan, max_shard_bytes=700)
            for name in tensors:
                if name != "t3":
                    writer.write(name, tensors[name])
            writer.close()
    _no_trace(tmp_path / "bad")
    writer = SafetensorsShardWriter(tmp_path / "shape", plan)
    with pytest.raises(CheckpointError, match="t1: shape"):
        writer.write("t1", torch.zeros(3, 7))
    with pytest.raises(CheckpointError, match="t1: dtype"):
        writer.write("t1", torch.zeros(11, 7, dtype=torch.float64))
    writer._close_fds()


# ---------------------------------------------------------------------------------------------- the CLI as a program
@pytest.mark.distributed
@pytest.mark.extended
def test_cli_spawns_workers_converts_and_verifies(models, tmp_path):
    meg = tmp_path / "meg"
    code, _, err = converter_program("hf-to-megatron", "--hf", models["qwen3_tied_g2_sharded"]["dir"], "--out", meg,
                            "--pp", "2", "--quiet")
    assert code == 0, err
    code, out, err = converter_program("verify", "--hf", models["qwen3_tied_g2_sharded"]["dir"], "--megatron", meg,
                              "--tp", "2")
    assert code == 0, err
    diff = float(out.split("max_abs_logit_diff")[1].split()[0])
    assert diff <= 1e-4 and "PASS" in err, (out, err)
    # The trainer's quiet console: the checkpoint's verification and the verdict, no library FutureWarning /
    # UserWarning, no progress bar.
    lines = err.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"verify: {meg} verified; ") and "PASS" in lines[1], err
    code, _, err = converter_program("hf-to-megatron", "--hf", models["qwen3_tied_g2_sharded"]["dir"], "--out",
                            tmp_path / "meg1")
    assert code == 0, err
    header = err.splitlines()[0]  # a model of a few MB: its size in MiB, not "0.00 GiB"
    assert re.search(r", \d+\.\d MiB\) -> ", header), header
    # The same checkpoint against a different HF model of the same shape: verify must fail with exit code 3.
    other = tmp_path / "other"
    hf_model(TINY_QWEN3, seed=99).save_pretrained(other)
    code, out, err = converter_program("verify", "--hf", other, "--megatron", meg, "--quiet")
    assert code == 3 and "above the tolerance" in err, (code, out, err)


@pytest.mark.distributed
def test_cli_failure_inside_workers_leaves_nothing(models, tmp_path, tp1_run):
    """A Megatron checkpoint whose stored config no longer matches its tensors: the error is found after the
    output directory was started (while loading), and names the tensor."""
    import shutil

    meg = tp1_run["dirs"]["qwen2_untied_g2"][0]
    broken = tmp_path / "broken"
    shutil.copytree(meg, broken)
    config_path = broken / "hf" / "config.json"
    config = json.load(open(config_path))
    config["intermediate_size"] = 256
    json.dump(config, open(config_path, "w"))
    from checkpoints_convert.sign import sign_checkpoint

    (broken / "manifest.json").unlink()  # its checksums would refuse the change before any loading
    sign_checkpoint(broken)
    out = tmp_path / "out"
    code, _, err = converter_program("megatron-to-hf", "--megatron", broken, "--out", out, "--quiet")
    assert code == 1 and "linear_fc1.weight" in err and "shape mismatch" in err, err
    _no_trace(out)
    # --hf-config describing another architecture is refused before anything is written.
    other = _copy_with(models["qwen2_untied_g2"]["dir"], tmp_path / "other_cfg",
                       change_config=lambda c: c.update(num_key_value_heads=4))
    code, err = converter_cli("megatron-to-hf", "--megatron", meg, "--out", out, "--hf-config", other, "--quiet")
    assert code == 1 and "num_key_value_heads" in err, err
    _no_trace(out)
