"""Hugging Face Hub model ids (``Qwen/Qwen2.5-Math-1.5B``) where a model or tokenizer directory is expected.

    resolve_model_dir("Qwen/Qwen2.5-Math-1.5B", "checkpoint")   # -> <cache>/models--Qwen--.../snapshots/<commit>
    resolve_model_dir("checkpoints/Qwen2.5-Math-1.5B", "checkpoint")  # an existing path: returned as it is

An existing local path always wins; a string that is not one and is a well-formed ``org/name`` id is looked up with
``huggingface_hub.snapshot_download`` in the Hugging Face cache (``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``), downloading only what training and evaluation read (:data:`ALLOW_PATTERNS`: config,
generation config, tokenizer files, ``*.safetensors`` and their index). With ``HF_HUB_OFFLINE=1``, or
``local_only=True``, the cache is read and the hub is never contacted. A missing path is a :class:`HubModelError`
"no such directory" naming the nearest existing one, also when it is spelled like an id but reads as a path: its
first part is a local directory or one of the folders runs write (``outputs/cpu_defualt``, ``outputs/run``).

The environment is read at each call (not when ``huggingface_hub`` was imported), and each (id, purpose, cache) is
resolved once per process. Errors are :class:`HubModelError` with a one-line message naming the id, the cache
searched and how to fill it.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

from megatron_dynamo.models.checkpoint_io import TOKENIZER_FILES as _TOKENIZER_FILES

_MODEL_FILES = ("config.json", "generation_config.json")

#: What is downloaded per purpose: a checkpoint is everything a tokenizer is, plus the weights.
ALLOW_PATTERNS: dict[str, tuple[str, ...]] = {
    "tokenizer": _MODEL_FILES + _TOKENIZER_FILES,
    "checkpoint": _MODEL_FILES + _TOKENIZER_FILES + ("*.safetensors", "*.safetensors.index.json"),
}

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"{_NAME}/{_NAME}")
_TRUE = {"1", "ON", "YES", "TRUE"}
#: The folders runs and tools write, which no hub organisation is taken to be: ``outputs/x`` is a path.
_LOCAL_ROOTS = ("outputs", "checkpoints", "runs", "data")
_RESOLVED: dict[tuple[str, str, str], Path] = {}


class HubModelError(ValueError):
    """A hub id that cannot be resolved to a usable local snapshot; the message is one line."""


def is_hub_id(text: str) -> bool:
    """``org/name`` as the hub spells repository ids (letters, digits, ``-_.``; no ``--`` or ``..``)."""
    return bool(_HUB_ID.fullmatch(text)) and "--" not in text and ".." not in text and not text.endswith(".git")


def is_hub_reference(name_or_path: str | os.PathLike) -> bool:
    """True when ``name_or_path`` will be looked up on the hub: a well-formed id that is no existing local path and
    does not read as one (its first part a local directory or one of :data:`_LOCAL_ROOTS`)."""
    text = os.fspath(name_or_path)
    first = text.split("/", 1)[0]
    looks_local = first in _LOCAL_ROOTS or Path(first).expanduser().is_dir()
    return is_hub_id(text) and not Path(text).expanduser().exists() and not looks_local


def missing_directory(name_or_path: str | os.PathLike) -> str:
    """``"PATH: no such directory"`` with the nearest existing one: a close name where the path parts ways with
    what exists (``outputs/cpu_defualt`` -> ``outputs/cpu_default``), else the deepest existing parent."""
    path = Path(os.fspath(name_or_path)).expanduser()
    parent = path
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.exists():
        return f"{path}: no such directory"
    below = path.relative_to(parent).parts[0] if path != parent else ""
    names = sorted(p.name for p in parent.iterdir() if p.is_dir()) if parent.is_dir() else []
    close = difflib.get_close_matches(below, names, n=1, cutoff=0.6)
    if close:
        return f"{path}: no such directory (did you mean {parent / close[0]}?)"
    return f"{path}: no such directory; the nearest existing one is {str(parent).rstrip(os.sep)}{os.sep}"


def hub_cache_dir() -> Path:
    """The cache ``huggingface_hub`` uses with the current environment: ``HF_HUB_CACHE`` (or the older
    ``HUGGINGFACE_HUB_CACHE``), else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub`` (``~/.cache``)."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = os.environ.get("HF_HOME") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
        cache = os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache))).absolute()


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set to a true value."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in _TRUE


def resolve_model_dir(name_or_path: str | os.PathLike, purpose: str, *, local_only: bool = False) -> Path:
    """The local directory ``name_or_path`` names (see the module doc). ``purpose``: ``"checkpoint"`` (config,
    tokenizer and safetensors weights) or ``"tokenizer"`` (config and tokenizer files). ``local_only``: read the
    cache only, never the network (what every rank but the launcher does)."""
    if purpose not in ALLOW_PATTERNS:
        raise ValueError(f"purpose must be one of {tuple(ALLOW_PATTERNS)}, got {purpose!r}")
    text = os.fspath(name_or_path)
    if not is_hub_reference(text):
        if not Path(text).expanduser().exists():
            raise HubModelError(missing_directory(text))
        return Path(text).expanduser()
    cache = hub_cache_dir()
    for done in ((text, purpose, str(cache)), (text, "checkpoint", str(cache))):  # a checkpoint holds a tokenizer
        if done in _RESOLVED:
            return _RESOLVED[done]
    offline = hub_offline() or local_only
    snapshot = _snapshot(text, purpose, cache, offline)
    _check_snapshot(text, purpose, snapshot)
    _RESOLVED[(text, purpose, str(cache))] = snapshot
    return snapshot


def _fill_hint(repo_id: str) -> str:
    return (f"fill it with `hf download {repo_id}` (huggingface-cli download with older huggingface_hub) on a machine "
            "with network and the same HF_HOME / HF_HUB_CACHE, or point HF_HOME / HF_HUB_CACHE at a cache holding it")


def _snapshot(repo_id: str, purpose: str, cache: Path, offline: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                       RepositoryNotFoundError, RevisionNotFoundError)

    why = ("HF_HUB_OFFLINE is set" if hub_offline() else
           "ranks only read the cache: download before launching them" if offline else "the hub could not be reached")
    try:
        path = snapshot_download(repo_id, cache_dir=str(cache), local_files_only=offline,
                                 allow_patterns=list(ALLOW_PATTERNS[purpose]))
    except GatedRepoError:
        raise HubModelError(f"{repo_id} is a gated model on the hub: accept its terms on huggingface.co and log in "
                            f"(`hf auth login`), or {_fill_hint(repo_id)}") from None
    except RepositoryNotFoundError:
        raise HubModelError(f"{repo_id}: no such directory, and the hub has no model of that id (or it is private: "
                            "log in with `hf auth login`)") from None
    except RevisionNotFoundError as exc:
        raise HubModelError(f"{repo_id}: {_first_line(exc)}") from None
    except LocalEntryNotFoundError as exc:  # not cached (or cached in part) and the hub was not asked / not reached
        found = "holds an incomplete snapshot of it" if "incomplete" in str(exc) else "does not hold it"
        raise HubModelError(f"{repo_id} is no local directory, and the Hugging Face cache {cache} {found} ({why}): "
                            + _fill_hint(repo_id)) from None
    except (HfHubHTTPError, OSError) as exc:
        raise HubModelError(f"{repo_id}: download from the hub into {cache} failed ({_first_line(exc)}); "
                            + _fill_hint(repo_id)) from None
    return Path(path)


def _check_snapshot(repo_id: str, purpose: str, snapshot: Path) -> None:
    """A snapshot without the files ``purpose`` needs: an interrupted download, or a repo of another kind."""
    if purpose == "checkpoint":
        if not (snapshot / "config.json").is_file() or not any(snapshot.glob("*.safetensors")):
            raise HubModelError(f"{repo_id}: the snapshot {snapshot} has no config.json and *.safetensors (only "
                                "safetensors models are read; an interrupted download? " + _fill_hint(repo_id) + ")")
    elif not any((snapshot / name).is_file() for name in _TOKENIZER_FILES):
        raise HubModelError(f"{repo_id}: the snapshot {snapshot} has no tokenizer files (an interrupted download? "
                            + _fill_hint(repo_id) + ")")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
