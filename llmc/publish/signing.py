"""Optional manifest signature: HMAC-SHA256 of manifest.json's bytes, written beside it as manifest.sig.

The key comes from the environment: LLMC_SIGNING_KEY (the key itself) or LLMC_SIGNING_KEY_FILE (a file holding
it; surrounding whitespace is stripped). The MAC covers every byte of manifest.json: the file list and every other
field (recipe, model and data hashes, report). With a key set, an entry without a valid signature is a failure
everywhere: `llmc inspect`/`verify` exit non-zero, and publishing (`llmc build`, `llmc publish`, the registry hook)
republishes it, signed, as it does any entry that differs from its build. Without a key they only say whether
the entry is signed. The key is never printed or logged.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path

from llmc.errors import InputError
from llmc.storage.store import atomic_write_json

SIGNATURE_FILE = "manifest.sig"
KEY_VARIABLE = "LLMC_SIGNING_KEY"
KEY_FILE_VARIABLE = "LLMC_SIGNING_KEY_FILE"
ALGORITHM = "hmac-sha256"


def signing_key() -> bytes | None:
    """The key from the environment, or None when neither variable is set."""
    value, key_file = os.environ.get(KEY_VARIABLE), os.environ.get(KEY_FILE_VARIABLE)
    if value and key_file:
        raise InputError(f"both {KEY_VARIABLE} and {KEY_FILE_VARIABLE} are set",
                         fix=f"set only one of them (prefer {KEY_FILE_VARIABLE}: environments leak into logs)")
    if key_file:
        path = Path(key_file)
        if not path.is_file():
            raise InputError(f"{KEY_FILE_VARIABLE} names {path}, which is not a regular file",
                             fix="point it at a file holding the signing key")
        key = path.read_bytes().strip()
        if not key:
            raise InputError(f"the signing key file {path} is empty", fix="write the key into it")
        return key
    if value is not None:
        if not value:
            raise InputError(f"{KEY_VARIABLE} is set but empty", fix="unset it or give it the key")
        return value.encode()
    return None


def _mac(key: bytes, manifest_bytes: bytes) -> str:
    return hmac.new(key, manifest_bytes, hashlib.sha256).hexdigest()


def sign(entry: Path, key: bytes) -> None:
    """Write <entry>/manifest.sig for <entry>/manifest.json."""
    mac = _mac(key, (Path(entry) / "manifest.json").read_bytes())
    atomic_write_json(Path(entry) / SIGNATURE_FILE, {"algorithm": ALGORITHM, "mac": mac})


def signature_status(entry: Path, key: bytes | None) -> tuple[str, bool]:
    """(what to print, whether it is a failure) for the entry's signature under `key`."""
    sig_path = Path(entry) / SIGNATURE_FILE
    if not sig_path.is_file() or sig_path.is_symlink():
        if key is not None:
            return f"MISSING (a signing key is set, and the entry has no {SIGNATURE_FILE})", True
        return "unsigned", False
    if key is None:
        return f"signed; not checked (set {KEY_VARIABLE} or {KEY_FILE_VARIABLE} to check it)", False
    try:
        sig = json.loads(sig_path.read_text())
        algorithm, mac = sig["algorithm"], sig["mac"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return f"INVALID ({SIGNATURE_FILE} is not a signature llmc wrote)", True
    if algorithm != ALGORITHM or not isinstance(mac, str):
        return f"INVALID (algorithm {str(algorithm)[:20]!r}, expected {ALGORITHM})", True
    if not hmac.compare_digest(mac, _mac(key, (Path(entry) / "manifest.json").read_bytes())):
        return "INVALID (manifest.json or its signature changed, or another key signed it)", True
    return f"valid ({ALGORITHM})", False
