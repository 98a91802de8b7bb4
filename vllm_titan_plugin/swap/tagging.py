"""Version tags on the OpenAI routes: the cache salt a request arrives with, and the weight version of
every token it gets back.

A middleware on ``/v1/completions`` and ``/v1/chat/completions`` (vLLM's other generation routes --
``/v1/responses``, ``/inference/v1/generate``, ``/invocations`` -- answer 501 while pushes are enabled:
they would run without a version salt or tags). It sits inside vLLM's own middlewares, so ``--api-key``
is checked before it reads a body. It:

- injects ``cache_salt="titan-v<N>"`` unless the client set one (the engine core re-salts it if the
  weights change before it is scheduled: ``swap.engine``);
- adds the ``x-titan-weight-version`` response header (the version when the response starts) and
  ``x-titan-boot-id`` (which server process answered: ``routes.SwapState.boot_id``);
- tags every streamed JSON chunk with ``"titan_weight_version"``: the version whose weights produced the
  chunk's last token, read from that request's spans (``swap.ledger``: counted by the engine core at
  each swap);
- gives the final chunk of each choice (and each choice of a non-streamed response)
  ``"titan_weight_spans": [[version, start, end], ...]`` over its output-token indexes. Clients take these
  as the authoritative per-token versions.

How a chunk finds its request's spans: the middleware puts a ``RequestVersions`` in a context variable
before the route runs; vLLM registers each engine request's output state from inside that request's task
(``compat.wrap_output_processor_add_request``), and the hook gives the state its first span
(``VersionLedger.on_register``) and adds it to the context's ``RequestVersions``. No request ids are parsed.
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from titan_rl_ext.wire.protocol import BOOT_HEADER, SALT_PREFIX, SPANS_FIELD, VERSION_FIELD, VERSION_HEADER
from vllm_titan_plugin import compat
from vllm_titan_plugin.swap.ledger import VersionLedger, spans_of

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# every route that runs the model; the ones beyond GENERATION_PATHS carry no salt or tags and are refused
ALL_GENERATION_PATHS = GENERATION_PATHS + ("/v1/responses", "/inference/v1/generate", "/invocations", "/v1/messages",
                                            "/v1/chat/completions/batch", "/generative_scoring")
_MARK = "__titan_versions__"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class RequestVersions:
    """The engine output states of one HTTP request, in choice order."""

    def __init__(self) -> None:
        self._slots: dict[int, int] = {}  # id(parent request or the state itself) -> prompt position
        self._states: list[tuple[int, int, Any]] = []  # (prompt position, index within the prompt, state)

    def add(self, state: Any, parent_req: Any, request_index: int) -> None:
        slot = self._slots.setdefault(id(parent_req if parent_req is not None else state), len(self._slots))
        self._states.append((slot, request_index, state))
        self._states.sort(key=lambda t: (t[0], t[1]))  # completions number choices prompt by prompt

    def _starts(self, choice: int) -> tuple[list[tuple[int, int]], int] | None:
        if not 0 <= choice < len(self._states):
            return None
        return spans_of(self._states[choice][2])

    def spans(self, choice: int) -> list[list[int]] | None:
        """[[version, start, end), ...] over the choice's output tokens; None if the engine reported none."""
        got = self._starts(choice)
        if got is None:
            return None
        starts, n = got
        if n and not starts:
            return None
        ends = [s for _, s in starts[1:]] + [n]
        out = []
        for (v, s), e in zip(starts, ends):
            if e > s:
                out.append([v, s, e])
        return out

    def version_at(self, choice: int, token_index: int | None) -> int | None:
        """Version of output token ``token_index`` (the newest one if None)."""
        got = self._starts(choice)
        if got is None or not got[0]:
            return None
        starts, _ = got
        if token_index is None:
            return starts[-1][0]
        found = None
        for v, s in starts:
            if s > token_index:
                break
            found = v
        return found


_CURRENT: contextvars.ContextVar[RequestVersions | None] = contextvars.ContextVar("titan_request_versions", default=None)


LEDGER = VersionLedger()  # the API-server process's (the routes move it at each swap)


def _on_add(state: Any, parent_req: Any, request_index: int) -> None:
    LEDGER.on_register(state)
    cell = _CURRENT.get()
    if cell is not None:
        cell.add(state, parent_req, request_index)


def install() -> VersionLedger:
    """API-server side hook: every request's output state gets its first span as vLLM registers it."""
    compat.wrap_output_processor_add_request(_on_add, _MARK)
    return LEDGER


def _choice_tokens(choice: dict[str, Any]) -> int | None:
    ids = choice.get("token_ids")
    if ids is not None:
        return len(ids)
    lp = choice.get("logprobs")
    if isinstance(lp, dict):
        toks = lp.get("tokens") if "tokens" in lp else lp.get("content")
        if toks is not None:
            return len(toks)
    return None


class WeightVersionMiddleware:
    """Pure ASGI (streams pass through chunk by chunk, unlike ``BaseHTTPMiddleware``). ``state`` is the
    ``SwapState`` (its ``version`` is the API server's view: the last push that completed)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], state: Any) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"].rstrip("/") if scope["type"] == "http" else ""
        if path.endswith(ALL_GENERATION_PATHS) and not path.endswith(GENERATION_PATHS):
            # these routes would run the model without a per-version cache salt (their prefills could reuse
            # blocks computed by other weights) and without version tags: refused while pushes are on
            await send_json(send, 501, {"detail": f"{path} is not version-tagged while titan weight pushes are "
                                                   f"enabled; use {' or '.join(GENERATION_PATHS)}"})
            return
        if (dirty := getattr(self.state, "dirty", None)) and path.endswith(GENERATION_PATHS):
            await send_json(send, 503, {"detail": f"weights unavailable: {dirty}"})  # body never read
            return
        if scope["type"] != "http" or not path.endswith(GENERATION_PATHS):
            await self.app(scope, receive, send)
            return
        self.state.note_loop()
        if scope.get("method") == "POST":
            scope, receive = await self._salted(scope, receive)
        cell = RequestVersions()
        token = _CURRENT.set(cell)
        try:
            await self.app(scope, receive, _Annotator(send, self.state, cell))
        finally:
            _CURRENT.reset(token)

    async def _salted(self, scope: Scope, receive: Receive) -> tuple[Scope, Receive]:
        """Read the JSON body, add ``cache_salt`` for the current version unless present, replay it."""
        chunks = []
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # disconnected before the body arrived
                return scope, _replay([msg], receive)
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            data = json.loads(body)
        except ValueError:
            data = None  # not JSON: vLLM answers with its own 400
        if isinstance(data, dict) and data.get("cache_salt") is None:
            data["cache_salt"] = f"{SALT_PREFIX}{self.state.version}"
            body = json.dumps(data).encode()
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            scope = {**scope, "headers": headers}
        return scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive)


class _Annotator:
    """The ``send`` of one generation response: tags SSE chunks as they pass, or the whole JSON body."""

    def __init__(self, send: Send, state: Any, cell: RequestVersions) -> None:
        self.send, self.state, self.cell = send, state, cell
        self.stream = self.json = False
        self.pending = b""
        self.sent: dict[int, int] = {}  # choice index -> output tokens passed so far
        self.start: Message | None = None
        self.body: list[bytes] = []

    async def __call__(self, msg: Message) -> None:
        if msg["type"] == "http.response.start":
            headers = list(msg.get("headers", []))
            ctype = next((v for k, v in headers if k.lower() == b"content-type"), b"")
            self.stream = ctype.startswith(b"text/event-stream")
            self.json = ctype.startswith(b"application/json") and msg.get("status", 200) == 200
            headers.append((VERSION_HEADER.encode(), str(self.state.version).encode()))
            headers.append((BOOT_HEADER.encode(), self.state.boot_id.encode()))
            msg = {**msg, "headers": headers}
            if self.json:  # content-length changes with the spans: hold the start until the body is whole
                self.start = msg
                return
        elif msg["type"] == "http.response.body" and self.stream:
            # SSE events end with a blank line; annotate complete events, keep a partial one.
            data = self.pending + msg.get("body", b"")
            more = msg.get("more_body", False)
            head, sep, self.pending = data.rpartition(b"\n\n")
            out = b"".join(self._event(e) + b"\n\n" for e in head.split(b"\n\n")) if sep else b""
            if not more:
                out, self.pending = out + self.pending, b""
            msg = {**msg, "body": out}
        elif msg["type"] == "http.response.body" and self.start is not None:
            self.body.append(msg.get("body", b""))
            if msg.get("more_body", False):
                return
            body = self._whole_body(b"".join(self.body))
            headers = [(k, v) for k, v in self.start["headers"] if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            start, self.start = {**self.start, "headers": headers}, None
            await self.send(start)
            msg = {**msg, "body": body, "more_body": False}
        await self.send(msg)

    def _event(self, event: bytes) -> bytes:
        """Tag each ``data: {json}`` line of one SSE event (``[DONE]`` and others untouched)."""
        lines = event.split(b"\n")
        for i, line in enumerate(lines):
            if not line.startswith(b"data:"):
                continue
            body = line[5:].strip()
            if not (body.startswith(b"{") and body.endswith(b"}")):
                continue
            try:
                chunk = json.loads(body)
            except ValueError:
                continue
            version, finished = self._tag_chunk(chunk)
            # only a finished choice's chunk changes beyond the tag: re-serialise that one, splice the rest
            lines[i] = (b"data: " + json.dumps({VERSION_FIELD: version, **chunk}, separators=(",", ":")).encode()
                        if finished else _splice(body, version))
        return b"\n".join(lines)

    def _tag_chunk(self, chunk: dict[str, Any]) -> tuple[int, bool]:
        """(the version of the chunk's last token, whether a choice finished and got its spans)."""
        version, finished = None, False
        for choice in chunk.get("choices") or ():
            k = int(choice.get("index", 0))
            n = _choice_tokens(choice)
            if n:
                self.sent[k] = self.sent.get(k, 0) + n
                version = self.cell.version_at(k, self.sent[k] - 1)
            elif version is None:
                version = self.cell.version_at(k, None)
            if choice.get("finish_reason") is not None:
                choice[SPANS_FIELD] = self.cell.spans(k)
                finished = True
        return (self.state.version if version is None else version), finished

    def _whole_body(self, body: bytes) -> bytes:
        try:
            data = json.loads(body)
        except ValueError:
            return body
        if not isinstance(data, dict):
            return body
        for choice in data.get("choices") or ():
            choice[SPANS_FIELD] = self.cell.spans(int(choice.get("index", 0)))
        return json.dumps(data).encode()


async def send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]})
    await send({"type": "http.response.body", "body": raw, "more_body": False})


def _replay(first: list[Message], receive: Receive) -> Receive:
    queue = list(first)

    async def replay() -> Message:
        return queue.pop(0) if queue else await receive()

    return replay


def _splice(body: bytes, version: int) -> bytes:
    """``data: `` + the JSON object ``body`` with the version as its first member, without parsing and
    re-serialising it: the API server does this for every chunk of every stream (only a choice's last
    chunk, which gains its spans, is re-serialised)."""
    rest = body[1:].lstrip()
    return b'data: {"%s":%d%s%s' % (VERSION_FIELD.encode(), version, b"" if rest.startswith(b"}") else b",", rest)
