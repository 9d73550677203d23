"""Configs as dataclasses, loaded from YAML with ``key=value`` command-line overrides, checked before any compute.

    cfg = load_config("configs/cpu_default.yaml", ["trainer.steps=50", "dynamo.allocation.power=0.5"])

Rules:
- every section is a dataclass; YAML keys and override paths must name existing fields: a typo is an error that
  lists the valid keys and the closest match (never silently ignored);
- values are converted to the field's type (``"3"`` -> 3 for an int field, ``"true"`` -> True) and a value that
  does not fit is an error naming the dotted key;
- ``validate()`` of every section runs at load time, so a bad value stops the run before a model is built.

Every error has one form: the dotted key, a colon, what is wrong and what would be right
(``trainer.steps: must be >= 0, got -1``; ``trainer.stpes: no such key (did you mean trainer.steps?) ...``).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from typing import Any, Union

import yaml


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names the dotted key."""


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans: only true/false. YAML 1.1 also reads on/off/yes/no as
    booleans, which turned ``dynamo.loss.engine_is=off`` (a choice named "off") into False."""


_Loader.yaml_implicit_resolvers = {key: [(tag, regexp) for tag, regexp in resolvers
                                         if tag != "tag:yaml.org,2002:bool"]
                                   for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def parse_yaml(text) -> Any:
    """YAML (a recipe's text or stream, an override's value) with YAML 1.2's booleans (:class:`_Loader`)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def _field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(value: Any, annotation: Any, key: str) -> Any:
    """Convert a YAML/override value to ``annotation``; raise ConfigError naming ``key`` if it does not fit."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(value, option, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{key}: cannot be {value!r}")
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {annotation.__name__} fields, got {value!r}")
        return build(annotation, value, prefix=key)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item_type, *_) = typing.get_args(annotation) or (Any,)
        items = [_convert(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if annotation is Any:
        return value
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0", "on", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if annotation is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if annotation is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    return value


def _unknown_key(cls, key: str, prefix: str) -> ConfigError:
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(key, names, n=1)
    where = f"{prefix}." if prefix else ""
    hint = f" (did you mean {where}{close[0]}?)" if close else ""
    return ConfigError(f"{where}{key}: no such key{hint}; the keys {f'of {prefix}' if prefix else 'at the top'}: "
                       f"{', '.join(names)}")


def build(cls, values: dict[str, Any] | None, prefix: str = ""):
    """Build dataclass ``cls`` from a (nested) dict, converting and checking every key."""
    values = values or {}
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {values!r}")
    hints = _field_types(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in hints or key not in {f.name for f in dataclasses.fields(cls)}:
            raise _unknown_key(cls, key, prefix)
        kwargs[key] = _convert(value, hints[key], f"{prefix}.{key}" if prefix else key)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{prefix or cls.__name__}: {exc}") from None


def to_dict(obj) -> dict[str, Any]:
    """A dataclass config as plain nested dicts (for YAML dumps and logs)."""
    return dataclasses.asdict(obj)


def apply_overrides(values: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` strings (value parsed as YAML: numbers, booleans, null, lists) to a nested dict."""
    values = _deep_copy(values)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        path, raw = item.split("=", 1)
        path = path.strip()
        if not path:
            raise ConfigError(f"override '{item}' has an empty key")
        try:
            parsed = parse_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override '{item}': the value is not valid YAML ({_yaml_problem(exc)}); quote it, "
                              f"e.g. {path}='\"...\"'") from None
        node = values
        parts = path.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{part}' is not a section")
        node[parts[-1]] = parsed
    return values


def _deep_copy(values: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in (values or {}).items()}


def _yaml_problem(exc: yaml.YAMLError, path: str | None = None) -> str:
    """One line for a YAML parse error: ``path:line:column: YAML syntax error: problem`` with a file, else
    ``line L, column C: problem`` (1-based, as editors count)."""
    mark = getattr(exc, "problem_mark", None)
    problem = (getattr(exc, "problem", None) or str(exc).splitlines()[0]) + (
        f" ({exc.context})" if getattr(exc, "context", None) else "")
    if mark is None:
        return f"{path}: YAML syntax error: {problem}" if path else problem
    if path is not None:
        return f"{path}:{mark.line + 1}:{mark.column + 1}: YAML syntax error: {problem}"
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def load_yaml(path: str) -> dict[str, Any]:
    """The recipe's sections as a dict; a syntax error is a :class:`ConfigError` naming the file and line, a
    missing file one naming the recipes that are there."""
    if not os.path.isfile(path):
        folder = os.path.dirname(path) or "."
        recipes = sorted(n for n in os.listdir(folder) if n.endswith((".yaml", ".yml"))) if os.path.isdir(
            folder) else []
        there = (f"the recipes in {folder}/: {', '.join(recipes)}" if recipes else
                 "a recipe is a YAML file such as configs/cpu_default.yaml")
        raise ConfigError(f"{path}: no such file; {there}")
    with open(path, encoding="utf-8") as f:
        try:
            data = parse_yaml(f) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(_yaml_problem(exc, path)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


def validate_tree(obj, prefix: str = "") -> None:
    """Run ``validate()`` on every dataclass in the tree, children first; wrap errors with the dotted key."""
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if dataclasses.is_dataclass(value):
            validate_tree(value, f"{prefix}{field.name}.")
    validate = getattr(obj, "validate", None)
    if callable(validate):
        try:
            validate()
        except ConfigError:
            raise
        except ValueError as exc:
            raise ConfigError(keyed_message(obj, prefix, str(exc))) from None


_LEADING_KEY = re.compile(r"([A-Za-z_]\w*(?:\.\w+)*)(?: \(([^()]*)\))?:? (.*)", re.S)


def keyed_message(obj, prefix: str, message: str) -> str:
    """A section's ``validate()`` message in the one form: ``"steps must be >= 0, got -1"`` of section ``trainer.``
    -> ``"trainer.steps: must be >= 0, got -1"``; ``"AllocationConfig.n_min (9) must be <= n_max (8)"`` of
    ``dynamo.allocation.`` -> ``"dynamo.allocation.n_min: must be <= n_max (8), got 9"``. A message that does not
    start with one of the section's keys is put after the section's name."""
    section = prefix.rstrip(".")
    text = message
    for lead in (f"{type(obj).__name__}.", f"{section}." if section else None):
        if lead and text.startswith(lead):
            text = text[len(lead):]
            break
    match = _LEADING_KEY.match(text)
    if match and match.group(1).split(".")[0] in {f.name for f in dataclasses.fields(obj)}:
        rest = match.group(3) + (f", got {match.group(2)}" if match.group(2) else "")
        return f"{prefix}{match.group(1)}: {rest}"
    return f"{section or type(obj).__name__}: {text}"
