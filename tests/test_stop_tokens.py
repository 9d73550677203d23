"""Where generation stops: the stop set of :func:`megatron_dynamo.data.stopping.stop_token_ids` (tokenizer EOS,
the model's generation_config.json end tokens, the template's end of turn) on an offline tokenizer with Qwen's
special tokens, and that training rollouts and `dynamo eval` use it. (That vLLM ends a response at such an id:
tests/test_rollout.py::test_stop_token_ids_end_generation.)"""

from __future__ import annotations

import json
import logging
import os

import pytest

from hf_reference import REPO

from megatron_dynamo.data.stopping import (GenerationConfigError, copy_generation_config, read_generation_eos_ids,
                                           stop_token_ids)
from megatron_dynamo.data.tokenizer import CHARACTERS as CHARS

CPU_DEFAULT = os.path.join(REPO, "configs", "cpu_default.yaml")
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def qwen_like_tokenizer(out_dir, specials=QWEN_SPECIALS, eos="<|endoftext|>", generation_eos=None):
    """A character tokenizer (no special tokens of its own) with Qwen's special tokens added after its vocabulary,
    in Qwen's order (as 151643, 151644, 151645 follow Qwen's BPE vocabulary), saved to ``out_dir`` with a
    generation_config.json listing ``generation_eos`` (token strings) when given; loaded back with AutoTokenizer
    as the trainer and `dynamo eval` load it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from megatron_dynamo.data.tokenizer import save_char_tokenizer

    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[]))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials], special_tokens=True)
    tokenizer.eos_token = eos
    save_char_tokenizer(tokenizer, out_dir)
    if generation_eos is not None:
        ids = [tokenizer.convert_tokens_to_ids(t) for t in generation_eos]
        (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": ids if len(ids) > 1 else ids[0],
                                                                    "bos_token_id": ids[-1]}))
    return AutoTokenizer.from_pretrained(out_dir)


def _ids(tokenizer, *tokens):
    return tuple(tokenizer.convert_tokens_to_ids(t) for t in tokens)


def test_stop_set_for_chat_and_plain_templates(tmp_path):
    instruct = qwen_like_tokenizer(tmp_path / "instruct", generation_eos=["<|im_end|>", "<|endoftext|>"])
    eot, im_start, im_end = _ids(instruct, *QWEN_SPECIALS)
    assert (eot, im_start, im_end) == (len(CHARS), len(CHARS) + 1, len(CHARS) + 2) and instruct.eos_token_id == eot
    # Qwen2.5-Math-1.5B-Instruct's generation config: [<|im_end|>, <|endoftext|>].
    assert read_generation_eos_ids(tmp_path / "instruct") == (im_end, eot)
    assert stop_token_ids(instruct, "qwen_math_boxed", [tmp_path / "instruct"]) == (eot, im_end)
    assert stop_token_ids(instruct, "plain", [tmp_path / "instruct"]) == (eot, im_end)  # the model's own end token

    # The base model's generation config (eos_token_id: <|endoftext|>, an int): <|im_end|> only by the template.
    base = qwen_like_tokenizer(tmp_path / "base", generation_eos=["<|endoftext|>"])
    assert read_generation_eos_ids(tmp_path / "base") == (eot,)
    assert stop_token_ids(base, "qwen_math_boxed", [tmp_path / "base"]) == (eot, im_end)
    assert stop_token_ids(base, "plain", [tmp_path / "base"]) == (eot,)
    assert stop_token_ids(base, "plain_boxed", [tmp_path / "base", None, "char"]) == (eot,)
    # A tokenizer whose EOS is <|im_end|> (Qwen's instruct tokenizers): its EOS first, then the config's order.
    im_end_eos = qwen_like_tokenizer(tmp_path / "im_end_eos", eos="<|im_end|>")
    assert stop_token_ids(im_end_eos, "qwen_math_boxed", [tmp_path / "instruct"]) == (im_end, eot)
    # No generation_config.json anywhere (a missing file is fine; a missing or non-directory entry too).
    assert stop_token_ids(base, "qwen_math_boxed", [tmp_path / "im_end_eos", tmp_path / "nowhere"]) == (eot, im_end)
    assert stop_token_ids(base, "synthetic") == (eot,)
    # The character tokenizer of the CPU default has the same special tokens at ids 0, 1, 2.
    from megatron_dynamo.data import build_char_tokenizer

    assert stop_token_ids(build_char_tokenizer(), "qwen_math_boxed") == (0, 2)


def test_unknown_end_of_turn_is_skipped_with_one_warning_for_chatml_prompts(tmp_path, caplog):
    no_im_end = qwen_like_tokenizer(tmp_path / "no_im_end", specials=QWEN_SPECIALS[:2])
    eot = no_im_end.eos_token_id
    with caplog.at_level(logging.WARNING, logger="megatron_dynamo.data.stopping"):
        assert stop_token_ids(no_im_end, "qwen_math_boxed") == (eot,)
        assert stop_token_ids(no_im_end, "qwen_math_boxed") == (eot,)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "<|im_end|>" in warnings[0] and "qwen_math_boxed" in warnings[0], warnings

    # A non-Qwen chat model renders its own chat template (its turn ends otherwise): skipped without a word.
    caplog.clear()
    other = qwen_like_tokenizer(tmp_path / "other", specials=("</s>", "[INST]"), eos="</s>")
    other.chat_template = "{% for m in messages %}[INST]{{ m['content'] }}{% endfor %}"
    with caplog.at_level(logging.WARNING, logger="megatron_dynamo.data.stopping"):
        assert stop_token_ids(other, "qwen_math_boxed") == (other.eos_token_id,)
    assert not caplog.records


@pytest.mark.parametrize("content,message", [
    ('{"eos_token_id": [1, 2,', "not valid JSON"),
    ('[151643]', "expected a JSON object, found list"),
    ('{"eos_token_id": "<|im_end|>"}', 'eos_token_id must be a token id or a list of token ids, got "<|im_end|>"'),
    ('{"eos_token_id": [151645, true]}', "eos_token_id must be a token id or a list of token ids"),
    ('{"eos_token_id": -1}', "eos_token_id must be a token id"),
])
def test_malformed_generation_config_is_a_one_line_error(tmp_path, content, message):
    tokenizer = qwen_like_tokenizer(tmp_path / "tok")
    (tmp_path / "tok" / "generation_config.json").write_text(content)
    with pytest.raises(GenerationConfigError) as info:
        stop_token_ids(tokenizer, "qwen_math_boxed", [tmp_path / "tok"])
    text = str(info.value)
    assert "\n" not in text and message in text and text.startswith(str(tmp_path / "tok" / "generation_config.json"))
    # No eos_token_id (or null): nothing to add, not an error.
    (tmp_path / "tok" / "generation_config.json").write_text('{"eos_token_id": null, "temperature": 0.7}')
    assert read_generation_eos_ids(tmp_path / "tok") == ()


def test_copy_generation_config(tmp_path):
    qwen_like_tokenizer(tmp_path / "model", generation_eos=["<|im_end|>", "<|endoftext|>"])
    assert copy_generation_config([None, "char", tmp_path / "missing"], tmp_path / "out") is None
    assert not (tmp_path / "out").exists()
    assert copy_generation_config(["char", tmp_path / "model"], tmp_path / "out") == tmp_path / "model" / \
        "generation_config.json"
    assert read_generation_eos_ids(tmp_path / "out") == read_generation_eos_ids(tmp_path / "model")


# ------------------------------------------------------------------------------------------------ trainer
def _built_trainer(monkeypatch, tmp_path, overrides, rank=0):
    """``Trainer._build`` for a run config, with the Megatron actor, the vLLM engine and the reward workers
    replaced by stand-ins (the stop set is computed before any of them is used)."""
    from types import SimpleNamespace

    from megatron_dynamo.parallel.topology import EngineLayout
    from megatron_dynamo.trainer import trainer as trainer_module
    from megatron_dynamo.trainer.config import load_run_config
    from megatron_dynamo.trainer.metrics import StartupClock
    from megatron_dynamo.trainer.trainer import Trainer, build_tokenizer

    # The names as the trainer module holds them (imported at its top).
    monkeypatch.setattr(trainer_module, "MegatronActor", lambda *args, **kwargs: None)
    monkeypatch.setattr(trainer_module, "create_engine",
                        lambda *args, **kwargs: SimpleNamespace(layout=EngineLayout(rank, rank + 1, 1)))
    monkeypatch.setattr(trainer_module, "create_scorer", lambda *args, **kwargs: None)
    run = load_run_config(CPU_DEFAULT, [f"trainer.output_dir={tmp_path / 'run'}", *overrides])
    trainer = Trainer.__new__(Trainer)
    trainer.run, trainer.rank, trainer.output_dir = run, rank, tmp_path / "run"
    trainer.startup = StartupClock()  # as __init__ makes it: _build times its phases
    trainer.hf_config, trainer.groups, trainer.engine_max_len = {"vocab_size": 128}, None, 256
    trainer.tokenizer = build_tokenizer(run, trainer.output_dir)
    trainer._build()
    return trainer


def _hf_model_dir(path, generation_eos):
    """An HF model directory as far as the trainer looks before loading weights: a safetensors file and a
    generation_config.json."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    save_file({"lm_head.weight": torch.zeros(2, 2)}, str(path / "model.safetensors"))
    (path / "config.json").write_text("{}")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return path


def test_trainer_rollouts_stop_at_the_end_of_a_chatml_turn(monkeypatch, tmp_path):
    """The key test: with qwen_math_boxed, rollouts (and the periodic evaluation, which takes the rollout's stop
    ids) stop at <|im_end|> and at the model's generation_config.json end tokens, not only at the tokenizer EOS."""
    tokenizer = qwen_like_tokenizer(tmp_path / "tokenizer", generation_eos=["<|endoftext|>"])
    eot, im_start, im_end = _ids(tokenizer, *QWEN_SPECIALS)
    checkpoint = _hf_model_dir(tmp_path / "hf_model", [im_end, eot, im_start])  # a third id, only in the model dir
    trainer = _built_trainer(monkeypatch, tmp_path, [f"model.tokenizer={tmp_path / 'tokenizer'}",
                                                     f"model.checkpoint={checkpoint}",
                                                     "data.template=qwen_math_boxed"])
    assert trainer.sampling.stop_token_ids == (eot, im_end, im_start)
    assert trainer.runner.producer.sampling.stop_token_ids == (eot, im_end, im_start)  # what rollouts use
    from megatron_dynamo.trainer.config import eval_config

    assert eval_config(trainer.run, stop_token_ids=trainer.sampling.stop_token_ids).sampling().stop_token_ids == \
        (eot, im_end, im_start)
    # The model's generation config travels with the saved tokenizer (-> every checkpoint's hf/ -> the export).
    assert read_generation_eos_ids(tmp_path / "run" / "tokenizer") == (im_end, eot, im_start)

    # Without a checkpoint: the tokenizer directory's generation config and the template's end of turn.
    plain = _built_trainer(monkeypatch, tmp_path / "b", [f"model.tokenizer={tmp_path / 'tokenizer'}",
                                                         "data.template=qwen_math_boxed"], rank=1)
    assert plain.sampling.stop_token_ids == (eot, im_end)
    assert not (tmp_path / "b" / "run" / "tokenizer" / "generation_config.json").exists()  # rank 1 writes nothing
    # The CPU default (character tokenizer, synthetic template): its EOS alone, as before.
    assert _built_trainer(monkeypatch, tmp_path / "c", []).sampling.stop_token_ids == (0,)


def test_trainer_reports_a_malformed_generation_config(monkeypatch, tmp_path):
    from megatron_dynamo.trainer.trainer import TrainingError

    qwen_like_tokenizer(tmp_path / "tokenizer")
    (tmp_path / "tokenizer" / "generation_config.json").write_text("{oops")
    with pytest.raises(TrainingError, match=r"generation_config.json: not valid JSON") as info:
        _built_trainer(monkeypatch, tmp_path, [f"model.tokenizer={tmp_path / 'tokenizer'}"])
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------------ dynamo eval
def test_dynamo_eval_stops_where_training_stops(monkeypatch, tmp_path, capsys):
    """`dynamo eval` hands the engine the stop set of the evaluated model's directory and template (the engine,
    the scorer and the evaluation itself are stand-ins here; test_eval.py runs them for real)."""
    from megatron_dynamo.cli import main
    from megatron_dynamo.commands import eval as eval_command
    from megatron_dynamo.eval import runner
    from megatron_dynamo.eval.model_source import prepare_model

    model = _hf_model_dir(tmp_path / "model", None)
    tokenizer = qwen_like_tokenizer(model, generation_eos=["<|im_end|>", "<|endoftext|>"])
    eot, _, im_end = _ids(tokenizer, *QWEN_SPECIALS)
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"id": "1", "problem": "1+1", "answer": "2"}) + "\n")

    class Stand:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    seen = {}

    def fake_evaluate(engine, tokenizer, scorer, config, output, **kwargs):
        seen["config"] = config
        raise runner.EvalError("stand-in evaluation")

    monkeypatch.setattr(eval_command, "VLLMEngine", Stand)
    monkeypatch.setattr(eval_command, "MathRewardScorer", Stand)
    monkeypatch.setattr(eval_command, "evaluate", fake_evaluate)
    args = ["eval", "--checkpoint", str(model), "--benchmarks", str(bench), "--output", str(tmp_path / "out"),
            "--n", "1"]
    assert main(args) == 2 and "stand-in evaluation" in capsys.readouterr().err
    assert seen["config"].template == "qwen_math_boxed" and seen["config"].stop_token_ids == (eot, im_end)
    assert seen["config"].sampling().stop_token_ids == (eot, im_end)
    assert main([*args, "--template", "plain"]) == 2 and "stand-in evaluation" in capsys.readouterr().err
    assert seen["config"].stop_token_ids == (eot, im_end)  # the model's own generation config lists <|im_end|>
    source = prepare_model(model, tmp_path / "out")
    assert source.stop_token_ids(tokenizer, "plain", None) == (eot, im_end)

    # A malformed generation config: the command's one-line error, before any engine starts.
    (model / "generation_config.json").write_text('{"eos_token_id": "x"}')
    seen.clear()
    assert main(args) == 2 and not seen
    err = capsys.readouterr().err.strip()
    assert err.startswith("dynamo eval: ") and "eos_token_id must be a token id" in err and "\n" not in err
