"""What a model provider says of an HF ``config.json`` it cannot reproduce exactly: one error type, raised with a
one-line message that names the field (shared by the dense provider, ``models/qwen.py``, and its mixture-of-experts
part, ``models/qwen_moe.py``)."""

from __future__ import annotations

from typing import Any


class UnsupportedModelConfig(ValueError):
    """The HF config asks for something the Megatron model cannot reproduce exactly."""


def require_field(cfg: dict[str, Any], field: str) -> Any:
    """``cfg[field]``; :class:`UnsupportedModelConfig` naming the field when it is missing or null."""
    if field not in cfg or cfg[field] is None:
        raise UnsupportedModelConfig(f"config.json: missing required field '{field}'")
    return cfg[field]


__all__ = ["UnsupportedModelConfig", "require_field"]
