"""The job secret: where it comes from, how long it must be, and what may be derived from it
(docs/ARCHITECTURE.md, "Security").

The secret authenticates FTAR handshakes and catch-up requests and responses. It is never
written to a run's `config.yaml` (`to_yaml` shows "***") and never put on a command line by
our tools. A process finds it, in order:

1. `secret=` in the config, unless it is the redacted marker "***" of a saved config.yaml;
2. `$LFT_SECRET_FILE`: a file holding it (trailing newline stripped); keep it mode 0600;
3. `$LFT_SECRET`.

A secret shorter than `MIN_LENGTH` characters is refused: the job's fingerprint in etcd
carries a tag derived from it (`tag`), and a short secret could be guessed from that tag
offline. `lightning-ft run` on one host generates one when none is given.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets as _random
from typing import Mapping, Optional

MIN_LENGTH = 16
"""Shortest accepted secret, in characters (a generated one has 32 hex digits)."""
REDACTED = "***"
"""What a saved config.yaml shows instead of the secret."""
FILE_ENV, VALUE_ENV = "LFT_SECRET_FILE", "LFT_SECRET"


class SecretError(ValueError):
    """No usable secret: missing, redacted, unreadable or too short. The message says what to do."""


def check(secret: str, where: str) -> str:
    """`secret` if it is usable, else SecretError naming `where` it came from."""
    if secret == REDACTED:
        raise SecretError(f"{where} is the redacted placeholder {REDACTED!r} of a saved config.yaml, not a secret; "
                          f"give the job's secret through ${FILE_ENV} (a file, mode 0600) or ${VALUE_ENV}")
    if len(secret) < MIN_LENGTH:
        raise SecretError(f"{where} is {len(secret)} characters long; a job secret needs at least {MIN_LENGTH} "
                          f"(e.g. `python -c 'import secrets; print(secrets.token_hex(16))' > secret.txt; "
                          f"chmod 600 secret.txt; export {FILE_ENV}=$PWD/secret.txt`)")
    return secret


def read_file(path: str) -> str:
    """The secret stored in `path` (one line; surrounding whitespace stripped)."""
    try:
        with open(path) as f:
            value = f.read().strip()
    except OSError as e:
        raise SecretError(f"${FILE_ENV}={path}: cannot read the secret file: {e.strerror or e}") from None
    return check(value, f"the secret in {FILE_ENV}={path}")


def resolve(configured: str = "", environ: Optional[Mapping[str, str]] = None, required: bool = True) -> str:
    """The job secret (see the module docstring); "" when none is given and not `required`."""
    env = os.environ if environ is None else environ
    if configured and configured != REDACTED:
        return check(configured, "the config's `secret`")
    if env.get(FILE_ENV):
        return read_file(env[FILE_ENV])
    if env.get(VALUE_ENV):
        return check(env[VALUE_ENV], f"${VALUE_ENV}")
    if configured == REDACTED:
        check(configured, "the config's `secret`")  # raises, with what to do
    if required:
        raise SecretError(f"no job secret: set ${FILE_ENV} to a file holding it (mode 0600), or ${VALUE_ENV}; "
                          f"every replica of a job needs the same one")
    return ""


def generate() -> str:
    return _random.token_hex(16)


def write_file(path: str, secret: str) -> None:
    """Store `secret` in a new file only its owner can read."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")


def tag(secret: str, job: str) -> str:
    """A short public tag of (secret, job): equal tags mean the same secret, and the tag
    reveals nothing usable about it (HMAC; the secret is long, see MIN_LENGTH)."""
    return hmac.new(secret.encode(), f"lightning-ft job tag|{job}".encode(), hashlib.sha256).hexdigest()[:16]
