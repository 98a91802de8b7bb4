"""Signed requests to a generator's swap routes: the token authorises one request, never travels.

``Authorization: Bearer <token>`` sends the secret itself; on plain HTTP anyone who sees one push can replay it
(with another ``version`` in the query, to another boot of the server) or send their own. A signed request
instead carries ``Authorization: Titan-HMAC nonce=<hex>, ts=<unix s>, sig=<hex>``, where ``sig`` is the
HMAC-SHA256 under the token of the method, the path, the sorted query, the server's boot id, the nonce and
the time. The server recomputes it with its own boot id, refuses a time more than ``MAX_SKEW_S`` away from
its clock, and refuses a nonce it has seen (``NonceLedger``). So a captured request works once, on that
boot, for that exact query: a replay, a changed version or a restarted server gets 401/403. The body is
not signed (it is authorised before a byte of it is read); a swapped body still has to pass the names,
shapes, dtypes and NaN checks, and the next signed push replaces it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping

SCHEME = "Titan-HMAC"
MAX_SKEW_S = 300.0


def _canonical(method: str, path: str, query: Iterable[tuple[str, str]], boot_id: str, nonce: str, ts: int) -> bytes:
    q = "&".join(f"{k}={v}" for k, v in sorted((str(k), str(v)) for k, v in query))
    return "\n".join((method.upper(), path, q, boot_id, nonce, str(ts))).encode()


def _pairs(query: Mapping[str, str] | Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    return list(query.items()) if isinstance(query, Mapping) else list(query)


def signature(token: bytes, method: str, path: str, query: Mapping[str, str] | Iterable[tuple[str, str]],
              boot_id: str, nonce: str, ts: int) -> str:
    return hmac.new(token, _canonical(method, path, _pairs(query), boot_id, nonce, ts), hashlib.sha256).hexdigest()


def authorization(token: str, method: str, path: str, query: Mapping[str, str], boot_id: str,
                  now: float | None = None) -> str:
    """The ``Authorization`` header value of one signed request to the server whose boot id is ``boot_id``."""
    nonce, ts = secrets.token_hex(16), int(time.time() if now is None else now)
    sig = signature(token.encode(), method, path, query, boot_id, nonce, ts)
    return f"{SCHEME} nonce={nonce}, ts={ts}, sig={sig}"


def parse(value: str) -> tuple[str, int, str]:
    """(nonce, ts, sig) of a ``Titan-HMAC`` header value; ``ValueError`` naming what is wrong."""
    scheme, _, rest = value.partition(" ")
    if scheme != SCHEME:
        raise ValueError(f"not a {SCHEME} authorization")
    fields = dict(part.strip().partition("=")[::2] for part in rest.split(",") if part.strip())
    missing = [k for k in ("nonce", "ts", "sig") if not fields.get(k)]
    if missing:
        raise ValueError(f"{SCHEME} authorization lacks {', '.join(missing)}")
    try:
        ts = int(fields["ts"])
    except ValueError:
        raise ValueError(f"{SCHEME} ts must be an integer") from None
    return fields["nonce"], ts, fields["sig"]


class NonceLedger:
    """The nonces of signed requests accepted within the last ``MAX_SKEW_S`` (older ones are refused by
    their time anyway), bounded in count so that a flood of valid requests cannot grow it without limit."""

    def __init__(self, max_entries: int = 100_000) -> None:
        self._seen: OrderedDict[str, float] = OrderedDict()
        self.max_entries = max_entries

    def admit(self, nonce: str, ts: int, now: float | None = None) -> str | None:
        """None if (nonce, ts) is fresh, and records it; else why not."""
        now = time.time() if now is None else now
        if abs(now - ts) > MAX_SKEW_S:
            return f"request time {ts} is more than {MAX_SKEW_S:.0f} s from the server's clock"
        while self._seen and (next(iter(self._seen.values())) < now - 2 * MAX_SKEW_S or len(self._seen) >= self.max_entries):
            self._seen.popitem(last=False)
        if nonce in self._seen:
            return "replayed request (nonce already used)"
        self._seen[nonce] = now
        return None
