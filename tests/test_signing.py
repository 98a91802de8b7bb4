"""``wire.signing``: a signed swap request authorises itself once, for its own method, path and query, on one
boot of the server; the token never travels. Pure functions here; the server-side check against a real
server is ``tests/test_weight_swap.py::test_signed_push_cannot_be_replayed``."""

from __future__ import annotations

import pytest

from titan_rl_ext.wire import signing

TOKEN = b"t0ken"
BOOT = "boot-a"


def _sig(method: str = "POST", path: str = "/titan/v1/weights", query: dict[str, str] | None = None,
         boot: str = BOOT, nonce: str = "n1", ts: int = 1000) -> str:
    return signing.signature(TOKEN, method, path, query if query is not None else {"version": "3", "mode": "keep"},
                             boot, nonce, ts)


def test_signature_binds_every_part_of_the_request() -> None:
    base = _sig()
    assert base == _sig(query={"mode": "keep", "version": "3"})  # query order does not matter
    for changed in (_sig(method="GET"), _sig(path="/titan/v1/batch_invariant"), _sig(query={"version": "4", "mode": "keep"}),
                    _sig(boot="boot-b"), _sig(nonce="n2"), _sig(ts=1001),
                    signing.signature(b"other", "POST", "/titan/v1/weights", {"version": "3", "mode": "keep"}, BOOT, "n1", 1000)):
        assert changed != base


def test_header_round_trip_and_malformed_headers() -> None:
    value = signing.authorization("t0ken", "POST", "/p", {"version": "1"}, BOOT, now=5000)
    nonce, ts, sig = signing.parse(value)
    assert ts == 5000 and sig == signing.signature(TOKEN, "POST", "/p", {"version": "1"}, BOOT, nonce, ts)
    assert "t0ken" not in value
    for bad, why in (("Bearer x", "not a"), (f"{signing.SCHEME} nonce=a, ts=1", "lacks sig"),
                     (f"{signing.SCHEME} nonce=a, ts=x, sig=b", "integer")):
        with pytest.raises(ValueError, match=why):
            signing.parse(bad)


def test_nonce_ledger_refuses_replays_and_stale_times() -> None:
    ledger = signing.NonceLedger()
    assert ledger.admit("n1", 1000, now=1000) is None
    assert "replayed" in ledger.admit("n1", 1000, now=1001)
    assert ledger.admit("n2", 1000, now=1001) is None
    assert "more than" in ledger.admit("n3", 1000, now=1000 + signing.MAX_SKEW_S + 1)
    assert "more than" in ledger.admit("n4", 2000, now=1000)  # from the future too
    small = signing.NonceLedger(max_entries=2)
    for i in range(5):
        assert small.admit(f"m{i}", 1000, now=1000) is None
    assert len(small._seen) <= 2  # bounded
