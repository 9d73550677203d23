"""Prompt templates: how a problem becomes the text the policy continues.

Registered templates:

- ``qwen_math_boxed`` (default): Qwen2.5-Math's chat format, system prompt "Please reason step by step, and put
  your final answer within \\boxed{}." and the problem as the user turn, ending with the opened assistant turn.
- ``plain``: for base models without chat markup: ``Question: {problem}\\nAnswer: Let's think step by step.``
- ``plain_boxed``: base models, asking for a boxed answer (the common RLVR zero-shot prompt).
- ``synthetic``: the tiny CPU task: ``{problem}=`` (a few characters, learnable by a tiny model).

The Qwen markup is rendered as a string here, so no tokenizer is needed; given a tokenizer that has a chat
template, a chat template is rendered with that instead (right for non-Qwen chat models).

A chat template names the token that ends the model's turn (``end_of_turn``: ``<|im_end|>`` for ChatML); generation
stops there (see :func:`megatron_dynamo.data.stopping.stop_token_ids`). Plain templates have none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PROBLEM_PLACEHOLDER = "{problem}"
DEFAULT_TEMPLATE = "qwen_math_boxed"
QWEN_MATH_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
#: ChatML's end of a turn: where a Qwen chat model's answer ends.
QWEN_END_OF_TURN = "<|im_end|>"


@dataclass(frozen=True)
class PromptTemplate:
    """A prompt format. ``user`` holds the literal ``{problem}`` placeholder (substituted, never ``str.format``:
    problems and prompts are full of LaTeX braces). ``end_of_turn``: the token with which the model ends its
    answer in this format (ChatML: ``<|im_end|>``), a stop token of generation; None for plain text formats."""

    name: str
    user: str
    system: str | None = None
    chat: bool = False
    description: str = ""
    end_of_turn: str | None = None

    def __post_init__(self) -> None:
        if PROBLEM_PLACEHOLDER not in self.user:
            raise ValueError(f"template {self.name!r}: the user text must contain {PROBLEM_PLACEHOLDER}")

    def user_text(self, problem: str) -> str:
        return self.user.replace(PROBLEM_PLACEHOLDER, problem)

    def messages(self, problem: str) -> list[dict[str, str]]:
        """Chat messages (system, user) for engines that take messages."""
        messages = [{"role": "system", "content": self.system}] if self.system is not None else []
        messages.append({"role": "user", "content": self.user_text(problem)})
        return messages


_TEMPLATES: dict[str, PromptTemplate] = {}


def register_template(template: PromptTemplate, *, overwrite: bool = False) -> PromptTemplate:
    """Add a template under its name (an existing name is an error unless ``overwrite``)."""
    if template.name in _TEMPLATES and not overwrite:
        raise ValueError(f"prompt template {template.name!r} is already registered")
    _TEMPLATES[template.name] = template
    return template


def get_template(name: str) -> PromptTemplate:
    """The registered template called ``name``."""
    try:
        return _TEMPLATES[name]
    except KeyError:
        raise KeyError(f"unknown prompt template {name!r}; registered: {', '.join(sorted(_TEMPLATES))}") from None


def list_templates() -> list[str]:
    return sorted(_TEMPLATES)


def render_qwen_chat(messages: list[dict[str, str]]) -> str:
    """Qwen's ChatML markup for ``messages``, ending with an opened assistant turn."""
    parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    return "".join(parts) + "<|im_start|>assistant\n"


def render(template: str | PromptTemplate, problem: str, tokenizer: Any | None = None) -> str:
    """The prompt text for ``problem``.

    Chat templates use the tokenizer's own chat template when ``tokenizer`` has one, else Qwen's markup.
    """
    if isinstance(template, str):
        template = get_template(template)
    if not template.chat:
        return template.user_text(problem)
    messages = template.messages(problem)
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return render_qwen_chat(messages)


register_template(PromptTemplate(
    name="qwen_math_boxed",
    system=QWEN_MATH_SYSTEM_PROMPT,
    user=PROBLEM_PLACEHOLDER,
    chat=True,
    description="Qwen2.5-Math chat format with the boxed-answer system prompt (default)",
    end_of_turn=QWEN_END_OF_TURN,
))
register_template(PromptTemplate(
    name="plain",
    user="Question: {problem}\nAnswer: Let's think step by step.",
    description="base models, no chat markup",
))
register_template(PromptTemplate(
    name="plain_boxed",
    user="{problem} Let's think step by step and output the final answer within \\boxed{}.",
    description="base models, no chat markup, asks for a boxed answer",
))
register_template(PromptTemplate(
    name="synthetic",
    user="{problem}=",
    description="the tiny synthetic arithmetic task: '23+45='",
))
