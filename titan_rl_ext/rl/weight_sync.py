"""Trainer side of the weight push: every generator gets the titan state dict through one weight transport.

The generators run vLLM with ``--model-impl titan`` and ``TITAN_SWAP_TOKEN`` set
(``vllm_titan_plugin.swap_endpoint``). ``WeightPusher`` addresses them (their weights listener or OpenAI
port, requests signed for each server's boot) and pushes through the transport named by ``transport``
(``titan_rl_ext.rl.transports``: ``safetensors`` bytes over HTTP, never pickle, ``cuda_ipc`` handles on
one host, or ``titan_gloo``/``titan_gloo_relay``: a broadcast through vLLM's weight-transfer calls). Each server validates all of a push before touching any weight and swaps in place.
``checksum`` is the function both sides use, so the trainer can compare its tensors with
``GET /titan/v1/weights/checksums`` bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from titan_rl_ext.rl.transports import WeightTransport, make_transport
from titan_rl_ext.rl.transports.base import OCTET_STREAM, PushResult, Staged, push_through

# the protocol's names and bytes live in titan_rl_ext.wire (the serving plugin imports them too); re-exported
# here for the trainer's callers
from titan_rl_ext.wire.protocol import (
    BI_ROUTE, CHECKSUMS_ROUTE, MODES, PUSH_PORT_FIELD, VERSION_ROUTE, WEIGHTS_ROUTE,
)
from titan_rl_ext.wire.weights import checksum, serialize, tensor_checksum

__all__ = ["BI_ROUTE", "WEIGHTS_ROUTE", "WeightPushError", "WeightPusher", "checksum", "serialize",
           "tensor_checksum"]


class WeightPushError(RuntimeError):
    """A generator rejected a push (or could not be reached). ``results`` holds every server's answer."""

    def __init__(self, message: str, results: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.results = results


class WeightPusher:
    """Push full titan state dicts to generator servers.

    ``urls`` are server base URLs (``http://host:port``); ``token`` is the servers' ``TITAN_SWAP_TOKEN``.
    ``mode="keep"`` lets in-flight requests continue with their KV cache on the new weights;
    ``"recompute"`` preempts them so they recompute with the new weights.
    """

    def __init__(self, urls: list[str], token: str, timeout_s: float = 600.0, transport: str = "safetensors",
                 use_listener: bool = True, pause: bool = False,
                 transport_options: Mapping[str, Any] | None = None) -> None:
        """``transport``: a name registered in ``titan_rl_ext.rl.transports``; ``transport_options``: that
        transport's own settings (``titan_gloo``: its store's address and port, bucket size, ...)."""
        if not urls:
            raise ValueError("WeightPusher needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self._token = token  # never sent: every request carries a signature made with it (``wire.signing``)
        self.timeout_s = timeout_s
        self._push_urls: dict[str, tuple[str, str]] = {}  # server URL -> (its boot id, where its pushes go)
        self.use_listener = use_listener  # False: push through the OpenAI port (what a listener-less server has)
        self.pause = pause  # True: the servers pause their scheduler around the copy (the long way)
        self.transport_name = transport
        self.transport_options = dict(transport_options or {})
        self.transport: WeightTransport = make_transport(transport, self)

    def push(self, state_dict: Mapping[str, torch.Tensor], version: int, mode: str = "keep") -> list[dict[str, Any]]:
        """Stage once, send to every server concurrently; returns each server's JSON answer
        (``version``, ``num_tensors``, ``bytes``, ``swap_seconds``, ``validate_seconds``, ``in_flight``: the
        requests that straddle the swap). Raises
        ``WeightPushError`` naming every server that rejected the push."""
        return self._checked(self.push_each(state_dict, version, mode), version)

    def push_payload(self, payload: bytes, version: int, mode: str = "keep") -> list[dict[str, Any]]:
        """``push`` of an already serialised state dict (``serialize``): lets a caller serialise in one
        thread or process and send from another. Only for a transport that sends those bytes (``stage_bytes``)."""
        stage_bytes: Callable[[bytes], Staged] | None = getattr(self.transport, "stage_bytes", None)
        if stage_bytes is None:
            raise ValueError(f"push_payload sends safetensors bytes; transport {self.transport_name!r} stages its own")
        params = self._params(version, mode)
        return self._checked(push_through(self.transport, self.urls, stage_bytes(payload), params), version)

    def push_each(self, state_dict: Mapping[str, torch.Tensor], version: int, mode: str = "keep",
                  on_result: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        """``push`` without raising: one ``{"url", "ok", "status", "response" | "error"}`` per server, in
        ``urls`` order (what a fleet needs to decide who stays in the rollout pool). ``on_result`` gets each
        server's as soon as it answers (from a pusher thread), before the slowest server has."""
        params = self._params(version, mode)
        # a broadcast transport reaches every generator in one collective, not one send per generator
        push_all: Callable[..., list[PushResult]] | None = getattr(self.transport, "push_all", None)
        if push_all is not None:
            return push_all(self.urls, state_dict, params, on_result)
        return push_through(self.transport, self.urls, self.transport.stage(state_dict), params, on_result)

    def _params(self, version: int, mode: str) -> dict[str, str]:
        """The push's query, whatever the transport adds to it."""
        if mode not in MODES:
            raise ValueError(f"mode must be 'keep' or 'recompute', got {mode!r}")
        return {"version": str(int(version)), "mode": mode, **({"pause": "1"} if self.pause else {})}

    @staticmethod
    def _checked(results: list[dict[str, Any]], version: int) -> list[dict[str, Any]]:
        failed = [r for r in results if not r["ok"]]
        if failed:
            lines = "; ".join(f"{r['url']}: HTTP {r['status']} {r['error']}" for r in failed)
            raise WeightPushError(f"weight push v{version} rejected by {len(failed)}/{len(results)} server(s): {lines}",
                                  results)
        return [r["response"] for r in results]

    def set_batch_invariant(self, enabled: bool) -> None:
        """Flip batch invariance on every generator (BI as a debug switch; the trainer flips its own)."""
        import requests

        for url in self.urls:
            params = {"enabled": "1" if enabled else "0"}
            r = requests.post(f"{url}{BI_ROUTE}", params=params, headers=self._signed(url, "POST", BI_ROUTE, params),
                              timeout=self.timeout_s)
            if r.status_code != 200 or r.json().get("batch_invariant") is not bool(enabled):
                raise WeightPushError(f"{url}: switching batch invariance {'on' if enabled else 'off'} failed: "
                                      f"HTTP {r.status_code} {r.text[:500]}", [])

    def checksums(self, url: str | None = None) -> dict[str, str]:
        """The live model's per-parameter checksums on one server (the first by default)."""
        import requests

        url = url or self.urls[0]
        r = requests.get(f"{url}{CHECKSUMS_ROUTE}", headers=self._signed(url, "GET", CHECKSUMS_ROUTE, {}),
                         timeout=self.timeout_s)
        r.raise_for_status()
        return r.json()["checksums"]

    def push_url(self, url: str) -> str:
        """Where to send ``url``'s pushes: its weights listener (``push_port`` of its version route), so a
        push does not queue behind the OpenAI routes; the server URL itself when it runs none. The token
        goes only to a listener that answered with the boot id of the server at ``url``: after a restart
        the old port may belong to another process. A known listener is re-checked on every push (on its
        own port, which a busy OpenAI loop does not delay); a changed boot starts discovery over."""
        if not self.use_listener:
            return url
        cached = self._push_urls.get(url)
        if cached is not None and cached[1] != url and self._boot_at(cached[1]) == cached[0]:
            return cached[1]
        boot, port = self._discover(url)
        target = url
        if boot is not None and port:
            candidate = self._listener_url(url, int(port))
            if self._boot_at(candidate) == boot:
                target = candidate
        if boot is None:
            self._push_urls.pop(url, None)  # unreachable now: asked again next time
        else:
            self._push_urls[url] = (boot, target)
        return target

    def _discover(self, url: str, timeout_cap_s: float = 30.0) -> tuple[str | None, Any]:
        """(boot id, push port) from the version route at ``url`` (no token is sent); (None, None) when it
        cannot say."""
        import requests

        try:
            r = requests.get(f"{url}{VERSION_ROUTE}", timeout=min(self.timeout_s, timeout_cap_s))
            doc = r.json() if r.status_code == 200 else {}
        except (requests.RequestException, ValueError):
            return None, None
        if not isinstance(doc, dict):
            return None, None
        return doc.get("boot_id"), doc.get(PUSH_PORT_FIELD)

    def _boot_at(self, base: str) -> str | None:
        return self._discover(base, timeout_cap_s=10.0)[0]

    def boot_id(self, url: str) -> str | None:
        """The boot id the server at ``url`` answers with now; None when it cannot be reached."""
        return self._boot_at(url)

    def dev_post(self, url: str, path: str, body: Mapping[str, Any] | None = None, boot: str | None = None,
                 params: Mapping[str, str] | None = None) -> PushResult:
        """POST a JSON ``body`` to one of vLLM's dev routes (``/update_weights`` ...) on the server's OpenAI
        port, with the query ``params`` (``/finish_weight_update``: the commit's mode), signed for its boot
        (``boot``, asked when not given) like a push (the routes are behind the push token there); the answer as
        a ``PushResult``, never raised."""
        import requests

        params = dict(params or {})
        try:
            headers = self._signed(url, "POST", path, params, boot, content_type="application/json")
            r = requests.post(f"{url}{path}", params=params, json=body, headers=headers, timeout=self.timeout_s)
        except (requests.RequestException, WeightPushError) as e:
            return {"url": url, "ok": False, "status": None, "error": f"{type(e).__name__}: {e}"}
        return _answer(url, r)

    def _signed(self, url: str, method: str, path: str, params: Mapping[str, str], boot: str | None = None,
                content_type: str = OCTET_STREAM) -> dict[str, str]:
        """Headers of one request signed for the server at ``url`` as it is now (its boot id, asked unless
        given): the signature is good for this request on this boot only, and the token stays here."""
        from titan_rl_ext.wire.signing import authorization

        boot = boot or self._boot_at(url)
        if boot is None:
            raise WeightPushError(f"{url}: no boot id from its version route, so no request can be signed for it", [])
        return {"Authorization": authorization(self._token, method, path, params, boot),
                "Content-Type": content_type}

    @staticmethod
    def _listener_url(url: str, port: int) -> str:
        import urllib.parse

        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or "localhost"
        host = f"[{host}]" if ":" in host else host
        return urllib.parse.urlunsplit((parts.scheme, f"{host}:{port}", "", "", ""))

    def post(self, url: str, body: bytes, params: Mapping[str, str], content_type: str = OCTET_STREAM) -> PushResult:
        """POST ``body`` to the weights route of the server at ``url`` (its listener when it runs one),
        signed for its boot; the server's answer, never raised (``transports.base.Link``)."""
        import requests

        target = self.push_url(url)
        try:
            boot = self._push_urls[url][0] if url in self._push_urls else None
            try:
                r = requests.post(f"{target}{WEIGHTS_ROUTE}", params=params, data=body,
                                  headers=self._signed(url, "POST", WEIGHTS_ROUTE, params, boot, content_type),
                                  timeout=self.timeout_s)
            except requests.ConnectionError:
                if target == url:
                    raise
                self._push_urls.pop(url, None)  # the listener is gone (restart?): the server's own port serves too
                r = requests.post(f"{url}{WEIGHTS_ROUTE}", params=params, data=body,
                                  headers=self._signed(url, "POST", WEIGHTS_ROUTE, params, content_type=content_type),
                                  timeout=self.timeout_s)
        except (requests.RequestException, WeightPushError) as e:
            return {"url": url, "ok": False, "status": None, "error": f"{type(e).__name__}: {e}"}
        return _answer(url, r)


def _answer(url: str, r: Any) -> PushResult:
    """A server's HTTP answer as a ``PushResult``: its JSON on 200, else the status and what it said."""
    if r.status_code == 200:
        return {"url": url, "ok": True, "status": 200, "response": r.json()}
    try:
        detail: Any = r.json()
    except ValueError:
        detail = r.text[:2000]
    return {"url": url, "ok": False, "status": r.status_code, "error": detail}
