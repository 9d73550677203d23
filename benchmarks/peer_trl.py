"""The peer side of ``benchmarks/bench_peer.py``: TRL's GRPOTrainer (transformers ``generate``, no vLLM) on the spec
the benchmark writes (the same exported model, prompts in the same order, the same math reward, group size,
optimizer, sampling and step count as ``dynamo train --algo grpo``; the spec's ``min_response_tokens``, ours'
``rollout.min_response_tokens``, is transformers' ``min_new_tokens``: no EOS before that many tokens).

    python benchmarks/peer_trl.py SPEC.json

Writes one JSON line per optimizer step to ``spec["step_log"]`` (flushed at the step's end): the step's seconds
(``on_step_begin`` to ``on_step_end``: generation, scoring, the update and the optimizer step; TRL's logging after
it is not in it), its parts (``time/<part>``, and this process's CPU seconds, ``cpu/<part>``, ``cpu/step``), the mean reward and response length, and whether the generation batch held exactly
the step's prompts; the first step's line also the start-up's phases, in wall seconds, as ours logs them
(``startup/<phase>``): ``launch`` (the process's start to this script's first line), ``imports``, ``model`` (the
tokenizer and the model loaded), ``reward_workers`` (the scorer built; its workers start in the background),
``trainer`` (GRPOTrainer built), ``train_setup`` (``train()`` up to the first step), ``total``. The parts, timed by
wrapping TRL's own methods:

    generation    ``_generate`` (tokenising the prompts, ``model.generate``, decoding)
    reward        ``_calculate_rewards`` (our math reward: megatron_dynamo.reward's MathRewardScorer)
    old_logprob   ``_get_per_token_logps_and_entropies`` inside ``_generate_and_score_completions`` (TRL skips it
                  with one generation per optimizer step, as here)
    score_other   the rest of ``_generate_and_score_completions`` (padding, masks, advantages, metrics)
    update        the step minus ``_generate_and_score_completions``: forward/backward of every micro-batch, the
                  gradient clip and the optimizer step
"""

from __future__ import annotations

import contextlib
import json
import sys
import time


def main(spec_path: str) -> int:
    import psutil

    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    started = psutil.Process().create_time()
    startup = {"launch": time.time() - started}  # the start-up's phases (as ours: metrics' startup/)
    mark = time.perf_counter()

    def phase_done(name):
        nonlocal mark
        startup[name] = time.perf_counter() - mark
        mark = time.perf_counter()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_dynamo.reward.math_reward import MathRewardScorer, reward_workers_per_scorer

    phase_done("imports")
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    phase_done("model")
    eos = {tokenizer.eos_token_id}
    max_tokens = spec["max_response_tokens"]
    scorer = MathRewardScorer(num_workers=reward_workers_per_scorer(1))
    phase_done("reward_workers")
    rows = [{"prompt": p["prompt"], "answers": p["answers"], "step": p["step"]} for p in spec["prompts"]]
    clock: dict[str, float] = {}
    state = {"in_scoring": False, "prompts_match": True, "rewards": [], "lengths": []}

    @contextlib.contextmanager
    def timed(part):
        start, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            clock[part] = clock.get(part, 0.0) + time.perf_counter() - start
            clock[f"cpu:{part}"] = clock.get(f"cpu:{part}", 0.0) + time.process_time() - cpu

    def math_reward(prompts, completions, completion_ids, answers, step, trainer_state, **_):
        # The step's own prompts only (TRL reads the dataset in order here: shuffle_dataset=False).
        state["prompts_match"] &= set(step) == {trainer_state.global_step + 1}
        truncated = [len(ids) >= max_tokens and ids[-1] not in eos for ids in completion_ids]
        rewards = [float(r) for r in scorer.score(completions, answers, truncated=truncated).rewards]
        state["rewards"] += rewards
        state["lengths"] += [len(ids) for ids in completion_ids]
        return rewards

    class TimedGRPO(GRPOTrainer):
        def _generate(self, prompts):
            with timed("generation"):
                return super()._generate(prompts)

        def _calculate_rewards(self, *args, **kwargs):
            with timed("reward"):
                return super()._calculate_rewards(*args, **kwargs)

        def _generate_and_score_completions(self, inputs):
            state["in_scoring"] = True
            try:
                with timed("generate_and_score"):
                    return super()._generate_and_score_completions(inputs)
            finally:
                state["in_scoring"] = False

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            with timed("old_logprob") if state["in_scoring"] else contextlib.nullcontext():
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    log = open(spec["step_log"], "w", encoding="utf-8")

    class StepLog(TrainerCallback):
        def on_step_begin(self, args, trainer_state, control, **kwargs):
            clock.clear()
            state.update(rewards=[], lengths=[])
            self.start, self.cpu = time.perf_counter(), time.process_time()
            if trainer_state.global_step == 0:
                self.first_step_wall = time.time()
                phase_done("train_setup")

        def on_step_end(self, args, trainer_state, control, **kwargs):
            seconds = time.perf_counter() - self.start
            record = {"step": trainer_state.global_step, "step_seconds": seconds,
                      "cpu/step": time.process_time() - self.cpu}
            for prefix, total in (("", seconds), ("cpu:", record["cpu/step"])):
                parts = {k: clock.get(prefix + k, 0.0) for k in ("generation", "reward", "old_logprob")}
                scoring = clock.get(prefix + "generate_and_score", 0.0)
                parts["score_other"] = scoring - sum(parts.values())
                parts["update"] = total - scoring
                record.update({f"{'cpu' if prefix else 'time'}/{k}": v for k, v in parts.items()})
            record.update({"reward_mean": sum(state["rewards"]) / max(1, len(state["rewards"])),
                           "response_length_mean": sum(state["lengths"]) / max(1, len(state["lengths"])),
                           "rollouts": len(state["rewards"]), "prompts_match": state["prompts_match"]})
            if trainer_state.global_step == 1:
                record["startup_seconds"] = self.first_step_wall - started
                record.update({f"startup/{name}": seconds for name, seconds in startup.items()})
                record["startup/total"] = record["startup_seconds"]
            log.write(json.dumps(record) + "\n")
            log.flush()

    optim = spec["optim"]
    config = GRPOConfig(
        output_dir=spec["output_dir"], max_steps=spec["steps"], seed=spec["seed"], use_cpu=True, bf16=False,
        per_device_train_batch_size=spec["micro_batch_size"], gradient_accumulation_steps=spec["micro_batches"],
        num_generations=spec["group_size"], max_completion_length=max_tokens, temperature=spec["temperature"],
        top_p=spec["top_p"], top_k=0, learning_rate=optim["lr"], adam_beta1=optim["adam_beta1"],
        adam_beta2=optim["adam_beta2"], adam_epsilon=optim["adam_eps"], weight_decay=optim["weight_decay"],
        max_grad_norm=optim["clip_grad"], lr_scheduler_type="constant", warmup_steps=0, beta=0.0, epsilon=0.2,
        epsilon_high=spec["clip_high"], loss_type="dapo", scale_rewards="group", shuffle_dataset=False,
        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        gradient_checkpointing=spec["gradient_checkpointing"],  # as ours: trainer.recompute full, or off
        # rollout.min_response_tokens' twin: no EOS before that many tokens (transformers' MinNewTokensLength)
        generation_kwargs={"min_new_tokens": spec["min_response_tokens"]} if spec.get("min_response_tokens") else None)
    trainer = TimedGRPO(model=model, reward_funcs=[math_reward], args=config, train_dataset=Dataset.from_list(rows),
                        processing_class=tokenizer, callbacks=[StepLog()])
    phase_done("trainer")
    try:
        trainer.train()
    finally:
        log.close()
        scorer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
