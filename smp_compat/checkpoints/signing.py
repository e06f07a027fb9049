"""A keyed digest beside every file smp_compat saves, so a job's own checkpoints load in full, and only those.

Safe loading refuses classes that are not data (a class of the script in ``user_content``), which
is right for a file from elsewhere and wrong for the file this job wrote an hour ago. At save, the
file's HMAC-SHA256 under a per-user secret key goes into ``<file>.hmac``; at load, a file that safe
loading refuses still loads in full when that digest verifies. A file smp_compat did not write, one
changed since, or one written under another key has no valid digest and is refused as before.

The key (32 random bytes, hex) is created on first use, mode 0600, in
``$XDG_CONFIG_HOME/smp_compat/checkpoint.key`` (``~/.config/...``), or at the path in
``SMP_COMPAT_CHECKPOINT_KEY_FILE`` (for clusters whose nodes share no home directory: point every node
at one copy). Whoever can read the key can make any file load in full: keep it private.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from smp_compat.errors import CheckpointError

__all__ = ["KEY_ENV", "SUFFIX", "DigestingWriter", "digest_path", "describe_key", "existing_key", "key_path", "new_mac",
           "user_key", "verifies"]

KEY_ENV = "SMP_COMPAT_CHECKPOINT_KEY_FILE"
"""The key file's path, when the default in the user's config directory will not do."""

SUFFIX = ".hmac"
"""``<file>.hmac`` holds ``<file>``'s digest, in hex."""

_DOMAIN = b"smp_compat checkpoint v1\0"  # a digest made here means nothing to any other use of the key


def key_path(environ: Mapping[str, str] | None = None) -> Path:
    """``$SMP_COMPAT_CHECKPOINT_KEY_FILE``, else ``$XDG_CONFIG_HOME/smp_compat/checkpoint.key``."""
    env = os.environ if environ is None else environ
    if env.get(KEY_ENV, "").strip():
        return Path(env[KEY_ENV].strip()).expanduser()
    config = env.get("XDG_CONFIG_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".config")
    return Path(config) / "smp_compat" / "checkpoint.key"


def describe_key(environ: Mapping[str, str] | None = None) -> str:
    """Where the key is, where that came from and whether it exists: a restart in a fresh container that
    makes a new key cannot verify the job's own digests (its data-only files still load)."""
    env = os.environ if environ is None else environ
    path = key_path(env)
    if env.get(KEY_ENV, "").strip():
        source = f"from {KEY_ENV}"
    else:
        source = "in $XDG_CONFIG_HOME" if env.get("XDG_CONFIG_HOME", "").strip() else "in the home folder"
        source += f": if homes are not kept across restarts, set {KEY_ENV} to persistent storage or a secret mount"
    state = "exists" if path.is_file() else "not made yet: the first save makes it"
    return f"{path} ({state}; {source})"


def _read_key(path: Path) -> bytes:
    """The key, refused when others may read it (then anyone could make a file load in full)."""
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CheckpointError(
            f"The checkpoint key {path} can be read or written by other users (mode {stat.filemode(mode)}); "
            f"anyone who reads it could make a file load in full. Run `chmod 600 {path}`."
        )
    try:
        key = bytes.fromhex(path.read_text(encoding="ascii").strip())
    except (ValueError, UnicodeDecodeError):
        key = b""
    if len(key) < 16:
        raise CheckpointError(
            f"The checkpoint key {path} is not 16 or more bytes in hex; delete it to get a new one (files signed "
            "with it will then load safely only)."
        )
    return key


def _create_key(path: Path) -> None:
    """Write a new key atomically; when another process got there first, keep its key."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="ascii") as handle:
            handle.write(secrets.token_hex(32) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(tmp, path)  # fails if the key exists: never replace a key in use
        except FileExistsError:
            pass
    finally:
        Path(tmp).unlink(missing_ok=True)


def existing_key() -> bytes | None:
    """This user's key, or None when there is none yet (then no digest verifies)."""
    try:
        return _read_key(key_path())
    except FileNotFoundError:
        return None


def user_key() -> bytes:
    """This user's key, created on first use (saving)."""
    key = existing_key()
    if key is not None:
        return key
    path = key_path()
    try:
        _create_key(path)
    except OSError as exc:
        raise CheckpointError(
            f"Cannot create the checkpoint key {path} ({exc}). Set {KEY_ENV} to a writable path of your own."
        ) from None
    return _read_key(path)


def new_mac(key: bytes) -> Any:
    """An HMAC-SHA256 to feed a file's bytes to."""
    return hmac.new(key, _DOMAIN, hashlib.sha256)


def digest_path(path: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(path)}{SUFFIX}")


def verifies(path: str | os.PathLike[str], data: bytes) -> bool:
    """Whether ``data`` (the bytes of ``path``) carries a valid digest under this user's key."""
    try:
        recorded = digest_path(path).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return False
    key = existing_key()
    if key is None:
        return False
    mac = new_mac(key)
    mac.update(data)
    return hmac.compare_digest(mac.hexdigest(), recorded)


class DigestingWriter:
    """A write-only file that feeds every byte to ``mac`` on its way to ``handle`` (one pass, no re-read)."""

    def __init__(self, handle: BinaryIO, mac: Any) -> None:
        self._handle = handle
        self._mac = mac

    def write(self, data: Any) -> int:
        self._mac.update(data)
        return self._handle.write(data)

    def flush(self) -> None:
        self._handle.flush()
