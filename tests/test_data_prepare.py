"""Bring your own data, offline: `dynamo data prepare NAME --from FILE` converts each registered hub schema to the
product's rows (exact rows and drop counts), the offline error says what to download, and verl's RL parquet
layout loads directly and trains."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_dynamo.cli import main
from megatron_dynamo.data.dataset import (DATASETS, load_math_file, load_math_jsonl, resolve_dataset_path,
                                           verl_user_text)
from megatron_dynamo.data.converters import last_boxed, strip_dapo_instruction

REPO = Path(__file__).resolve().parents[1]
DAPO_WRAP = ("Solve the following math problem step by step. The last line of your response should be of the form "
             "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\n"
             "Remember to put your answer on its own line after \"Answer:\".")


def _offline_env(tmp_path: Path) -> dict:
    """No network and an empty Hugging Face cache."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               HF_DATASETS_CACHE=str(tmp_path / "hf" / "datasets"), HF_HUB_CACHE=str(tmp_path / "hf" / "hub"))
    env.pop("MEGATRON_DYNAMO_DATA_DIR", None)
    return env


def _parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _arrow_stream(path: Path, rows: list[dict]) -> Path:
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return path


def _row(row_id, problem, answer, candidates=None, source=None, **extras):
    return {"id": row_id, "problem": problem, "answer": answer, "answer_candidates": candidates or [answer],
            "data_source": source, **extras}


# name -> (writer, file name, hub rows, expected output rows, expected drop counts)
CASES = {
    "dapo_math_17k": (_parquet, "dapo-math-17k.parquet", [
        {"data_source": "math_dapo", "prompt": [{"content": DAPO_WRAP.format("What is $1+1$?"), "role": "user"}],
         "ability": "MATH", "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"},
         "extra_info": {"index": "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"}},
        {"data_source": "math_dapo", "prompt": [{"content": DAPO_WRAP.format("What is $1+1$?"), "role": "user"}],
         "ability": "MATH", "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"},
         "extra_info": {"index": "b0e5b5c2-0000-4000-8000-000000000001"}},
        {"data_source": "math_dapo", "prompt": [{"content": DAPO_WRAP.format("Find $x$ if $2x=6$."), "role": "user"}],
         "ability": "MATH", "reward_model": {"ground_truth": "3", "style": "rule-lighteval/MATH_v2"},
         "extra_info": {"index": "c1"}},
        {"data_source": "math_dapo", "prompt": [{"content": DAPO_WRAP.format(""), "role": "user"}],
         "ability": "MATH", "reward_model": {"ground_truth": "5", "style": "rule-lighteval/MATH_v2"},
         "extra_info": {"index": "d1"}},
        {"data_source": "math_dapo", "prompt": [{"content": "Plain $3+4$?", "role": "user"}],
         "ability": "MATH", "reward_model": {"ground_truth": "", "style": "rule-lighteval/MATH_v2"},
         "extra_info": {"index": "e1"}},
    ], [
        _row("9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079", "What is $1+1$?", "2", source="dapo_math_17k"),
        _row("c1", "Find $x$ if $2x=6$.", "3", source="dapo_math_17k"),
    ], {"duplicate problem (same text as an earlier row)": 1, "empty problem": 1, "no answer": 1}),

    "math_train": (_parquet, "train-00000-of-00001.parquet", [
        {"problem": "Compute $2+3$.", "level": "Level 1", "solution": "We get $2+3=\\boxed{5}$.", "type": "Algebra"},
        {"problem": "Half of 1?", "level": "Level 2", "solution": "It is $\\boxed{\\frac{1}{2}}$.",
         "type": "Prealgebra"},
        {"problem": "No box here.", "level": "Level 3", "solution": "The answer is 7.", "type": "Algebra"},
        {"problem": "  ", "level": "Level 1", "solution": "$\\boxed{1}$", "type": "Algebra"},
        {"problem": "Two boxes?", "level": "Level ?", "solution": "First \\boxed{1}, finally \\boxed{\\{1,2\\}}.",
         "type": "Counting & Probability"},
    ], [
        _row(0, "Compute $2+3$.", "5", source="math_train", level=1, type="Algebra"),
        _row(1, "Half of 1?", "\\frac{1}{2}", source="math_train", level=2, type="Prealgebra"),
        _row(4, "Two boxes?", "\\{1,2\\}", source="math_train", level="Level ?", type="Counting & Probability"),
    ], {"no \\boxed{} answer in 'solution'": 1, "empty problem": 1}),

    "aime24": (_jsonl, "aime_2024.jsonl", [
        {"id": 60, "problem": "Every morning Aya walks.", "solution": "... so 204.", "answer": "204",
         "url": "https://artofproblemsolving.com/wiki/index.php/2024_AIME_I_Problems/Problem_1", "year": "2024"},
        {"id": 61, "problem": "Another one.", "solution": "...", "answer": "", "url": "u", "year": "2024"},
    ], [
        _row(60, "Every morning Aya walks.", "204", source="aime24",
             url="https://artofproblemsolving.com/wiki/index.php/2024_AIME_I_Problems/Problem_1"),
    ], {"no answer": 1}),

    "aime25": (_arrow_stream, "data-00000-of-00001.arrow", [
        {"problem": "Find the sum of all integer bases $b>9$.", "answer": "70", "id": "0"},
        {"problem": "", "answer": "588", "id": "1"},
    ], [
        _row("0", "Find the sum of all integer bases $b>9$.", "70", source="aime25"),
    ], {"empty problem": 1}),

    "amc23": (_parquet, "test-00000-of-00001.parquet", [
        {"id": 0, "question": "How many miles from City $A$?", "answer": 27.0, "url": "u0"},
        {"id": 1, "question": "What is $x+y$?", "answer": 0.5, "url": "u1"},
        {"id": 2, "question": "What is $x+y$?", "answer": 36.0, "url": "u2"},
    ], [
        _row(0, "How many miles from City $A$?", "27", source="amc23", url="u0"),
        _row(1, "What is $x+y$?", "0.5", source="amc23", url="u1"),
    ], {"duplicate problem (same text as an earlier row)": 1}),

    "math500": (_jsonl, "test.jsonl", [
        {"problem": "Convert the point $(0,3)$ to polar coordinates.", "solution": "... \\boxed{(3,\\frac{\\pi}{2})}",
         "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "subject": "Precalculus", "level": 2,
         "unique_id": "test/precalculus/807.json"},
        {"problem": "No answer here.", "solution": "...", "answer": None, "subject": "Algebra", "level": 1,
         "unique_id": "test/algebra/1.json"},
    ], [
        _row("test/precalculus/807.json", "Convert the point $(0,3)$ to polar coordinates.",
             "\\left( 3, \\frac{\\pi}{2} \\right)", source="math500", subject="Precalculus", level=2),
    ], {"no answer": 1}),

    "minerva": (_parquet, "minervamath.parquet", [
        {"question": "Each of the two Magellan telescopes has a diameter of $6.5 \\mathrm{~m}$.", "answer": "1.6"},
        {"question": "A white dwarf star?", "answer": "8.7e8"},
        {"question": "", "answer": "1"},
    ], [
        _row(0, "Each of the two Magellan telescopes has a diameter of $6.5 \\mathrm{~m}$.", "1.6", source="minerva"),
        _row(1, "A white dwarf star?", "8.7e8", source="minerva"),
    ], {"empty problem": 1}),

    "olympiadbench": (_parquet, "olympiadbench.parquet", [
        {"id": 1606, "question": "How many moves?", "final_answer": ["$2$"], "context": None,
         "is_multiple_answer": False, "unit": None, "answer_type": "Numerical", "subfield": "Combinatorics"},
        {"id": 1607, "question": "Find all solutions.", "final_answer": ["$69$", "$84$"], "context": None,
         "is_multiple_answer": True, "unit": None, "answer_type": "Numerical", "subfield": "Number Theory"},
        {"id": 1608, "question": "Compute the ratio.", "final_answer": ["$\\frac{1}{2}$", "$0.5$"], "context": None,
         "is_multiple_answer": False, "unit": None, "answer_type": "Numerical", "subfield": "Algebra"},
        {"id": 1609, "question": "Proof problem.", "final_answer": [], "context": None,
         "is_multiple_answer": False, "unit": None, "answer_type": "Expression", "subfield": "Algebra"},
        {"id": 1610, "question": "Find $n+1$.", "final_answer": ["4"], "context": "Let $n=3$.",
         "is_multiple_answer": False, "unit": "km", "answer_type": "Numerical", "subfield": "Algebra"},
    ], [
        _row(1606, "How many moves?", "2", source="olympiadbench", is_multiple_answer=False,
             answer_type="Numerical", subfield="Combinatorics"),
        _row(1607, "Find all solutions.", "69, 84", source="olympiadbench", is_multiple_answer=True,
             answer_type="Numerical", subfield="Number Theory"),
        _row(1608, "Compute the ratio.", "\\frac{1}{2}", ["\\frac{1}{2}", "0.5"], source="olympiadbench",
             is_multiple_answer=False, answer_type="Numerical", subfield="Algebra"),
        _row(1610, "Let $n=3$.\nFind $n+1$.", "4", source="olympiadbench", unit="km", is_multiple_answer=False,
             answer_type="Numerical", subfield="Algebra"),
    ], {"no answer": 1}),
}


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _normalised(rows: list[dict]) -> list[dict]:
    """Compare as sets of keys: the test rows list extras in any order."""
    return [dict(sorted(r.items())) for r in rows]


@pytest.mark.parametrize("name", sorted(CASES))
def test_prepare_converts_each_hub_schema_exactly(name, tmp_path, capsys):
    writer, filename, hub_rows, expected, drops = CASES[name]
    source = writer(tmp_path / filename, hub_rows)
    out = tmp_path / "out"
    assert main(["data", "prepare", name, "--from", str(source), "--out", str(out)]) == 0
    written = out / DATASETS[name].filename
    assert _normalised(_read_jsonl(written)) == _normalised(expected)
    stdout = capsys.readouterr().out.splitlines()
    assert stdout[0] == f"read {len(hub_rows)} rows of {source} in {DATASETS[name].hub_id}'s schema"
    assert stdout[-1] == f"wrote {len(expected)} rows to {written}"
    reported = {}
    for line in stdout[1:-1]:  # "dropped N row(s): REASON (row indices ...)", one line per reason
        count, _, rest = line.removeprefix("dropped ").partition(" ")
        reported[rest.partition(": ")[2].rpartition(" (row indices")[0]] = int(count)
    assert reported == drops and len(stdout) == 2 + len(drops)
    # The trainer and `dynamo eval` find the file by name in the output directory.
    assert resolve_dataset_path(name, out) == written
    loaded = load_math_jsonl(name, data_dir=out)
    assert [e.answer for e in loaded] == [r["answer"] for r in expected] and loaded.num_skipped == 0
    assert all(e.references()[0] == e.answer for e in loaded)


def test_prepare_reads_a_save_to_disk_dataset_dict_split(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    dataset = datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"question": "Train question?", "answer": "So 1.\n#### 1"}]),
        "test": datasets.Dataset.from_list([
            {"question": "Janet has 3 apples and gets 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
            {"question": "Big number?", "answer": "Count them.\n#### 1,200"},
            {"question": "No marker?", "answer": "It is 5."},
        ]),
    })
    dataset.save_to_disk(str(tmp_path / "gsm8k"))
    out = tmp_path / "out"
    assert main(["data", "prepare", "openai/gsm8k", "--from", str(tmp_path / "gsm8k"), "--out", str(out)]) == 2
    assert "gsm8k_train, gsm8k_test" in capsys.readouterr().err  # the hub id names two datasets
    assert main(["data", "prepare", "gsm8k_test", "--from", str(tmp_path / "gsm8k"), "--out", str(out)]) == 0
    assert _read_jsonl(out / "gsm8k_test.jsonl") == [
        _row(0, "Janet has 3 apples and gets 4. How many?", "7", source="gsm8k_test"),
        _row(1, "Big number?", "1200", source="gsm8k_test"),
    ]
    assert "dropped 1 row: no '####' final answer in 'answer' (row indices 2)" in capsys.readouterr().out
    assert main(["data", "prepare", "gsm8k_train", "--from", str(tmp_path / "gsm8k"), "--out", str(out),
                 "--split", "validation"]) == 2
    assert "holds the splits train, test, not 'validation'" in capsys.readouterr().err


def test_prepare_refuses_a_foreign_schema_and_writes_nothing_without_rows(tmp_path, capsys):
    source = _parquet(tmp_path / "aime.parquet", [{"id": 1, "problem": "p", "answer": "1"}])
    out = tmp_path / "out"
    assert main(["data", "prepare", "math_train", "--from", str(source), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "not math_train's hub schema: no column 'solution'" in err and "answer, id, problem" in err
    empty = _parquet(tmp_path / "empty.parquet", [{"id": 1, "problem": "", "answer": "1"}])
    assert main(["data", "prepare", "aime24", "--from", str(empty), "--out", str(out)]) == 2
    assert "no rows left to write" in capsys.readouterr().err and not (out / "aime24.jsonl").exists()
    assert main(["data", "prepare", "no_such_set", "--out", str(out)]) == 2
    assert "known names are aime24, aime25" in capsys.readouterr().err


def test_an_unregistered_hub_id_converts_generically_and_list_shows_the_registry(tmp_path, capsys):
    source = _parquet(tmp_path / "mine.parquet", [_verl_row("Roots of $x^2=1$?", "1", index=7),
                                                   _verl_row("", "2", index=8)])
    out = tmp_path / "out"
    assert main(["data", "prepare", "someone/My-Math.Set", "--from", str(source), "--out", str(out)]) == 0
    assert _read_jsonl(out / "my_math_set.jsonl") == [_row(7, "Roots of $x^2=1$?", "1", source="my_math_set")]
    assert "dropped 1 row: empty problem (row indices 1)" in capsys.readouterr().out
    assert main(["data", "list", "--out", str(out)]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert len(listing) == len(DATASETS) and all("[missing]" in line for line in listing)
    assert any("BytedTsinghua-SIA/DAPO-Math-17k (train)" in line for line in listing)


def test_prepare_without_network_or_cache_says_what_to_download(tmp_path):
    env = _offline_env(tmp_path)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "megatron_dynamo.cli", "data", "prepare", "aime24", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = [line for line in proc.stderr.splitlines() if line.startswith("dynamo data prepare:")]
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    for part in ("HuggingFaceH4/aime_2024 (split 'train')", "hf download HuggingFaceH4/aime_2024 --repo-type dataset",
                 f"dynamo data prepare aime24 --from aime24_hub --split train --out {out}", str(tmp_path / "hf")):
        assert part in line, line
    assert not out.exists()


def test_prepare_from_a_downloaded_hub_snapshot_offline(tmp_path):
    """The `hf download --local-dir` layout (README configs + parquet shards) converts with no network."""
    snapshot = tmp_path / "gsm8k_hub"
    (snapshot / "main").mkdir(parents=True)
    (snapshot / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train-*\n"
        "  - split: test\n    path: main/test-*\n---\n")
    _parquet(snapshot / "main" / "train-00000-of-00001.parquet", [{"question": "Train?", "answer": "#### 3"}])
    _parquet(snapshot / "main" / "test-00000-of-00001.parquet",
             [{"question": "Test one?", "answer": "1+1=2\n#### 2"}, {"question": "Test two?", "answer": "#### 4"}])
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "megatron_dynamo.cli", "data", "prepare", "gsm8k_test", "--from",
                           str(snapshot), "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env=_offline_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [r["problem"] for r in _read_jsonl(out / "gsm8k_test.jsonl")] == ["Test one?", "Test two?"]


def test_answer_extraction_helpers():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{a}{b}} c") == "\\frac{a}{b}"
    assert last_boxed("so \\boxed 5$.") == "5" and last_boxed("\\fbox{x}") == "x"
    assert last_boxed("\\boxed{unclosed") is None and last_boxed("nothing") is None and last_boxed(None) is None
    assert strip_dapo_instruction(DAPO_WRAP.format("Line one.\n\nLine two.")) == "Line one.\n\nLine two."
    assert strip_dapo_instruction("No wrapper.") == "No wrapper."
    assert verl_user_text({"role": ["system", "user"], "content": ["Be brief.", "2+2?"]}) == "2+2?"


# --- verl's RL parquet layout, read directly --------------------------------------------------------------------

def _verl_row(problem, truth, index=None, system=None):
    prompt = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": problem}]
    row = {"data_source": "my_math", "prompt": prompt, "ability": "math",
           "reward_model": {"style": "rule", "ground_truth": truth}}
    row["extra_info"] = {"split": "train", "index": index}
    return row


def test_verl_parquet_loads_with_ids_answers_and_malformed_rows(tmp_path, caplog):
    rows = [
        _verl_row("What is $2+2$? Let's think step by step.", "4", index=10, system="You are a helpful assistant."),
        _verl_row("Name both roots.", "1", index=11),
        {"data_source": "my_math", "prompt": [{"role": "system", "content": "only a system turn"}], "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": "9"}, "extra_info": {"split": "train", "index": 12}},
        _verl_row("No index here.", "7", index=None),
        _verl_row("No truth.", None, index=14),
    ]
    path = _parquet(tmp_path / "train.parquet", rows)
    dataset = load_math_file(path)
    assert [e.id for e in dataset] == ["train:10", "train:11", "train:row4"]
    first = dataset[0]
    assert first.problem == "What is $2+2$? Let's think step by step." and first.answer == "4"
    assert first.data_source == "my_math" and first.extras == {"ability": "math", "extra_info": {"split": "train"}}
    assert [(s.line, s.reason) for s in dataset.skipped] == [
        (3, "'prompt' has no user message with text content"), (5, "missing 'reward_model.ground_truth'")]
    assert f"{path}:3:" in caplog.text
    # A list ground truth: the first entry is the answer, the others accepted forms; JSONL in this layout too.
    jsonl = _jsonl(tmp_path / "verl.jsonl", [_verl_row("Roots?", ["1", "-1"], index="a")])
    assert load_math_file(jsonl)[0].references() == ["1", "-1"]
    # A registered name finds <stem>.parquet in the data directory; `dynamo eval` names a parquet by its stem.
    _parquet(tmp_path / "aime24.parquet", [_verl_row("AIME?", "204", index=1)])
    assert load_math_file("aime24", data_dir=tmp_path)[0].id == "aime24:1"
    from megatron_dynamo.eval.runner import EvalConfig, load_benchmarks

    benchmarks = load_benchmarks(EvalConfig(benchmarks=(str(path),), n=1, k=(1,)))
    assert benchmarks[0].name == "train" and len(benchmarks[0].problems) == 3


@pytest.mark.slow
@pytest.mark.extended
def test_a_verl_parquet_of_synthetic_problems_trains(tmp_path):
    from megatron_dynamo.data.synthetic import make_synthetic_task

    examples = make_synthetic_task(16, seed=0)
    path = _parquet(tmp_path / "synthetic_verl.parquet",
                    [_verl_row(e.problem, e.answer, index=i) for i, e in enumerate(examples)])
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_dynamo.cli", "train", "configs/cpu_default.yaml", f"data.train={path}",
           f"trainer.output_dir={out}", "trainer.steps=2", "trainer.sft_warmup_steps=5", "trainer.sft_batch_size=16",
           "data.prompts_per_step=8", "trainer.mini_batch_prompts=8", "dynamo.allocation.n_avg=4",
           "dynamo.allocation.n_min=2", "dynamo.allocation.n_max=6", "logging.tensorboard=false", "logging.plot=false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2] and all(m["rollouts"] == 8 * 4 for m in steps)
