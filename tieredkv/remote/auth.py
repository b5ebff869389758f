"""The fleet secret: where it comes from, and the two keys the remote tier derives from it.

Any client that can reach a shared store can write any name in it. Values are authenticated with
HMAC-SHA256 under a key only the fleet holds, and names are keyed digests, so such a client can neither
forge a value the fleet accepts nor learn which tokens a name stands for (docs/fleet.md says what a
reader of the store still learns).

The secret is read, first found wins, from:

1. ``RemoteTier(..., secret=b"...")`` (bytes, for code that has it from a secret manager);
2. the URL option ``secret_file=PATH`` (the path, never the secret itself, is in the URL);
3. the file named by the environment variable ``TIEREDKV_REMOTE_SECRET_FILE``;
4. the environment variable ``TIEREDKV_REMOTE_SECRET``.

A secret is at least ``MIN_SECRET_BYTES`` bytes (a file's trailing newline does not count). With none
of them, opening a remote tier fails, unless the operator opts out explicitly with ``insecure=1`` in the
URL (or ``insecure=True``): values then carry a MAC under a public key, which catches damage but not
forgery, and names can be computed by anyone who guesses a prompt.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass, field
from pathlib import Path

from tieredkv.errors import InvalidInput

ENV_SECRET = "TIEREDKV_REMOTE_SECRET"
ENV_SECRET_FILE = "TIEREDKV_REMOTE_SECRET_FILE"
#: 128 bits: what a random secret must at least carry.
MIN_SECRET_BYTES = 16
#: The key of a fleet that opted out (``insecure=1``): public, so it authenticates nothing.
INSECURE_SECRET = b"tieredkv: no fleet secret (insecure=1)"
#: URL options this module reads.
AUTH_OPTIONS = ("secret_file", "insecure", "secret")  # "secret" only to refuse it
MAC_BYTES = 32
NAME_DIGEST_BYTES = 16


@dataclass(frozen=True)
class FleetKey:
    """The keys derived from one fleet secret.

    Attributes:
        authenticated: False for the public key of ``insecure=1``.
        source: where the secret came from, for messages (never the secret).
    """

    mac_key: bytes = field(repr=False)
    name_key: bytes = field(repr=False)
    authenticated: bool
    source: str

    @classmethod
    def from_secret(cls, secret: bytes, source: str, authenticated: bool = True) -> FleetKey:
        # Two independent keys: a name digest never doubles as a value's MAC.
        return cls(mac_key=hmac.digest(secret, b"tieredkv remote value MAC v2", "sha256"),
                   name_key=hmac.digest(secret, b"tieredkv remote names v2", "sha256"),
                   authenticated=authenticated, source=source)

    def mac(self) -> hmac.HMAC:
        """A fresh HMAC-SHA256 under the value key (``update`` it with what it covers)."""
        return hmac.new(self.mac_key, digestmod=hashlib.sha256)

    def name_digest(self, message: bytes) -> bytes:
        """The keyed 128-bit digest that names a block."""
        return hmac.digest(self.name_key, message, "sha256")[:NAME_DIGEST_BYTES]

    def namespace_tag(self, fingerprint: str) -> str:
        """The keyed tag of a namespace in names (16 hex digits): a store reader cannot tell which model
        it is; an operator with the secret can (``tieredkv ls --remote`` and ``namespace_tag``)."""
        return hmac.digest(self.name_key, b"namespace:" + fingerprint.encode(), "sha256")[:8].hex()


def _read_file(path: str, what: str) -> bytes:
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as e:
        raise InvalidInput(f"cannot read the remote tier's secret file {path!r} ({what}): "
                           f"{e.strerror or e}") from None
    return data.rstrip(b"\r\n")


def load_key(options: dict[str, str], secret: bytes | None = None, insecure: bool | None = None) -> FleetKey:
    """The fleet key for a remote tier, from the sources in the module docstring.

    Args:
        options: the URL's options; ``secret_file`` and ``insecure`` are taken out of it.
        secret: the secret itself (bytes), if the caller has it.
        insecure: opt out of authentication (overrides the URL's ``insecure``).

    Raises:
        InvalidInput: no secret and no opt-out, a secret in the URL, an unreadable or short secret.
    """
    if "secret" in options:
        raise InvalidInput("never put the remote tier's secret in a URL (it ends up on command lines and in "
                           "logs): use secret_file=PATH or the environment variable " + ENV_SECRET_FILE)
    path = options.pop("secret_file", None)
    flag = options.pop("insecure", None)
    if insecure is None:
        if flag not in (None, "0", "1", "true", "false"):
            raise InvalidInput(f"URL option insecure={flag!r} must be 0 or 1")
        insecure = flag in ("1", "true")
    if secret is not None:
        if not isinstance(secret, (bytes, bytearray)):
            raise InvalidInput(f"secret must be bytes, got {type(secret).__name__}")
        raw, source = bytes(secret), "the secret argument"
    elif path:
        raw, source = _read_file(path, "URL option secret_file"), f"file {path}"
    elif os.environ.get(ENV_SECRET_FILE):
        env_path = os.environ[ENV_SECRET_FILE]
        raw, source = _read_file(env_path, ENV_SECRET_FILE), f"file {env_path} (from {ENV_SECRET_FILE})"
    elif os.environ.get(ENV_SECRET):
        raw, source = os.environ[ENV_SECRET].encode(), f"environment variable {ENV_SECRET}"
    elif insecure:
        return FleetKey.from_secret(INSECURE_SECRET, "insecure=1 (no secret)", authenticated=False)
    else:
        raise InvalidInput(
            "a remote tier needs the fleet's secret, so that no other client of the store can forge or read "
            f"names of your KV: set {ENV_SECRET_FILE}=PATH (a file holding at least {MIN_SECRET_BYTES} random "
            f"bytes, e.g. `head -c 32 /dev/urandom | base64 > PATH`), or {ENV_SECRET}, or secret_file=PATH in "
            "the URL; or opt out with insecure=1 in the URL (anyone who can write the store can then forge KV)")
    if len(raw) < MIN_SECRET_BYTES:
        raise InvalidInput(f"the remote tier's secret from {source} has {len(raw)} bytes; it needs at least "
                           f"{MIN_SECRET_BYTES} (random)")
    return FleetKey.from_secret(raw, source)
