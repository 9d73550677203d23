"""The prompt-length policy: what happens to training prompts longer than ``data.max_prompt_tokens``.

    lengths = prompt_token_lengths(examples, tokenizer, template)
    report = PromptLengthReport.of(lengths, max_tokens=16)
    note = check_prompt_overflow(report, policy="truncate_left", max_share=0.05)   # a line for the console, or None

Policies (``data.prompt_overflow``):

- ``truncate_left`` (the paper's: prompts left-truncated to the maximum prompt length): the long prompts keep their
  last ``max_prompt_tokens`` tokens; the run refuses to start when more than ``data.max_overflow_share`` of the
  training prompts would be cut (a prompt cut from the left loses its beginning: often the numbers of the problem);
- ``drop``: the long prompts are left out of the training set (refused above the same share);
- ``refuse``: any long prompt stops the run before it starts.

Every refusal is one line naming the keys to change. The console gets one line with the count, and every step's
metrics ``data/prompts_truncated`` (how many of its prompts were cut).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from megatron_dynamo.data.templates import render

PROMPT_OVERFLOW = ("truncate_left", "drop", "refuse")


@dataclass(frozen=True)
class PromptLengthReport:
    """How many of ``total`` prompts are longer than ``max_tokens`` tokens, and the longest."""

    total: int
    over: int
    longest: int
    max_tokens: int

    @classmethod
    def of(cls, lengths: Sequence[int], max_tokens: int) -> "PromptLengthReport":
        return cls(total=len(lengths), over=sum(1 for n in lengths if n > max_tokens),
                   longest=max(lengths, default=0), max_tokens=max_tokens)

    @property
    def share(self) -> float:
        return self.over / self.total if self.total else 0.0


def render_prompts(examples: Sequence[Any], template: str) -> list[str]:
    return [render(template, example.problem) for example in examples]


def prompt_token_lengths(examples: Sequence[Any], tokenizer, template: str) -> list[int]:
    """Tokens of every example's rendered prompt, as the trainer encodes it (no special tokens added)."""
    texts = render_prompts(examples, template)
    if not texts:
        return []
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def check_prompt_overflow(report: PromptLengthReport, policy: str, max_share: float) -> str | None:
    """None when every prompt fits; else the console line saying what happens to the long ones. Raises
    ``ValueError`` (one line naming the keys) when the policy refuses: ``refuse`` and a long prompt, or more than
    ``max_share`` of the prompts long under ``truncate_left`` / ``drop``."""
    if policy not in PROMPT_OVERFLOW:
        raise ValueError(f"data.prompt_overflow must be one of {PROMPT_OVERFLOW}, got {policy!r}")
    if not report.over:
        return None
    counted = (f"{report.over} of {report.total} training prompts ({100 * report.share:.1f}%) are longer than "
               f"data.max_prompt_tokens={report.max_tokens} (longest: {report.longest} tokens)")
    raise_it = (f"raise data.max_prompt_tokens to {report.longest} to keep every prompt whole")
    if policy == "refuse":
        raise ValueError(f"{counted} and data.prompt_overflow=refuse: {raise_it}, or set data.prompt_overflow to "
                         f"truncate_left or drop")
    action = "cut from the left" if policy == "truncate_left" else "dropped"
    if report.share > max_share:
        raise ValueError(f"{counted}: more than data.max_overflow_share={max_share:g} would be {action} "
                         f"(data.prompt_overflow={policy}); {raise_it}, or raise data.max_overflow_share to "
                         f"{report.share:.3f} to accept it")
    return f"{counted}: {action} (data.prompt_overflow={policy})"


def fitting_examples(examples: Sequence[Any], lengths: Sequence[int], max_tokens: int) -> list[Any]:
    """The examples whose prompts fit (the ``drop`` policy)."""
    return [example for example, n in zip(examples, lengths) if n <= max_tokens]


def fit_prompt(token_ids: Sequence[int], max_tokens: int) -> tuple[tuple[int, ...], bool]:
    """``(the prompt's last max_tokens tokens, whether it was cut)``: left truncation."""
    return tuple(token_ids[-max_tokens:]), len(token_ids) > max_tokens
