"""Which token ids end a generated response: one stop set for training rollouts, the periodic evaluation and
``dynamo eval``.

A model ends its answer with the token that closes a turn in its chat format (ChatML: ``<|im_end|>``) or with its
end of text, depending on how it was trained. The stop set is the union, in this order, of:

1. the tokenizer's ``eos_token_id``;
2. every id of ``eos_token_id`` (an int or a list) in ``generation_config.json`` of the model's directories: HF's
   record of the model's own end tokens (Qwen2.5-Math-1.5B-Instruct: ``[151645, 151643]``, ``<|im_end|>`` and
   ``<|endoftext|>``; the base Qwen2.5-Math-1.5B: ``151643``);
3. the prompt template's end-of-turn token (:attr:`PromptTemplate.end_of_turn`, ``<|im_end|>`` for ChatML), when
   the tokenizer has it as one token. A chat template's end of turn that the tokenizer does not know is skipped
   (a non-Qwen chat model renders its own chat template and ends its turn otherwise), with a warning where the
   prompt is ChatML nonetheless: a tokenizer without a chat template (the markup is written out as text) or a
   Qwen tokenizer.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterable

from megatron_dynamo.data.templates import PromptTemplate, get_template

log = logging.getLogger(__name__)

GENERATION_CONFIG_NAME = "generation_config.json"

_warned: set[tuple[str, str, str]] = set()


class GenerationConfigError(ValueError):
    """A ``generation_config.json`` that cannot be read or whose ``eos_token_id`` is not an id or a list of ids."""


def read_generation_eos_ids(model_dir: str | os.PathLike) -> tuple[int, ...]:
    """The ``eos_token_id`` ids of ``<model_dir>/generation_config.json`` (none when the file or the field is
    missing); a malformed file raises :class:`GenerationConfigError` with a one-line message."""
    path = Path(model_dir) / GENERATION_CONFIG_NAME
    if not path.exists():
        return ()
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise GenerationConfigError(f"{path}: cannot be read ({exc.__class__.__name__}: {exc})") from None
    except json.JSONDecodeError as exc:
        raise GenerationConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column "
                                    f"{exc.colno})") from None
    if not isinstance(config, dict):
        raise GenerationConfigError(f"{path}: expected a JSON object, found {type(config).__name__}")
    value = config.get("eos_token_id")
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise GenerationConfigError(f"{path}: eos_token_id must be a token id or a list of token ids, "
                                    f"got {json.dumps(value)}")
    return tuple(ids)


def single_token_id(tokenizer: Any, token: str) -> int | None:
    """The id of ``token`` when the tokenizer has it as one token (a vocabulary or added token), else None."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
        return None
    unk = getattr(tokenizer, "unk_token", None)
    if token_id == getattr(tokenizer, "unk_token_id", None) and token != unk:
        return None
    return token_id


def _prompt_is_chatml(tokenizer: Any) -> bool:
    """Whether prompts for this tokenizer are ChatML: it has no chat template of its own (``render`` writes Qwen's
    markup), its chat template is ChatML, or it is a Qwen tokenizer."""
    chat_template = getattr(tokenizer, "chat_template", None)
    if not chat_template or "<|im_start|>" in str(chat_template):
        return True
    name = f"{type(tokenizer).__name__} {getattr(tokenizer, 'name_or_path', '')}"
    return "qwen" in name.lower() or single_token_id(tokenizer, "<|im_start|>") is not None


def stop_token_ids(tokenizer: Any, template: str | PromptTemplate,
                   model_dirs: Iterable[str | os.PathLike | None] = ()) -> tuple[int, ...]:
    """The ids that end a response (see the module doc): the tokenizer's EOS, the ``eos_token_id`` of each
    ``generation_config.json`` in ``model_dirs`` (entries that are None, not directories or have no such file
    add nothing), then the template's end-of-turn token, each id once, in that order.

    Raises :class:`GenerationConfigError` for a malformed ``generation_config.json``.
    """
    if isinstance(template, str):
        template = get_template(template)
    ids: list[int] = []

    def add(token_id: int | None) -> None:
        if token_id is not None and token_id not in ids:
            ids.append(int(token_id))

    add(getattr(tokenizer, "eos_token_id", None))
    for model_dir in model_dirs:
        if model_dir is not None and Path(model_dir).is_dir():
            for token_id in read_generation_eos_ids(model_dir):
                add(token_id)
    if template.end_of_turn is not None:
        token_id = single_token_id(tokenizer, template.end_of_turn)
        if token_id is not None:
            add(token_id)
        elif _prompt_is_chatml(tokenizer):
            key = (template.name, template.end_of_turn, str(getattr(tokenizer, "name_or_path", "")))
            if key not in _warned:
                _warned.add(key)
                log.warning("prompt template %r ends a turn with %s, which the tokenizer %s does not have as one "
                            "token: generation stops only at %s", template.name, template.end_of_turn,
                            getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__, ids or "max_tokens")
    return tuple(ids)


def copy_generation_config(model_dirs: Iterable[str | os.PathLike | None],
                           target_dir: str | os.PathLike) -> Path | None:
    """Copy the first ``generation_config.json`` found in ``model_dirs`` into ``target_dir`` (after checking that
    it is well formed), so that it travels with what is saved there; returns its source, or None."""
    import shutil

    for model_dir in model_dirs:
        if model_dir is None or not Path(model_dir).is_dir():
            continue
        source = Path(model_dir) / GENERATION_CONFIG_NAME
        if source.is_file():
            read_generation_eos_ids(model_dir)
            target = Path(target_dir) / GENERATION_CONFIG_NAME
            if source.resolve() != target.resolve():
                Path(target_dir).mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)
            return source
    return None
