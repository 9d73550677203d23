"""Mixture-of-experts checkpoints (Qwen3-MoE, Qwen2-MoE with its shared expert and tied embeddings) through the
converter, the shared export stream and the trainer's checkpoints, with the experts split over expert-parallel ranks.

References are HF transformers' models (decisive routers) saved with ``save_pretrained`` and read back with the
safetensors library, and transformers' own logits; none of them call the code under test.

- HF -> Megatron (``--ep 2``, and ``--tp 2 --ep 2``) -> HF is bit-identical tensor by tensor, and the exported
  directory gives transformers' logits exactly; each expert-parallel rank reads only its own experts;
- the Megatron model loaded from the converted checkpoint gives HF's logits (<= 1e-5), and ``verify --ep 2`` passes;
- ``iter_hf_weights`` (every rank receiving, and each rank as ``dst_rank``) streams the HF tensors in HF order at
  expert parallel 2, the same tensors as at expert parallel 1 from the same checkpoint;
- a trainer checkpoint (model and Adam state) saved at expert parallel 2 loads at 1 and the other way round, every
  weight and moment the same;
- a bad ``--ep`` is one line, before any rank starts.

Two ranks (this machine has two cores), and an ``extended`` variant on four: pipeline 2 x expert parallel 2.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from converter_cli import converter_cli, converter_program
from hf_reference import (TINY_QWEN2_MOE, TINY_QWEN3, TINY_QWEN3_MOE, assert_bit_identical, bits, hf_model,
                          read_hf_checkpoint, reference_moe_model)
from multiproc import run_on_ranks

FAMILIES = {"qwen3_moe": TINY_QWEN3_MOE, "qwen2_moe": TINY_QWEN2_MOE}
LOGITS_TOLERANCE = 1e-5  # as tests/test_moe_models.py: measured 5e-7 (fp32)


def token_batch() -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each family's reference model saved with save_pretrained (per-expert tensor names), and its logits."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for seed, (name, config) in enumerate(FAMILIES.items()):
        model = reference_moe_model(config, seed=seed)
        directory = str(root / name)
        model.save_pretrained(directory)
        with torch.no_grad():
            logits = model(input_ids=token_batch()).logits
        out[name] = {"dir": directory, "logits": logits, "tensors": read_hf_checkpoint(directory)}
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in out["qwen3_moe"]["tensors"]
    assert "model.layers.0.mlp.shared_expert_gate.weight" in out["qwen2_moe"]["tensors"]
    return out


# ---------------------------------------------------------------------------------------------- the layout runs
def _streams(meg_dir: str, parallel, world_size: int, source: dict) -> dict:
    """The checkpoint loaded at ``parallel``; what iter_hf_weights yields here (every rank receiving, then each rank
    as dst_rank): the names in order, those that differ from the HF ``source``, and the tensors."""
    from megatron_dynamo.models.checkpoint_io import load_model_checkpoint, read_checkpoint_info
    from megatron_dynamo.models.export import iter_hf_weights
    from megatron_dynamo.models.megatron_model import MegatronModel
    from megatron_dynamo.parallel import runtime

    runtime.init_distributed(parallel, seed=0)
    ckpt = read_checkpoint_info(meg_dir)
    model = MegatronModel(ckpt.arch, dtype=ckpt.dtype, perform_initialization=False)
    load_model_checkpoint(model.chunks, meg_dir)
    out = {}
    for mode in ["every", *range(world_size)]:
        dst_rank = None if mode == "every" else mode
        tensors = {name: t.clone() for name, t in iter_hf_weights(model.chunks, ckpt.arch, dst_rank=dst_rank)}
        differs = [n for n, t in tensors.items() if n not in source or not torch.equal(bits(t), bits(source[n]))]
        out[mode] = {"names": list(tensors), "differs": differs, "tensors": tensors}
    return out


def _layout_worker(rank, world_size, layout, jobs, ids):
    """Per family: hf-to-megatron and megatron-to-hf at ``layout`` (the launcher path: every rank runs the command),
    the Megatron logits, and the export stream from the checkpoint at ``layout`` and at expert parallel 1 (the same
    ranks, data parallel)."""
    from checkpoints_convert import convert
    from checkpoints_convert.verify import _verify_rank
    from megatron_dynamo.parallel import runtime

    results = {}
    for name, hf_dir, meg, hf_out in jobs:
        source = read_hf_checkpoint(hf_dir)
        summary = convert.hf_to_megatron(hf_dir, meg, tp=layout.tp, pp=layout.pp, ep=layout.ep, quiet=True)
        convert.megatron_to_hf(meg, hf_out, tp=layout.tp, pp=layout.pp, ep=layout.ep, quiet=True)
        at_layout = _streams(meg, layout.parallel_config(), world_size, source)
        at_ep1 = _streams(meg, runtime.ParallelConfig(tensor_parallel=layout.tp, pipeline_parallel=layout.pp),
                          world_size, source)
        # The same tensors at expert parallel 2 and 1, in each mode on the receiving ranks.
        ep1 = at_ep1["every"]["tensors"]
        not_as_ep1 = [f"{mode}:{n}" for mode, got in at_layout.items() for n, t in got["tensors"].items()
                      if not torch.equal(bits(t), bits(ep1[n]))]
        for got in (*at_layout.values(), *at_ep1.values()):
            del got["tensors"]
        results[name] = {"summary": summary, "streams": at_layout, "ep1_streams": at_ep1, "not_as_ep1": not_as_ep1,
                         "logits": _verify_rank(meg, layout, ids)}
    return results


def _run_layout(models, tmp_path_factory, tp: int, pp: int, ep: int, families=tuple(FAMILIES)):
    from checkpoints_convert.launch import Layout

    layout = Layout(tp, pp, ep)
    root = tmp_path_factory.mktemp(str(layout).replace(" ", "_").replace("=", ""))
    jobs = [(name, models[name]["dir"], str(root / f"{name}.megatron"), str(root / f"{name}.hf")) for name in families]
    ranks = run_on_ranks(_layout_worker, layout.world_size, layout, jobs, token_batch())
    return {"layout": layout, "jobs": {name: (meg, hf_out) for name, _, meg, hf_out in jobs}, "ranks": ranks}


@pytest.fixture(scope="module")
def ep2_run(models, tmp_path_factory):
    return _run_layout(models, tmp_path_factory, tp=1, pp=1, ep=2)


@pytest.fixture(scope="module")
def tp2_ep2_run(models, tmp_path_factory):
    """Expert groups across the tensor-parallel group: both ranks split the attention, each holds half the experts."""
    return _run_layout(models, tmp_path_factory, tp=2, pp=1, ep=2)


@pytest.fixture(scope="module")
def pp2_ep2_run(models, tmp_path_factory):
    """Four ranks: two pipeline stages, each an expert group of two (qwen3_moe: qwen2_moe's 3 layers do not split in
    two). Experts cross stages by broadcast (every rank receiving) or by a send to dst_rank."""
    return _run_layout(models, tmp_path_factory, tp=1, pp=2, ep=2, families=("qwen3_moe",))


@pytest.fixture(params=["ep2", "tp2_ep2", pytest.param("pp2_ep2", marks=pytest.mark.extended)])
def run(request):
    return request.getfixturevalue(f"{request.param}_run")


# ---------------------------------------------------------------------------------------------- round trip & parity
@pytest.mark.distributed
def test_round_trip_at_expert_parallel_2_is_bit_identical(models, run):
    import json

    for name, (meg, hf_out) in run["jobs"].items():
        assert_bit_identical(read_hf_checkpoint(hf_out), models[name]["tensors"], f"{name} at {run['layout']}")
        meta = json.load(open(os.path.join(meg, "megatron_dynamo.json")))
        layout = run["layout"]
        assert meta["saved_with"] == {"tensor_parallel": layout.tp, "pipeline_parallel": layout.pp,
                                      "expert_parallel": layout.ep}


@pytest.mark.distributed
def test_each_expert_parallel_rank_reads_only_its_own_experts(models, run):
    layout = run["layout"]
    stage_ranks = layout.world_size // layout.pp  # the expert groups of a stage: stage_ranks / ep of them
    for name in run["jobs"]:
        names = list(models[name]["tensors"])
        experts = [n for n in names if re.search(r"\.mlp\.experts\.\d+\.", n)]
        read = [r["tensors_read"] for r in run["ranks"][0][name]["summary"]["ranks"]]
        # Every rank of a stage reads the stage's other tensors (untied pipelined models: each once), each expert
        # group the stage's experts once.
        assert sum(read) == stage_ranks * (len(names) - len(experts)) + stage_ranks // layout.ep * len(experts)
        if layout.pp == 1:
            assert read == [len(names) - len(experts) // layout.ep] * layout.world_size, name


@pytest.mark.distributed
def test_megatron_logits_at_expert_parallel_2_match_hf_transformers(models, run):
    for name in run["jobs"]:
        found = [r[name]["logits"] for r in run["ranks"] if r[name]["logits"] is not None]
        assert found, name
        for logits in found:  # ep 2 alone: two data-parallel ranks ran the batch
            diff = (logits - models[name]["logits"]).abs().max().item()
            assert diff <= LOGITS_TOLERANCE, f"{name} at {run['layout']}: max |logit diff| {diff}"


@pytest.mark.distributed
def test_export_stream_at_expert_parallel_2_is_hf_and_as_at_1(models, run):
    from megatron_dynamo.models.checkpoint_io import parse_qwen_config, read_hf_config
    from megatron_dynamo.models.mappings import hf_parameter_names

    for name in run["jobs"]:
        expected = hf_parameter_names(parse_qwen_config(read_hf_config(models[name]["dir"])))
        assert sorted(expected) == sorted(models[name]["tensors"])
        for rank, result in enumerate(run["ranks"]):
            for streams in (result[name]["streams"], result[name]["ep1_streams"]):
                assert streams["every"]["names"] == expected, f"{name} rank {rank}: names or order"
                for dst in range(run["layout"].world_size):
                    assert streams[dst]["names"] == (expected if rank == dst else []), f"{name} rank {rank} dst {dst}"
                assert all(s["differs"] == [] for s in streams.values()), f"{name} rank {rank}: differs from HF"
            assert result[name]["not_as_ep1"] == [], f"{name} rank {rank}"


@pytest.mark.distributed
def test_exported_moe_dir_gives_transformers_logits(models, ep2_run):
    import transformers

    for name, (_, hf_out) in ep2_run["jobs"].items():
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_out, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
        with torch.no_grad():
            assert torch.equal(model(input_ids=token_batch()).logits, models[name]["logits"]), name


@pytest.mark.distributed
def test_cli_verify_passes_at_expert_parallel_2(models, tp2_ep2_run):
    """The program spawns its two ranks itself; the checkpoint was saved at tp 2 x ep 2 and loads at ep 2 alone."""
    meg, _ = tp2_ep2_run["jobs"]["qwen2_moe"]
    code, out, err = converter_program("verify", "--hf", models["qwen2_moe"]["dir"], "--megatron", meg, "--ep", "2")
    assert code == 0, err
    assert float(out.split("max_abs_logit_diff")[1].split()[0]) <= LOGITS_TOLERANCE, out
    assert "megatron tp=1 pp=1 ep=2:" in err and "PASS" in err and "Warning" not in err, err


# ---------------------------------------------------------------------------------------------- trainer checkpoints
def _by_hf_name(actor) -> dict:
    """This rank's parameters and their Adam state (exp_avg, exp_avg_sq, step), by HF name (experts by their
    global index: the same name at any expert-parallel size)."""
    from megatron_dynamo.models.mappings import chunk_mappings, unwrap_model

    optimizers = [o.optimizer for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])]
    out = {}
    for chunk in actor.chunks:
        for mapping, param in chunk_mappings(unwrap_model(chunk), actor.arch, actor.use_te):
            state = next(o.state[param] for o in optimizers if param in o.state)
            out[mapping.hf_names[0]] = [param.detach().clone(), state["exp_avg"].clone(),
                                        state["exp_avg_sq"].clone(), float(state["step"])]
    return out


def _resume_worker(rank, world_size, root):
    """For expert parallel 2 then 1, and 1 then 2: two optimizer steps at the first size, the trainer's checkpoint;
    a fresh actor at the second resumed from it. Both actors' parameters and Adam state by HF name."""
    from megatron_dynamo.models.qwen import load_hf_config
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig
    from megatron_dynamo.trainer.checkpoint import load_checkpoint, save_checkpoint

    def actor_at(ep: int, seed: int):
        runtime.init_distributed(runtime.ParallelConfig(expert_parallel=ep), seed=seed)
        return MegatronActor(TINY_QWEN3_MOE, optim=OptimConfig(lr=1e-3))

    results = []
    for first_ep, then_ep in ((2, 1), (1, 2)):
        saved = actor_at(first_ep, seed=1)
        ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(rank))
        for _ in range(2):
            saved.forward_backward([{"input_ids": ids}], lambda logits, mb: (logits.float().pow(2).mean(), {}))
            assert saved.optimizer_step().update_successful
        path = save_checkpoint(os.path.join(root, f"ep{first_ep}"), 2, saved.chunks, saved.optimizer, {},
                               load_hf_config(TINY_QWEN3_MOE), "fp32", 1, {"expert_parallel": first_ep})
        resumed = actor_at(then_ep, seed=2)  # other random weights: the load must replace them
        load_checkpoint(path, resumed.chunks, resumed.optimizer)
        results.append((first_ep, _by_hf_name(saved), _by_hf_name(resumed)))
    return results


@pytest.mark.distributed
def test_trainer_checkpoint_resumes_at_another_expert_parallel_size(tmp_path):
    """Expert parallel 2 chains a second optimizer for the experts (one optimizer at 1): the state reshards anyway,
    from 2 to 1 and from 1 to 2."""
    for rank, directions in enumerate(run_on_ranks(_resume_worker, 2, str(tmp_path))):
        for first_ep, before, after in directions:
            what = f"rank {rank}, expert parallel {first_ep} -> {3 - first_ep}"
            fewer, more = (after, before) if first_ep == 1 else (before, after)
            # at expert parallel 2, each rank holds 4 of the 8 experts (fc1 and fc2) of each of the 3 MoE layers
            assert set(fewer) < set(more) and len(more) - len(fewer) == 3 * 4 * 2, what
            for name in fewer:
                for kind, a, b in zip(("weight", "exp_avg", "exp_avg_sq"), before[name], after[name]):
                    assert torch.equal(a, b), f"{what}: {name} {kind}"
                assert before[name][3] == after[name][3] == 2.0, f"{what}: {name} step"
            assert any(before[n][1].abs().sum() > 0 for n in fewer if ".experts." in n)  # moments are not zeros


# ---------------------------------------------------------------------------------------------- errors
@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dense") / "qwen3"
    hf_model(TINY_QWEN3).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("family,args,message", [
    ("qwen3_moe", ["--ep", "3"], "error: --ep=3 does not divide the model's 8 experts (every expert rank holds as "
                                 "many experts)"),
    ("qwen2_moe", ["--ep", "8"], "error: --ep=8 does not divide the model's 4 experts (every expert rank holds as "
                                 "many experts)"),
    ("dense", ["--ep", "2"], "error: --ep: must be 1 for a dense model (no experts to split), got 2"),
])
def test_bad_expert_parallel_size_is_one_line(models, dense_dir, tmp_path, family, args, message):
    source = dense_dir if family == "dense" else models[family]["dir"]
    out = tmp_path / "out"
    code, err = converter_cli("hf-to-megatron", "--hf", source, "--out", out, *args)
    assert (code, err.strip()) == (1, message)
    assert not out.exists()


def test_launched_with_other_than_the_layouts_ranks_is_one_line(models, tmp_path, monkeypatch):
    """Under torchrun the processes are started already: 3 for --ep 2 (2 ranks) is refused before any work."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    code, err = converter_cli("hf-to-megatron", "--hf", models["qwen3_moe"]["dir"], "--out", tmp_path / "out",
                              "--ep", "2")
    assert (code, err.strip()) == (1, "error: launched with 3 processes but --pp x lcm(--tp, --ep) = 2; start "
                                      "exactly 2 (torchrun --nproc-per-node 2 ...)")
    assert not (tmp_path / "out").exists()


def test_expert_parallel_flag_is_checked_and_explained(tmp_path):
    from checkpoints_convert.cli import build_parser
    from checkpoints_convert.launch import Layout

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["verify", "--hf", "a", "--megatron", "b", "--ep", "0"])
    assert exit_.value.code == 2
    for command in ("hf-to-megatron", "megatron-to-hf", "verify"):
        sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
        assert "lcm(--tp, --ep)" in next(a.help for a in sub._actions if a.dest == "ep")
    # pp stages of lcm(tp, ep) ranks: ep beyond tp adds data-parallel ranks.
    assert [Layout(1, 1, 2).world_size, Layout(2, 1, 2).world_size, Layout(2, 2, 4).world_size,
            Layout(4, 1, 2).world_size, Layout(2, 1, 1).world_size] == [2, 2, 8, 4, 2]
