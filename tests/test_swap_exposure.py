"""What a push-enabled server exposes (issue 23, risk 3): the weights listener opens a port only when asked,
where the API server is; vLLM's dev-mode routes need the push token.

The listener and the dev guard run against real servers in ``tests/test_weight_swap.py`` (``TITAN_SWAP_PORT=0``)
and ``tests/test_fleet.py`` (dev mode); these check the start-up decisions and the guard's answers alone.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")


@pytest.mark.parametrize(("raw", "port"), [(None, None), ("", None), ("off", None), ("OFF", None), ("0", 0),
                                           ("8123", 8123)])
def test_listener_only_when_asked(monkeypatch: pytest.MonkeyPatch, raw: str | None, port: int | None) -> None:
    from vllm_titan_plugin.swap import listener

    if raw is None:
        monkeypatch.delenv(listener.PORT_ENV, raising=False)
    else:
        monkeypatch.setenv(listener.PORT_ENV, raw)
    assert listener.wanted_port() == port


@pytest.mark.parametrize("raw", ["-1", "65536", "http", "80 80"])
def test_bad_listener_port_stops_start_up(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    from vllm_titan_plugin.swap import listener

    monkeypatch.setenv(listener.PORT_ENV, raw)
    with pytest.raises(ValueError, match="TITAN_SWAP_PORT"):
        listener.wanted_port()


def test_listener_binds_where_the_api_server_does() -> None:
    from vllm_titan_plugin.swap.listener import bind_host

    assert bind_host(SimpleNamespace(host="127.0.0.1", uds=None)) == "127.0.0.1"
    assert bind_host(SimpleNamespace(host="::1", uds=None)) == "::1"
    assert bind_host(SimpleNamespace(host=None, uds=None)) == "0.0.0.0"  # vLLM itself listens on all then
    # a Unix-socket-only API server opens no TCP port: the one asked for stays on this machine
    assert bind_host(SimpleNamespace(host=None, uds="/tmp/vllm.sock")) == "127.0.0.1"
    assert bind_host(SimpleNamespace(host="0.0.0.0", uds="/tmp/vllm.sock")) == "127.0.0.1"


def test_dev_routes_listed_from_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm import envs

    from vllm_titan_plugin import compat

    monkeypatch.setattr(envs, "VLLM_SERVER_DEV_MODE", False, raising=False)
    assert compat.dev_mode_paths() == frozenset()
    monkeypatch.setattr(envs, "VLLM_SERVER_DEV_MODE", True, raising=False)
    paths = compat.dev_mode_paths()
    assert {"/pause", "/resume", "/collective_rpc", "/reset_prefix_cache"} <= paths, sorted(paths)
    assert not paths & {"/docs", "/openapi.json", "/v1/completions", "/health"}


def test_dev_guard_answers_from_the_headers() -> None:
    import asyncio

    from vllm_titan_plugin.swap.guard import DevRoutesGuard
    from vllm_titan_plugin.swap.state import SwapState

    reached: list[str] = []

    async def inner(scope, receive, send):  # type: ignore[no-untyped-def]
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    state = SwapState("push-token", SimpleNamespace(state=SimpleNamespace()))
    guard = DevRoutesGuard(inner, state, frozenset({"/pause", "/collective_rpc"}))

    def status(path: str, auth: str | None) -> int:
        sent: list[dict] = []

        async def receive():  # type: ignore[no-untyped-def]
            raise AssertionError("the guard read a body")

        async def send(msg):  # type: ignore[no-untyped-def]
            sent.append(msg)

        headers = [(b"authorization", auth.encode())] if auth else []
        asyncio.run(guard({"type": "http", "method": "POST", "path": path, "headers": headers}, receive, send))
        return next(m["status"] for m in sent if m["type"] == "http.response.start")

    assert status("/pause", None) == 401 and status("/pause", "Bearer wrong") == 403
    assert status("/collective_rpc/", "Bearer push-token") == 200
    assert status("/v1/models", None) == 200  # not a dev route: passes (vLLM's own auth applies there)
    assert reached == ["/collective_rpc/", "/v1/models"]
