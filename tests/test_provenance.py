"""Where a run's numbers come from (experiments/provenance.py): the machine string, the warm-up hash (the weights,
not the files' metadata), the one-group-per-seed rule, and the plan comparison that lets a later version of the
code continue an experiment (a new option at its default is no change; a changed value is)."""

import os
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_dynamo.experiments.plan import first_difference, merge_plan
from megatron_dynamo.experiments.provenance import check_one_group_per_seed, seed_groups
from megatron_dynamo.trainer import provenance
from megatron_dynamo.trainer.provenance import (checkpoint_hash, cpu_model, machine_id, read_run_provenance,
                                                recorded_provenance, write_run_provenance, write_saved_warmup)


def test_the_machine_names_its_cpu_cores_torch_and_kernel_libraries():
    name = machine_id()
    assert name.startswith(cpu_model() + ", ") and f"{os.cpu_count()} core" in name
    assert f"torch {torch.__version__}, " in name
    build = torch.__config__.show()
    if "Math Kernel Library" in build:  # torch's CPU wheels: MKL and oneDNN, by version, and the ISA torch uses
        assert ", MKL 20" in name and ", oneDNN " in name
    assert name.endswith(torch.backends.cpu.get_cpu_capability())


def test_a_run_records_its_machine_and_warm_up_as_it_starts_and_the_raw_data_copies_them(tmp_path, monkeypatch):
    weights = {"w": torch.arange(6, dtype=torch.float32)}
    _save(tmp_path / "warmup", weights)
    run = tmp_path / "run"
    run.mkdir()
    assert recorded_provenance(run, warmup_run=False) == ("", "")  # nothing recorded: nothing inferred
    monkeypatch.setattr(provenance, "machine_id", lambda: "CPU A")
    write_run_provenance(run, tmp_path / "warmup")
    assert recorded_provenance(run, warmup_run=False) == ("CPU A", checkpoint_hash(tmp_path / "warmup"))
    # resumed on another machine: the run names both, so its seed is not paired with either machine's runs
    monkeypatch.setattr(provenance, "machine_id", lambda: "CPU B")
    write_run_provenance(run, tmp_path / "warmup", resumed=True)
    starts = read_run_provenance(run)["starts"]
    assert [(s["machine"], s["resumed"]) for s in starts] == [("CPU A", False), ("CPU B", True)]
    # the code that ran: this checkout's commit (other code, other kernels: another warm-up on the same machine)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isdir(os.path.join(repo, ".git")):
        assert re.fullmatch(r"[0-9a-f]{40}( \+ changes)?", starts[0]["code"]), starts[0]["code"]
    assert recorded_provenance(run, warmup_run=False)[0] == "CPU A then CPU B"
    # a warm-up run: started from nothing, it records the checkpoint it saved
    sft = tmp_path / "sft"
    sft.mkdir()
    write_run_provenance(sft, None)
    write_saved_warmup(sft, tmp_path / "warmup")
    assert read_run_provenance(sft)["starts"][0]["warmup"] == ""
    assert recorded_provenance(sft, warmup_run=True) == ("CPU B", checkpoint_hash(tmp_path / "warmup"))
    # a start checkpoint over the hashing limit is named by its path, not read again
    monkeypatch.setattr(provenance, "HASHED_START_BYTES", 0)
    write_run_provenance(tmp_path / "big", tmp_path / "warmup") if (tmp_path / "big").mkdir() is None else None
    assert read_run_provenance(tmp_path / "big")["starts"][0]["warmup"] == f"path {tmp_path / 'warmup'}"


def _save(directory, weights):
    with pytest.warns(UserWarning):  # no process group: torch saves as one process, and says so
        dcp.save(weights, checkpoint_id=str(directory / "model"))
    (directory / "trainer_state.json").write_text(f'{{"path": "{directory}"}}')  # differs: not part of the hash


def test_the_warm_up_hash_is_the_weights_not_the_files(tmp_path):
    weights = {"decoder.layers.0.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
               "embedding.weight": torch.ones(5, 2)}
    _save(tmp_path / "a", weights)
    _save(tmp_path / "b", {k: v.clone() for k, v in weights.items()})
    # torch stamps every save with its own id and path: the files differ, the weights do not
    metadata = [(tmp_path / name / "model" / ".metadata").read_bytes() for name in ("a", "b")]
    assert metadata[0] != metadata[1]
    assert checkpoint_hash(tmp_path / "a") == checkpoint_hash(tmp_path / "b")
    assert len(checkpoint_hash(tmp_path / "a")) == 16
    nudged = {k: v.clone() for k, v in weights.items()}
    nudged["embedding.weight"][4, 1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))  # one ulp
    _save(tmp_path / "c", nudged)
    assert checkpoint_hash(tmp_path / "c") != checkpoint_hash(tmp_path / "a")
    _save(tmp_path / "d", {**weights, "embedding.weight": torch.ones(2, 5)})  # same bytes, another shape
    assert checkpoint_hash(tmp_path / "d") != checkpoint_hash(tmp_path / "a")


def test_a_checkpoint_without_megatron_weights_is_hashed_by_its_files(tmp_path):
    for name in ("x", "y"):
        (tmp_path / name / "sub").mkdir(parents=True)
        (tmp_path / name / "sub" / "f.bin").write_bytes(b"\x00\x01")
    assert checkpoint_hash(tmp_path / "x") == checkpoint_hash(tmp_path / "y")
    (tmp_path / "y" / "sub" / "f.bin").write_bytes(b"\x00\x02")
    assert checkpoint_hash(tmp_path / "x") != checkpoint_hash(tmp_path / "y")


def _row(variant, seed, machine, warmup="w1"):
    return {"variant": variant, "seed": seed, "machine": machine, "warmup": warmup}


def test_a_seed_across_two_machines_or_two_warm_ups_is_refused_in_one_line():
    rows = [_row("sft", 1234, "A"), _row("sft", 1234, "B"), _row("grpo", 6, "A"), _row("dynamo", 6, "A"),
            _row("grpo", 7, "B"), _row("dynamo", 7, "B")]
    check_one_group_per_seed(rows)  # a seed per machine is fine; the warm-ups are no seed's runs
    assert seed_groups(rows) == {6: {("A", "w1"): 2}, 7: {("B", "w1"): 2}}
    with pytest.raises(ValueError) as machines:
        check_one_group_per_seed([*rows, _row("gc", 6, "B")])
    assert str(machines.value).startswith("seed 6's runs span two machines (2 run(s) on A from warm-up w1; "
                                          "1 run(s) on B from warm-up w1)") and "\n" not in str(machines.value)
    with pytest.raises(ValueError, match="^seed 7's runs span two warm-ups"):
        check_one_group_per_seed([*rows, _row("gc", 7, "B", warmup="w2")])


def test_a_new_option_at_its_default_is_no_change_of_plan_but_a_changed_value_is():
    old = {"optim": {"lr": 5e-5}, "moe": None, "trainer": {"steps": 30}}
    assert first_difference(old, {**old, "parallel": {"expert_parallel": 1}}) is None  # a later version's new key
    assert first_difference(old, {**old, "optim": {"lr": 1e-4}}) == "optim.lr"
    assert first_difference(old, {"optim": {"lr": 5e-5}, "moe": None}) == "trainer"  # a key gone is a change
    plan = {"config": "r.yaml", "overrides": [], "budget": {"steps": 30}, "recipe": old, "seeds": [6],
            "variants": ["grpo"]}
    merged = merge_plan(plan, {**plan, "recipe": {**old, "new": {"key": 1}}, "seeds": [7], "variants": ["dra"]})
    assert merged["seeds"] == [6, 7] and merged["variants"] == ["grpo", "dra"] and merged["recipe"] == old
    with pytest.raises(ValueError, match="differs from the existing ablation's plan.json at optim.lr$"):
        merge_plan(plan, {**plan, "recipe": {**old, "optim": {"lr": 1e-4}}}, "plan.json")
