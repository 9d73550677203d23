"""A key the user controls, and the HMAC-SHA256 signature it puts on a checkpoint's manifest.

The manifest (``manifest.py``) lists every file of a checkpoint with its size and SHA-256. Alone it proves
integrity: a file that changed by accident (a truncated shard, flipped bits) no longer matches. It does not prove
who wrote it: anyone who can write the directory can change a file and write a new manifest. With a key, the
manifest also carries ``HMAC-SHA256(key, the manifest's content)``; without the key nobody can make a manifest
that verifies, so a signed checkpoint that verifies was written by a holder of the key and not changed since.

The key (at least :data:`MIN_KEY_BYTES` bytes) comes from the environment, never from the checkpoint:

- ``DYNAMO_CHECKPOINT_KEY``: the key itself;
- ``DYNAMO_CHECKPOINT_KEY_FILE``: a file holding it (one trailing newline is ignored), outside the checkpoint.

Only one of the two may be set. The manifest names the key by :attr:`SigningKey.key_id` (a hash of the key that
reveals nothing of it), so that a checkpoint signed with another key is said to be so.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

KEY_ENV = "DYNAMO_CHECKPOINT_KEY"
KEY_FILE_ENV = "DYNAMO_CHECKPOINT_KEY_FILE"
MIN_KEY_BYTES = 16
SIGNATURE_ALGORITHM = "hmac-sha256"


class CheckpointKeyError(ValueError):
    """The configured key cannot be used (too short, unreadable file, both variables set); one line."""


@dataclass(frozen=True)
class SigningKey:
    secret: bytes
    source: str  # "$DYNAMO_CHECKPOINT_KEY" or the key file's path, for messages

    @property
    def key_id(self) -> str:
        return hashlib.sha256(b"megatron_dynamo checkpoint key id\0" + self.secret).hexdigest()[:16]

    def sign(self, body: Mapping[str, Any]) -> dict[str, str]:
        """The signature entry of a manifest whose signed content is ``body``."""
        return {"algorithm": SIGNATURE_ALGORITHM, "key_id": self.key_id,
                "hmac": hmac.new(self.secret, canonical_bytes(body), hashlib.sha256).hexdigest()}

    def problem(self, body: Mapping[str, Any], signature: Any) -> str | None:
        """Why ``signature`` does not prove ``body`` with this key (a phrase), or None when it does."""
        if not signature:
            return f"manifest.json is not signed (a key is configured: {self.source})"
        if not isinstance(signature, dict) or signature.get("algorithm") != SIGNATURE_ALGORITHM:
            return "manifest.json's signature is not an HMAC-SHA256 signature"
        if signature.get("key_id") != self.key_id:
            return (f"manifest.json is signed with another key (key id {signature.get('key_id')!r}; "
                    f"{self.source} is {self.key_id})")
        expected = self.sign(body)["hmac"]
        if not hmac.compare_digest(str(signature.get("hmac", "")), expected):
            return "manifest.json's signature does not match its content (changed after it was signed)"
        return None


def canonical_bytes(body: Mapping[str, Any]) -> bytes:
    """The bytes an HMAC covers: ``body`` as JSON with sorted keys and no whitespace."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def signing_key(environ: Mapping[str, str] | None = None) -> SigningKey | None:
    """The key configured in the environment (see the module doc), or None. Raises CheckpointKeyError."""
    environ = os.environ if environ is None else environ
    value, file = environ.get(KEY_ENV), environ.get(KEY_FILE_ENV)
    if value and file:
        raise CheckpointKeyError(f"both {KEY_ENV} and {KEY_FILE_ENV} are set: set one")
    if file:
        path = Path(file).expanduser()
        try:
            secret = path.read_bytes()
        except OSError as exc:
            raise CheckpointKeyError(f"{KEY_FILE_ENV}={file}: {exc.strerror or exc}") from None
        secret, source = secret[:-1] if secret.endswith(b"\n") else secret, str(path.absolute())
    elif value:
        secret, source = value.encode("utf-8"), f"${KEY_ENV}"
    else:
        return None
    if len(secret) < MIN_KEY_BYTES:
        raise CheckpointKeyError(f"the checkpoint key from {source} has {len(secret)} bytes; use at least "
                                 f"{MIN_KEY_BYTES} random bytes (e.g. `openssl rand -hex 32`)")
    return SigningKey(secret, source)


def key_inside(key: SigningKey | None, directory: str | os.PathLike) -> bool:
    """Whether ``key`` was read from a file inside ``directory`` (a key shipped with the checkpoint proves
    nothing)."""
    if key is None or key.source.startswith("$"):
        return False
    return Path(key.source).resolve().is_relative_to(Path(directory).resolve())


def trust_line(key: SigningKey | None) -> str:
    """What checking a checkpoint proves with this key (or without one), in one line."""
    if key is None:
        return (f"checkpoints are checked for integrity only (SHA-256 of every file): without a key anyone who "
                f"can write them can also rewrite their manifest; set {KEY_ENV} or {KEY_FILE_ENV} to sign and "
                "verify them")
    return f"checkpoints are signed and verified with HMAC-SHA256 (key {key.key_id} from {key.source})"
