"""Data stage: JSONL loading and validation, name resolution, the resumable sampler, prompt templates, the
synthetic task and the offline character tokenizer."""

from __future__ import annotations

import json
import logging
import os
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megatron_dynamo.data import (
    DATA_DIR_ENV,
    DATASETS,
    SYNTHETIC_LEVELS,
    DatasetNotAvailableError,
    MathExample,
    PromptSampler,
    PromptTemplate,
    get_template,
    load_math_jsonl,
    make_synthetic_task,
    register_template,
    render,
    sft_pairs,
)

MATH_DATA = Path(__file__).parent / "fixtures" / "math"  # the first rows of every benchmark file (its README)


@pytest.fixture(autouse=True)
def _no_data_dir_from_the_environment(monkeypatch):
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)


# --- loading the real files -----------------------------------------------------------------------------------

@pytest.mark.parametrize("filename", sorted(p.name for p in MATH_DATA.glob("*.jsonl")))
def test_every_benchmark_file_loads(filename):
    path = MATH_DATA / filename
    dataset = load_math_jsonl(path)
    num_lines = sum(1 for line in path.open("rb") if line.strip())
    assert len(dataset) + dataset.num_skipped == num_lines
    ids = [e.id for e in dataset]
    assert len(set(ids)) == len(ids)
    assert all(e.id.startswith(f"{path.stem}:") for e in dataset)
    assert all(e.problem.strip() and e.answer.strip() for e in dataset)
    # stable: the same file gives the same ids in the same order
    assert [e.id for e in load_math_jsonl(path)] == ids
    if filename == "math_train.jsonl":  # its last two rows (887 and 1010 of MATH train) have "answer": null
        assert [(s.line, s.reason) for s in dataset.skipped] == [(7, "missing 'answer'"), (8, "missing 'answer'")]
    else:
        assert dataset.num_skipped == 0


def test_registered_names_resolve_in_a_data_dir(monkeypatch):
    for name, spec in DATASETS.items():
        assert (MATH_DATA / spec.filename).is_file(), name
    minerva = load_math_jsonl("minerva", data_dir=MATH_DATA)
    assert len(minerva) == 8 and minerva[0].answer_candidates
    first = minerva[0]
    assert first.references()[0] == first.answer
    assert "type" in first.extras and first.data_source == "minerva_math"
    monkeypatch.setenv(DATA_DIR_ENV, str(MATH_DATA))
    assert len(load_math_jsonl("aime24")) == 8
    assert len(load_math_jsonl("BytedTsinghua-SIA/DAPO-Math-17k")) == 8  # the hub id names it too
    assert load_math_jsonl("olympiadbench")[0].extras["answer_type"] == "Numerical"


def test_missing_dataset_error_names_the_hub_id_and_how_to_provide_it(tmp_path):
    with pytest.raises(DatasetNotAvailableError) as info:
        load_math_jsonl("dapo_math_17k")
    message = str(info.value)
    assert "BytedTsinghua-SIA/DAPO-Math-17k" in message and DATA_DIR_ENV in message
    assert "dapo_math_17k.jsonl" in message and "not available locally" in message
    with pytest.raises(DatasetNotAvailableError, match=re.escape(str(tmp_path))):
        load_math_jsonl("aime25", data_dir=tmp_path)
    with pytest.raises(DatasetNotAvailableError, match="unknown dataset 'no_such_set'"):
        load_math_jsonl("no_such_set")
    with pytest.raises(DatasetNotAvailableError, match="file not found"):
        load_math_jsonl(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="gsm8k_train, gsm8k_test"):
        load_math_jsonl("openai/gsm8k")


# --- malformed rows -------------------------------------------------------------------------------------------

def _write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_malformed_rows_are_reported_with_file_and_line(tmp_path, caplog):
    good = {"id": 1, "problem": "1+1?", "answer": "2"}
    lines = [
        json.dumps(good).encode(),                                                    # 1 ok
        b'{"id": 2, "problem": "2+2?", "answer": "4"',                                # 2 bad JSON
        json.dumps({"id": 3, "answer": "4"}).encode(),                                # 3 no problem
        json.dumps({"id": 4, "problem": "x?", "answer": "  "}).encode(),              # 4 empty answer
        json.dumps({"id": 5, "problem": "x?", "answer": ["1"]}).encode(),             # 5 answer is a list
        json.dumps({"id": 6.5, "problem": "x?", "answer": "1"}).encode(),             # 6 float id
        json.dumps([1, 2]).encode(),                                                  # 7 not an object
        b'{"id": 8, "problem": "\xff\xfe", "answer": "1"}',                          # 8 invalid UTF-8
        b"",                                                                          # 9 blank: not a row
        json.dumps({"id": 10, "problem": "x?", "answer": "1", "answer_candidates": "1"}).encode(),  # 10
        json.dumps({"id": 11, "problem": "3*3?", "answer": 9, "level": 2}).encode(),  # 11 ok, numeric answer
        json.dumps({"problem": "no id", "answer": "0"}).encode(),                     # 12 ok, id from the line
        json.dumps({"id": 13, "problem": "", "answer": "1"}).encode(),                # 13 empty problem
    ]
    path = _write_lines(tmp_path / "rows.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="megatron_dynamo.data.dataset"):
        dataset = load_math_jsonl(path)
    assert [e.id for e in dataset] == ["rows:1", "rows:11", "rows:line12"]
    assert dataset[1].answer == "9" and dataset[1].extras == {"level": 2}
    assert [s.line for s in dataset.skipped] == [2, 3, 4, 5, 6, 7, 8, 10, 13]
    reasons = {s.line: s.reason for s in dataset.skipped}
    assert "invalid JSON" in reasons[2] and reasons[3] == "missing 'problem'" and reasons[4] == "empty 'answer'"
    assert "list" in reasons[5] and "float" in reasons[6] and "JSON object" in reasons[7]
    assert "UTF-8" in reasons[8] and "answer_candidates" in reasons[10] and reasons[13] == "empty 'problem'"
    logged = caplog.text
    for line in (2, 3, 4, 5, 6, 7, 8, 10, 13):
        assert f"{path}:{line}:" in logged


def test_duplicate_ids_are_an_error_or_made_unique(tmp_path):
    rows = [{"id": "a", "problem": "p1", "answer": "1"}, {"id": "b", "problem": "p2", "answer": "2"},
            {"id": "a", "problem": "p3", "answer": "3"}]
    path = _write_lines(tmp_path / "dups.jsonl", [json.dumps(r).encode() for r in rows])
    with pytest.raises(ValueError, match=r"dups.jsonl:3: duplicate id 'dups:a' \(first on line 1\)"):
        load_math_jsonl(path)
    dataset = load_math_jsonl(path, on_duplicate_id="suffix", source_name="mine")
    assert [e.id for e in dataset] == ["mine:a", "mine:b", "mine:a#line3"]


def test_a_file_without_valid_rows_is_an_error(tmp_path):
    path = _write_lines(tmp_path / "bad.jsonl", [b"not json", b"{}"])
    with pytest.raises(ValueError, match="no valid rows"):
        load_math_jsonl(path)


# --- sampler --------------------------------------------------------------------------------------------------

def _examples(n: int) -> list[MathExample]:
    return [MathExample(id=f"t:{i}", problem=f"{i}+0", answer=str(i)) for i in range(n)]


def _ids(batch: list[MathExample]) -> list[str]:
    return [e.id for e in batch]


def test_sampler_is_deterministic_and_reshuffles_each_epoch():
    examples = _examples(10)
    a, b = PromptSampler(examples, seed=7), PromptSampler(examples, seed=7)
    seq_a = [_ids(a.next_batch(4)) for _ in range(10)]
    seq_b = [_ids(b.next_batch(4)) for _ in range(10)]
    assert seq_a == seq_b
    flat = [i for batch in seq_a for i in batch]  # 40 draws = 4 epochs of 10
    epochs = [flat[k * 10:(k + 1) * 10] for k in range(4)]
    assert all(sorted(e) == sorted(_ids(examples)) for e in epochs)  # each epoch is a permutation
    assert len({tuple(e) for e in epochs}) == 4                        # reshuffled every epoch
    assert a.epoch == 4 and a.position == 0
    other = PromptSampler(examples, seed=8)
    assert [_ids(other.next_batch(4)) for _ in range(10)] != seq_a
    assert _ids(PromptSampler(examples, shuffle=False).next_batch(3)) == ["t:0", "t:1", "t:2"]


def test_sampler_resume_gives_the_identical_sequence():
    examples = _examples(13)
    uninterrupted = PromptSampler(examples, seed=3)
    reference = [_ids(uninterrupted.next_batch(5)) for _ in range(12)]

    first = PromptSampler(examples, seed=3)
    before = [_ids(first.next_batch(5)) for _ in range(4)]  # stops mid-epoch (20 of 26 draws)
    state = json.loads(json.dumps(first.state_dict()))      # as it would be stored in a checkpoint
    resumed = PromptSampler(examples, seed=999)              # the seed comes from the state
    resumed.load_state_dict(state)
    after = [_ids(resumed.next_batch(5)) for _ in range(8)]
    assert before + after == reference


def test_sampler_refuses_state_of_other_data():
    sampler = PromptSampler(_examples(5), seed=0)
    sampler.next_batch(2)
    with pytest.raises(ValueError, match="other data"):
        PromptSampler(_examples(6), seed=0).load_state_dict(sampler.state_dict())
    with pytest.raises(ValueError):
        PromptSampler([], seed=0)


@st.composite
def _sampler_runs(draw):
    """(data size N, batch size n <= N, seed, shuffle, number of batches): many batches, so that batches cross
    epoch boundaries at many offsets (n need not divide N)."""
    size = draw(st.integers(1, 40))
    batch = draw(st.integers(1, size))
    seed = draw(st.integers(0, 2**32 - 1))
    shuffle = draw(st.booleans())
    steps = draw(st.integers(1, 4 * size // batch + 6))
    return size, batch, seed, shuffle, steps


def _stream(sampler: PromptSampler, batch: int, steps: int) -> list[list[str]]:
    return [_ids(sampler.next_batch(batch)) for _ in range(steps)]


@settings(max_examples=300, deadline=None)
@given(_sampler_runs())
@example((10, 4, 0, True, 12)).via("n does not divide N")
@example((10, 5, 0, True, 8)).via("n divides N")
@example((7, 7, 1, True, 5)).via("n == N")
@example((17, 16, 3, True, 20)).via("a batch one short of the data")
@example((9, 4, 0, False, 10)).via("no shuffling")
def test_sampler_batches_are_distinct_and_every_epoch_is_a_permutation(run):
    size, batch, seed, shuffle, steps = run
    examples = _examples(size)
    sampler = PromptSampler(examples, seed=seed, shuffle=shuffle)
    batches = _stream(sampler, batch, steps)
    for ids in batches:
        assert len(ids) == batch and len(set(ids)) == batch  # no prompt twice in one batch
    flat = [i for ids in batches for i in ids]
    everything = sorted(_ids(examples))
    for start in range(0, len(flat) - size + 1, size):      # every full epoch-sized chunk is a permutation
        assert sorted(flat[start:start + size]) == everything
    tail = flat[len(flat) - len(flat) % size:]               # the unfinished epoch has no repeat either
    assert len(set(tail)) == len(tail)
    assert sampler.epoch * size + sampler.position == len(flat)
    if batch == size:
        assert all(sorted(ids) == everything for ids in batches)  # each batch is one whole epoch


@settings(max_examples=200, deadline=None)
@given(_sampler_runs(), st.data())
@example((10, 4, 0, True, 12), None).via("resume right after a straddling batch")
def test_sampler_resumes_exactly_after_any_batch(run, data):
    size, batch, seed, shuffle, steps = run
    examples = _examples(size)
    reference = _stream(PromptSampler(examples, seed=seed, shuffle=shuffle), batch, steps)
    stop = 3 if data is None else data.draw(st.integers(0, steps), label="batches before the checkpoint")

    first = PromptSampler(examples, seed=seed, shuffle=shuffle)
    before = _stream(first, batch, stop)
    state = first.state_dict()
    as_stored = json.loads(json.dumps(state))                 # checkpoints keep the state in JSON
    assert as_stored == state
    for saved in (state, as_stored):
        resumed = PromptSampler(examples, seed=seed + 1, shuffle=not shuffle)  # seed and shuffle come from the state
        resumed.load_state_dict(saved)
        assert resumed.state_dict() == state
        assert before + _stream(resumed, batch, steps - stop) == reference


@settings(max_examples=100, deadline=None)
@given(_sampler_runs(), st.integers(1, 50))
def test_a_batch_larger_than_the_data_is_refused_and_changes_nothing(run, excess):
    size, batch, seed, shuffle, steps = run
    sampler = PromptSampler(_examples(size), seed=seed, shuffle=shuffle)
    twin = PromptSampler(_examples(size), seed=seed, shuffle=shuffle)
    _stream(sampler, batch, steps)
    _stream(twin, batch, steps)
    state = sampler.state_dict()
    message = f"a batch of {size + excess} prompts needs at least {size + excess} distinct prompts; the data has {size}"
    with pytest.raises(ValueError, match=re.escape(message)):
        sampler.next_batch(size + excess)
    assert sampler.state_dict() == state
    assert _stream(sampler, batch, 3) == _stream(twin, batch, 3)


def test_sampler_state_without_an_epoch_front_loads_as_before():
    examples = _examples(13)
    sampler = PromptSampler(examples, seed=5)
    _stream(sampler, 4, 2)                                    # mid-epoch 0, no boundary crossed yet
    state = sampler.state_dict()
    assert state["epoch_front"] == []
    old_style = {k: v for k, v in state.items() if k != "epoch_front"}  # as saved before the front existed
    resumed = PromptSampler(examples, seed=0)
    resumed.load_state_dict(old_style)
    assert _stream(resumed, 4, 10) == _stream(sampler, 4, 10)
    assert _stream(PromptSampler(examples, seed=5), 13, 1)[0] == [f"t:{i}" for i in
                                                                   np.random.default_rng((5, 0)).permutation(13)]
    bad = dict(state, epoch_front=[1, 1])
    with pytest.raises(ValueError, match="epoch_front"):
        PromptSampler(examples).load_state_dict(bad)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_sampler_has_no_duplicate_prompt_at_the_measured_scale(seed):
    """Regression: 17,917 prompts (DAPO-Math-17k's size) at 512 per step repeated a prompt inside the batch
    that crossed an epoch boundary (step 105 or 210, depending on the seed), crashing the rollout."""
    size, batch = 17_917, 512
    examples = [MathExample(id=str(i), problem="p", answer="a") for i in range(size)]
    sampler = PromptSampler(examples, seed=seed)
    seen_this_epoch: set[str] = set()
    for step in range(250):
        ids = _ids(sampler.next_batch(batch))
        assert len(set(ids)) == batch, f"seed {seed}: a prompt twice in the batch of step {step}"
        for i in ids:
            assert i not in seen_this_epoch, f"seed {seed}: {i} twice in one epoch (step {step})"
            seen_this_epoch.add(i)
            if len(seen_this_epoch) == size:
                seen_this_epoch = set()
    assert sampler.epoch == 250 * batch // size


# --- templates ------------------------------------------------------------------------------------------------

def test_qwen_math_template_renders_the_chat_markup():
    problem = "Find $x$ if $\\frac{x}{2} = {3}$."
    assert render("qwen_math_boxed", problem) == (
        "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
        f"<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n")
    assert get_template("qwen_math_boxed").messages(problem)[1] == {"role": "user", "content": problem}


def test_plain_and_synthetic_templates():
    assert render("plain", "What is {1}?") == "Question: What is {1}?\nAnswer: Let's think step by step."
    assert render("plain_boxed", "2+2?").endswith("within \\boxed{}.")
    assert render("synthetic", "23+45") == "23+45="
    with pytest.raises(KeyError, match="unknown prompt template"):
        get_template("nope")


def test_register_template_and_tokenizer_chat_template():
    template = register_template(PromptTemplate(name="test_custom", user="Q: {problem}\nA:"), overwrite=True)
    assert render("test_custom", "1+1") == "Q: 1+1\nA:"
    with pytest.raises(ValueError, match="already registered"):
        register_template(template)
    with pytest.raises(ValueError, match="placeholder|{problem}"):
        PromptTemplate(name="broken", user="no placeholder")

    class FakeChatTokenizer:
        chat_template = "something"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt
            return "|".join(f"{m['role']}:{m['content']}" for m in messages)

    rendered = render("qwen_math_boxed", "1+1", tokenizer=FakeChatTokenizer())
    assert rendered.startswith("system:Please reason") and rendered.endswith("user:1+1")


# --- synthetic task -------------------------------------------------------------------------------------------

def _evaluate(problem: str) -> int:
    assert set(problem) <= set("0123456789+-*()")
    return int(eval(problem, {"__builtins__": {}}, {}))  # noqa: S307 -- digits and operators only


def test_synthetic_task_is_seeded_distinct_short_and_correct():
    task = make_synthetic_task(600, seed=11)
    assert _ids(task) == _ids(make_synthetic_task(600, seed=11))
    assert _ids(task) != _ids(make_synthetic_task(600, seed=12))
    assert len({e.problem for e in task}) == len({e.id for e in task}) == 600
    assert max(len(e.problem) for e in task) <= 12
    for example in task:
        assert int(example.answer) == _evaluate(example.problem) >= 0
    assert set("".join(e.problem + e.answer for e in task)) <= set("0123456789+-*()")


def test_synthetic_difficulty_spread():
    task = make_synthetic_task(600, seed=0)
    levels = Counter(e.extras["level_name"] for e in task)
    assert set(levels) == set(SYNTHETIC_LEVELS)
    assert levels["add1"] == 100 and levels["mul1"] == 64  # small levels are exhausted, the rest share the surplus
    assert sum(levels.values()) == 600
    answer_lengths = Counter(len(e.answer) for e in task)
    assert {1, 2, 3} <= set(answer_lengths)
    carries = sum(1 for e in task if e.extras["level_name"] == "add2"
                  and int(e.problem[1]) + int(e.problem[4]) >= 10)
    assert 0 < carries < levels["add2"]
    only = make_synthetic_task(50, seed=0, levels={"add1": 1.0, "mul2": 3.0})
    assert Counter(e.extras["level_name"] for e in only) == {"add1": 13, "mul2": 37}
    with pytest.raises(ValueError, match="unknown synthetic levels"):
        make_synthetic_task(10, levels=["add9"])
    with pytest.raises(ValueError, match="distinct problems"):
        make_synthetic_task(200, levels=["add1"])


def test_synthetic_answers_verified_by_math_verify():
    from math_verify import parse, verify

    task = make_synthetic_task(300, seed=5)
    for example in task:
        gold = parse(f"\\boxed{{{example.answer}}}")
        assert verify(gold, parse(f"\\boxed{{{_evaluate(example.problem)}}}")), example
        assert not verify(gold, parse(f"\\boxed{{{int(example.answer) + 1}}}")), example


def test_sft_pairs():
    task = make_synthetic_task(5, seed=0)
    pairs = sft_pairs(task)
    assert pairs[0] == (task[0].problem + "=", f"\\boxed{{{task[0].answer}}}")
    assert sft_pairs(task, answer_format="plain")[0][1] == task[0].answer


# --- tokenizer ------------------------------------------------------------------------------------------------

def test_char_tokenizer_round_trip_and_save_load(tmp_path):
    from transformers import AutoTokenizer

    from megatron_dynamo.data import build_char_tokenizer

    tokenizer = build_char_tokenizer(out_dir=tmp_path / "tok")
    assert len(tokenizer) == 100 < 128
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>" and tokenizer.eos_token_id == 0
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]

    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    texts = [e.problem + "=" + e.answer for e in make_synthetic_task(200, seed=1)]
    texts += ["\\boxed{42}", "a  b\n c", " x . , ' s", "Let's think: (3+4)*5 = 35."]
    texts += [render("qwen_math_boxed", "What is $1+2$?") + "\\boxed{3}<|im_end|>"]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
        assert loaded.encode(text, add_special_tokens=False) == ids
        assert loaded.decode(ids) == text
    ids = tokenizer.encode("<|im_start|>user\n7*8<|im_end|>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 2 + len("user\n7*8")
    assert len(tokenizer.encode("23+45=", add_special_tokens=False)) == 6  # one token per character
    assert tokenizer.encode("é", add_special_tokens=False) == [tokenizer.unk_token_id]
    eos_ids = tokenizer.encode("68<|endoftext|>", add_special_tokens=False)
    assert loaded.decode(eos_ids, skip_special_tokens=True) == "68"


# --- one's own file in a common shape ---------------------------------------------------------------------------

def test_gsm8k_and_math_shaped_rows_are_read_as_such(tmp_path):
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "How many?", "answer": "3 * 400 = 1,200\n#### 1,200"}) + "\n"
                   + json.dumps({"question": "And now?", "answer": "5 - 2 = 3\n#### 3"}) + "\n")
    first, second = load_math_jsonl(gsm)
    assert (first.problem, first.answer, second.answer) == ("How many?", "1200", "3")
    assert first.extras["solution"] == "3 * 400 = 1,200\n#### 1,200"
    maths = tmp_path / "math.jsonl"
    maths.write_text(json.dumps({"problem": "Simplify.", "solution": "So $\\boxed{\\frac{1}{2}}$, not \\boxed{3}."})
                     + "\n" + json.dumps({"problem": "Given.", "solution": "x", "answer": "7"}) + "\n")
    boxed, given = load_math_jsonl(maths)
    assert (boxed.answer, given.answer) == ("3", "7")  # the last box; an explicit answer wins


def test_a_file_of_no_known_shape_fails_in_one_line(tmp_path, caplog):
    bad = tmp_path / "mine.jsonl"
    bad.write_text("".join(json.dumps({"q": f"{i}+1", "a": str(i + 1)}) + "\n" for i in range(30)))
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError) as info:
        load_math_jsonl(bad)
    message = str(info.value)
    assert "\n" not in message and "every row: missing 'problem'" in message and "docs/own-data.md" in message
    assert not caplog.records  # no line per row
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"problem": "p", "answer": "1"}) + "\n" + json.dumps({"q": "x"}) + "\n")
    with caplog.at_level(logging.WARNING):
        assert len(load_math_jsonl(mixed)) == 1
    assert [r.getMessage() for r in caplog.records] == [f"{mixed}:2: skipped malformed row: missing 'problem'"]
