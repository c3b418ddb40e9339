"""Authentication of everything a job deserializes: HMAC-SHA256 under a per-job secret.

The rendezvous store and the ring's sockets are reachable by anyone on the
network, so nothing read from them is trusted until its MAC checks:

* :func:`seal` / :func:`unseal` bind bytes to a *domain* (what kind of value)
  and a *name* (the store key, or the collective and its sequence number), so a
  genuine value cannot be replayed under another key or in another collective.
* :func:`seal_json` / :func:`unseal_json` do the same for plain JSON messages.
* :class:`AuthenticatedStore` wraps a ``torch.distributed`` store: every value
  it sets is sealed under its key, every value it gets is unsealed. It is what
  gloo's own rendezvous and the NCCL unique-id exchange run on, so a forged
  address or id is refused before gloo or NCCL see it.

A forged value is never deserialized. When the genuine value can still arrive
(a store key that its owner has not written yet), the reader waits for it for
a bounded time; otherwise :class:`AuthenticationError` names the key.

The secret never travels through the store or the ring: the Ray driver hands
it to its workers through Ray (protected by Ray's token authentication when the
cluster uses it); without Ray, share it out of band.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import secrets
import time
from typing import Any, Sequence

import torch.distributed as dist

from .errors import AuthenticationError

MAC_BYTES = 32
MIN_SECRET_BYTES = 16
_TAG = b"ER1"
#: How long a reader of a store key waits for the genuine value after reading a forged one.
FORGED_GRACE_S = 2.0
_RECHECK_S = 0.05


def new_secret() -> bytes:
    """A fresh 32-byte job secret."""
    return secrets.token_bytes(32)


def check_secret(secret: object, what: str = "auth_key") -> bytes:
    """``secret`` as bytes, or a ValueError that names the problem and the fix."""
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_BYTES:
        shown = f"{len(secret)} bytes" if isinstance(secret, (bytes, bytearray)) else type(secret).__name__
        raise ValueError(f"{what} must be a secret of at least {MIN_SECRET_BYTES} bytes shared by every rank "
                         f"(got {shown}); make one with elastic_ring.core.auth.new_secret() and hand it to every "
                         "rank out of band (ElasticTrainer does this for you)")
    return bytes(secret)


def mac(secret: bytes, domain: str, name: str, data: bytes) -> bytes:
    """HMAC-SHA256 over the length-prefixed domain and name, then the data."""
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for part in (domain.encode(), name.encode()):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    h.update(data)
    return h.digest()


def seal(secret: bytes, domain: str, name: str, data: bytes) -> bytes:
    return _TAG + mac(secret, domain, name, data) + data


def verify(secret: bytes, domain: str, name: str, sealed: bytes) -> bytes | None:
    """The data inside ``sealed`` if its MAC checks, else None."""
    if len(sealed) < len(_TAG) + MAC_BYTES or not sealed.startswith(_TAG):
        return None
    tag, data = sealed[len(_TAG):len(_TAG) + MAC_BYTES], sealed[len(_TAG) + MAC_BYTES:]
    return data if hmac.compare_digest(tag, mac(secret, domain, name, data)) else None


def unseal(secret: bytes, domain: str, name: str, sealed: bytes) -> bytes:
    data = verify(secret, domain, name, sealed)
    if data is None:
        raise AuthenticationError(f"{domain} {name!r} failed authentication: it was not written by a member of "
                                  "this job (or was damaged), so it was not used; something else on the network "
                                  "writes to the job's rendezvous store or sockets: see the README's Security section")
    return data


def seal_json(secret: bytes, name: str, obj: Any) -> str:
    """``obj`` (plain JSON data) as ASCII text: hex MAC, then the JSON."""
    text = json.dumps(obj, separators=(",", ":"), default=str)
    return mac(secret, "json", name, text.encode()).hex() + text


def unseal_json(secret: bytes, name: str, text: str | bytes) -> Any:
    """The JSON value inside a :func:`seal_json` message; AuthenticationError if forged."""
    raw = text.encode() if isinstance(text, str) else bytes(text)
    width = 2 * MAC_BYTES
    try:
        tag = bytes.fromhex(raw[:width].decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        tag = b""
    body = raw[width:]
    if len(tag) != MAC_BYTES or not hmac.compare_digest(tag, mac(secret, "json", name, body)):
        raise AuthenticationError(f"message on {name!r} failed authentication: it was not sent by a member of this "
                                  "job, so it was ignored")
    return json.loads(body)


class AuthenticatedStore(dist.Store):
    """A store whose values are sealed under their keys (see the module docstring).

    ``add`` counters cannot be sealed (the server does the arithmetic): use them
    only as hints, never as data. ``get`` of a forged value waits up to
    ``forged_grace_s`` for the genuine one to overwrite it, then raises
    :class:`AuthenticationError` naming the key.
    """

    def __init__(self, store: dist.Store, secret: bytes, forged_grace_s: float = FORGED_GRACE_S) -> None:
        super().__init__()
        self._inner = store
        self._secret = check_secret(secret)
        self._grace_s = forged_grace_s
        self.forged_reads = 0

    @property
    def inner(self) -> dist.Store:
        return self._inner

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(key, seal(self._secret, "store", key, data))

    def get(self, key: str) -> bytes:
        raw = self._inner.get(key)
        data = verify(self._secret, "store", key, raw)
        if data is not None:
            return data
        self.forged_reads += 1
        deadline = time.monotonic() + self._grace_s
        while time.monotonic() < deadline:  # only on the forged path: the genuine writer may not have written yet
            time.sleep(_RECHECK_S)
            latest = self._inner.get(key)
            if latest != raw:
                data = verify(self._secret, "store", key, latest)
                if data is not None:
                    return data
                raw = latest
        return unseal(self._secret, "store", key, raw)  # raises, naming the key

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def check(self, keys: Sequence[str]) -> bool:
        return self._inner.check(list(keys))

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(list(keys))
        else:
            self._inner.wait(list(keys), timeout)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)

    @property
    def timeout(self) -> datetime.timedelta:
        return self._inner.timeout

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        raise NotImplementedError("compare_set is not supported on an AuthenticatedStore (a sealed value cannot be "
                                  "compared by the server)")
