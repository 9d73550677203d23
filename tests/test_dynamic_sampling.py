"""DAPO's dynamic sampling (``dynamo.sampling.dynamic``, issue 32): which groups are kept, exact counts of rounds,
rollouts and dropped groups, the bound on refills, the step's metrics merged over rounds, the config checks, and a
real training run (vLLM, math-verify, Megatron on CPU) with DRA's allocation and with GRPO."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hf_reference import REPO
from megatron_dynamo.algorithms.dynamic_sampling import RoundOutcome, fill_step, mixed_groups
from megatron_dynamo.config import ConfigError
from megatron_dynamo.trainer.config import load_run_config
from megatron_dynamo.trainer.step_sampling import merge_round_metrics

CPU_DEFAULT = os.path.join(REPO, "configs", "cpu_default.yaml")


def test_mixed_groups_are_those_whose_rewards_differ():
    ids = ["a", "b", "a", "c", "b", "c", "d"]
    rewards = [1, 0, 0, 1, 0, 1, 1]
    assert mixed_groups(ids, rewards) == ["a"]  # b all wrong, c all right, d a singleton
    assert mixed_groups(["x", "y", "x", "y"], [0.0, 1.0, 1.0, 1.0]) == ["x"]
    with pytest.raises(ValueError):
        mixed_groups(["a"], [1, 0])


def _rounds(script):
    """A ``run_round`` whose round r returns the prompts and mixed ones of ``script[r]`` (8 rollouts a prompt), and
    the list of (round, size) calls."""
    calls = []

    def run_round(index, size):
        calls.append((index, size))
        prompts, mixed = script[index]
        assert len(prompts) == size
        return RoundOutcome(prompts, mixed, 8 * len(prompts))

    return run_round, calls


def test_fill_step_keeps_mixed_groups_in_order_until_the_target():
    script = [(["a", "b", "c", "d"], ["b", "d"]), (["e", "f", "g", "h"], ["e", "g", "h"])]
    run_round, calls = _rounds(script)
    filled = fill_step(target=4, round_prompts=4, max_refills=3, run_round=run_round)
    assert calls == [(0, 4), (1, 4)]  # stopped as soon as 4 were kept
    assert filled.kept == [(0, "b"), (0, "d"), (1, "e"), (1, "g")]
    assert (filled.rounds, filled.refills, filled.rollouts, filled.groups) == (2, 1, 64, 8)
    assert (filled.zero_variance, filled.surplus, filled.short) == (3, 1, 0)  # "h" is the surplus
    assert filled.metrics() == {"sampling/rounds": 2, "sampling/refills": 1, "sampling/groups_generated": 8,
                                "sampling/groups_zero_variance": 3, "sampling/groups_surplus": 1,
                                "sampling/groups_kept": 4, "sampling/prompts_short": 0,
                                "sampling/rollouts_generated": 64}


def test_fill_step_stops_at_the_refill_bound_and_trains_on_what_it_has():
    script = [(["a", "b"], []), (["c", "d"], ["d"]), (["e", "f"], ["e"]), (["g", "h"], ["g", "h"])]
    run_round, calls = _rounds(script)
    filled = fill_step(target=3, round_prompts=2, max_refills=2, run_round=run_round)
    assert calls == [(0, 2), (1, 2), (2, 2)]  # 1 + max_refills rounds, never the fourth
    assert filled.kept == [(1, "d"), (2, "e")] and filled.short == 1 and filled.refills == 2
    assert filled.rollouts == 48 and filled.zero_variance == 4 and filled.surplus == 0
    run_round, calls = _rounds(script)
    none = fill_step(target=2, round_prompts=2, max_refills=0, run_round=run_round)
    assert calls == [(0, 2)] and none.kept == [] and none.short == 2 and none.refills == 0


def test_a_prompt_drawn_again_in_the_same_step_is_kept_once():
    script = [(["a", "b"], ["a"]), (["a", "c"], ["a", "c"])]  # the sampler wrapped its epoch: "a" again
    run_round, _ = _rounds(script)
    filled = fill_step(target=2, round_prompts=2, max_refills=1, run_round=run_round)
    assert filled.kept == [(0, "a"), (1, "c")] and filled.surplus == 1


def test_without_dynamic_sampling_one_round_keeps_every_group():
    script = [(["a", "b", "c"], ["a", "b", "c"])]
    run_round, calls = _rounds(script)
    filled = fill_step(target=3, round_prompts=3, max_refills=0, run_round=run_round)
    assert calls == [(0, 3)] and [pid for _, pid in filled.kept] == ["a", "b", "c"]


def test_round_metrics_merge_counts_means_and_maxima():
    first = {"reward/correct": 3.0, "reward/wrong": 5.0, "reward/accuracy": 3 / 8, "reward/seconds": 1.0,
             "response_length_mean": 10.0, "rollout/truncated_frac": 0.0, "rollout/response_length_max": 20.0,
             "rollout/engines": 1, "rollout/engine_tokens_max_over_mean": 1.0}
    second = {"reward/correct": 1.0, "reward/wrong": 3.0, "reward/accuracy": 0.25, "reward/seconds": 0.5,
              "response_length_mean": 16.0, "rollout/truncated_frac": 0.5, "rollout/response_length_max": 30.0,
              "rollout/engines": 1, "rollout/engine_tokens_max_over_mean": 1.2}
    merged = merge_round_metrics([(8, first), (4, second)])
    assert merged["reward/correct"] == 4.0 and merged["reward/wrong"] == 8.0 and merged["reward/seconds"] == 1.5
    assert merged["reward/accuracy"] == pytest.approx(4 / 12)
    assert merged["response_length_mean"] == pytest.approx((80 + 64) / 12)
    assert merged["rollout/truncated_frac"] == pytest.approx(2 / 12)
    assert merged["rollout/response_length_max"] == 30.0 and merged["rollout/engines"] == 1
    assert merged["rollout/engine_tokens_max_over_mean"] == 1.2
    assert merge_round_metrics([(8, first)]) == first


def test_sampling_config_is_checked_before_compute():
    run = load_run_config(CPU_DEFAULT, ["dynamo.sampling.dynamic=true", "dynamo.sampling.oversample=1.5"])
    assert run.dynamo.sampling.round_prompts(run.data.prompts_per_step) == -(-run.data.prompts_per_step * 3 // 2)
    assert load_run_config(CPU_DEFAULT).dynamo.sampling.round_prompts(16) == 16  # off: the step's prompts
    for override, message in (("dynamo.sampling.oversample=0.5", "dynamo.sampling.oversample: must be a number >= 1"),
                              ("dynamo.sampling.max_refills=-1", "dynamo.sampling.max_refills: must be an integer >= 0"),
                              ("dynamo.sampling.dynamc=true", r"did you mean dynamo\.sampling\.dynamic\?")):
        with pytest.raises(ConfigError, match=message):
            load_run_config(CPU_DEFAULT, [override])


def test_a_round_larger_than_the_data_is_refused_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_dynamo.cli", "train", CPU_DEFAULT,
                           f"trainer.output_dir={tmp_path / 'run'}", "dynamo.sampling.dynamic=true",
                           "dynamo.sampling.oversample=100"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2 and "dynamo.sampling.oversample: must keep a round" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def _train(out, *overrides, algo="dynamo"):
    proc = subprocess.run([sys.executable, "-m", "megatron_dynamo.cli", "train", CPU_DEFAULT, f"trainer.output_dir={out}",
                           "trainer.steps=2", "logging.progress=false", "logging.plot=false",
                           "logging.tensorboard=false", "checkpoint.every=100", *overrides, "--algo", algo],
                          capture_output=True, text=True, timeout=1500, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    prompts = [json.loads(line) for line in open(out / "prompts.jsonl")]
    return metrics, prompts


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["dynamo", "grpo"])
def test_training_with_dynamic_sampling_trains_only_mixed_groups(tmp_path, algo):
    # 48 problems, 32 a round: a refill wraps the sampler's epoch, so it draws prompts with a history (DRA allocates
    # them unevenly) and prompts drawn earlier in the same step (kept once)
    metrics, prompts = _train(tmp_path, "dynamo.sampling.dynamic=true", "dynamo.sampling.max_refills=3",
                              "data.synthetic_problems=48", algo=algo)
    per_step = 32  # cpu_default's data.prompts_per_step
    for m in metrics:
        rows = [p for p in prompts if p["step"] == m["step"]]
        kept = m["sampling/groups_kept"]
        assert kept == len(rows) == per_step - m["sampling/prompts_short"]
        assert all(0 < p["correct"] < p["count"] for p in rows)  # only groups whose rewards differ are trained
        assert 1 <= m["sampling/rounds"] <= 4 and m["sampling/refills"] == m["sampling/rounds"] - 1
        assert m["sampling/groups_generated"] == per_step * m["sampling/rounds"]
        assert m["sampling/groups_generated"] == kept + m["sampling/groups_zero_variance"] + m["sampling/groups_surplus"]
        assert m["rollouts"] == m["sampling/rollouts_generated"] >= m["rollouts_trained"] == sum(p["count"]
                                                                                                for p in rows)
        assert m["rollouts_trained"] == sum(m["alloc_counts"])
        if m["sampling/rounds"] == 1:
            assert m["rollouts"] == 256  # one round: the step's budget, 32 prompts x n_avg 8
        if algo == "grpo":
            assert set(m["alloc_counts"]) == {8}
    assert any(m["sampling/refills"] > 0 for m in metrics)
    if algo == "dynamo":
        assert any(len(set(m["alloc_counts"])) > 1 for m in metrics)  # DRA allocated the refills


def _round_batch(step, example_indices, prompt_tokens, counts, rewards, variance_ratio, position):
    """One round's batch as the rollout producer makes it: responses in canonical order (prompt, then sample), an
    engine log-prob per token, the history results of every response."""
    from megatron_dynamo.rollout.exchange import ScoredResponses
    from megatron_dynamo.rollout.rollout_batch import RolloutBatch

    prompt_index = [p for p, n in enumerate(counts) for _ in range(n)]
    sample_index = [s for n in counts for s in range(n)]
    token_ids = [(100 + 10 * p + s,) * (1 + s) for p, s in zip(prompt_index, sample_index)]
    responses = ScoredResponses(prompt_index, sample_index, token_ids, [False] * len(rewards), list(rewards),
                                [tuple(-0.5 * (t % 7) for t in ids) for ids in token_ids])
    return RolloutBatch(step=step, version=step - 1, example_indices=example_indices, prompt_tokens=prompt_tokens,
                        counts=counts, variance_ratio=variance_ratio, responses=responses,
                        history_index=[example_indices[p] for p in prompt_index],
                        history_correct=[int(r > 0.5) for r in rewards],
                        sampler_state={"epoch": 0, "position": position},
                        metrics={"reward/correct": float(sum(rewards)), "data/prompts_truncated": 1})


def test_the_batch_of_a_dynamic_step_holds_the_kept_groups_and_what_every_round_cost():
    from megatron_dynamo.algorithms.allocation import PromptHistory
    from megatron_dynamo.rollout.rollout_batch import RolloutBatch
    from megatron_dynamo.trainer.step_sampling import kept_groups

    names = {3: "p3", 5: "p5", 8: "p8", 1: "p1"}
    # round 0: p3 all wrong, p5 mixed; round 1: p8 mixed, p3 again (the sampler wrapped) and now mixed
    first = _round_batch(4, [3, 5], [(1, 2), (3,)], [2, 3], [0, 0, 1, 0, 1], 0.5, 2)
    second = _round_batch(4, [8, 3], [(4, 4), (1, 2)], [2, 2], [1, 0, 0, 1], 1.0, 4)
    rounds = [first, second]
    ids = [[names[i] for i in b.example_indices] for b in rounds]

    def run_round(index, size):
        batch = rounds[index]
        response_ids = [ids[index][p] for p in batch.responses.prompt_index]
        return RoundOutcome(ids[index], mixed_groups(response_ids, batch.responses.rewards), sum(batch.counts))

    filled = fill_step(target=2, round_prompts=2, max_refills=3, run_round=run_round)
    assert filled.kept == [(0, "p5"), (1, "p8")] and filled.surplus == 1  # p3's second group: the target is met
    batch = kept_groups(rounds, filled, ids)
    assert (batch.example_indices, batch.prompt_tokens, batch.counts) == ([5, 8], [(3,), (4, 4)], [3, 2])
    assert batch.responses.prompt_index == [0, 0, 0, 1, 1]
    assert batch.responses.rewards == [1, 0, 1, 1, 0]
    assert batch.responses.token_ids == [first.responses.token_ids[j] for j in (2, 3, 4)] + \
        [second.responses.token_ids[j] for j in (0, 1)]
    assert batch.responses.logprobs == [first.responses.logprobs[j] for j in (2, 3, 4)] + \
        [second.responses.logprobs[j] for j in (0, 1)]
    # the cost and the sampled accuracy are those of every response of both rounds
    assert batch.rollouts == 9 and batch.reward_mean == pytest.approx(4 / 9) and batch.variance_ratio == 0.75
    assert batch.metrics["reward/correct"] == 4.0 and batch.metrics["data/prompts_truncated"] == 2
    assert batch.metrics["sampling/groups_kept"] == 2 and batch.metrics["sampling/rollouts_generated"] == 9
    assert batch.sampler_state == second.sampler_state and batch.history_updates == [5, 4]
    # the batch travels whole (separate engine ranks), and its history updates replay round by round: with a decay
    # a prompt seen in two rounds (p3) differs from one update of both rounds' results
    travelled = RolloutBatch.from_tensors(batch.to_tensors())
    assert (travelled.rollouts, travelled.reward_mean, travelled.history_updates) == (9, batch.reward_mean, [5, 4])
    live, mirror = PromptHistory(decay=0.5), PromptHistory(decay=0.5)
    for part in rounds:
        live.update([names[i] for i in part.history_index], part.history_correct)
    for indices, correct in travelled.history_rounds():
        mirror.update([names[i] for i in indices], correct)
    assert np.array_equal(np.stack(live.counts(list(names.values()))), np.stack(mirror.counts(list(names.values()))))
    merged = PromptHistory(decay=0.5)
    merged.update([names[i] for i in travelled.history_index], travelled.history_correct)
    assert not np.array_equal(np.stack(merged.counts(["p3"])), np.stack(live.counts(["p3"])))
