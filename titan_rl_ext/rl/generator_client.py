"""The client of a vLLM server's OpenAI completions API: token ids in, token ids + generator logprobs +
weight versions out.

Nothing here re-tokenises text: prompts go as token-id lists, and the sampled ids come back per streamed
chunk (``return_token_ids``; the ``"token_id:<int>"`` strings of ``return_tokens_as_token_ids`` are the
fallback and a cross-check).

Weight versions: with the swap endpoint enabled, every streamed chunk carries a top-level integer
``"titan_weight_version"`` (the version of its last token) and each finished choice the engine's
``"titan_weight_spans"``, which give every token its version. A sequence generated across a weight swap
therefore carries two (or more) versions. Without annotations the version is the server's
``GET /titan/v1/weights/version`` taken just before the request (0 when the server has no such endpoint).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from titan_rl_ext.rl.samples import Generation, SamplingConfig
from titan_rl_ext.rl.sse import DONE, parse_sse_line, sse_lines
from titan_rl_ext.wire.protocol import BOOT_HEADER, SPANS_FIELD, VERSION_FIELD
from titan_rl_ext.wire.protocol import VERSION_ROUTE as VERSION_PATH

__all__ = ["GenerationError", "versions_from_spans", "StreamAccumulator", "Generator", "GeneratorClient"]


class GenerationError(RuntimeError):
    """The server refused or aborted a completion. ``status``: the HTTP status when the server answered
    with an error (a 4xx is the request's fault, not the server's)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def _token_id(token: str) -> int:
    if not token.startswith("token_id:"):
        raise GenerationError(f"logprob token {token!r} is not 'token_id:<int>' (send return_tokens_as_token_ids)")
    return int(token[len("token_id:"):])


def versions_from_spans(spans: Sequence[Sequence[int]], num_tokens: int) -> list[int | None]:
    """Per-token versions from ``[[version, start, end], ...]``; the spans must tile ``0..num_tokens``."""
    out: list[int | None] = []
    for span in spans:
        if len(span) != 3:
            raise GenerationError(f"weight span {span!r} is not [version, start, end]")
        v, start, end = (int(x) for x in span)
        if start != len(out) or end < start:
            raise GenerationError(f"weight spans {list(spans)} do not tile the {num_tokens} generated tokens")
        out += [v] * (end - start)
    if len(out) != num_tokens:
        raise GenerationError(f"weight spans {list(spans)} cover {len(out)} of {num_tokens} generated tokens")
    return out


class StreamAccumulator:
    """Folds completion chunks into one ``Generation`` per choice index.

    A chunk's tokens get the chunk's ``titan_weight_version`` (``default_version`` when absent). When a
    choice finishes with ``titan_weight_spans`` (the versions the engine core stamped on its outputs), those
    replace the chunk tags token by token: a chunk can carry tokens of two versions when a swap lands
    between engine steps that the API server sends together. Spans that do not cover the choice's tokens
    exactly are an error, not a guess.
    """

    def __init__(self, default_version: int | None = None) -> None:
        self.default_version = default_version
        self.saw_version_annotation = False
        self._choices: dict[int, Generation] = {}

    def feed(self, chunk: Mapping[str, Any]) -> None:
        if "error" in chunk:  # vLLM reports mid-stream failures as a data event
            raise GenerationError(f"server error in stream: {chunk['error']}")
        version = chunk.get(VERSION_FIELD)
        if version is not None:
            self.saw_version_annotation = True
            version = int(version)
        else:
            version = self.default_version
        for choice in chunk.get("choices") or ():
            gen = self._choices.setdefault(int(choice.get("index", 0)), Generation())
            ids, lps = self._tokens(choice)
            gen.token_ids += ids
            gen.logprobs += lps
            gen.versions += [version] * len(ids)
            if choice.get("finish_reason") is not None:
                gen.finish_reason = choice["finish_reason"]
                gen.stop_reason = choice.get("stop_reason")
                if (spans := choice.get(SPANS_FIELD)) is not None:
                    gen.versions = versions_from_spans(spans, len(gen.token_ids))

    @staticmethod
    def _tokens(choice: Mapping[str, Any]) -> tuple[list[int], list[float]]:
        lp = choice.get("logprobs") or {}
        lps = [float(x) if x is not None else math.nan for x in lp.get("token_logprobs") or ()]
        from_logprobs = [_token_id(t) for t in lp.get("tokens") or ()]
        ids = choice.get("token_ids")
        if ids is None:
            ids = from_logprobs
        elif from_logprobs and list(ids) != from_logprobs:
            raise GenerationError(f"token_ids {ids} disagree with logprob tokens {from_logprobs}")
        if len(lps) != len(ids):
            raise GenerationError(f"{len(ids)} tokens but {len(lps)} logprobs in a chunk (request logprobs=0)")
        return [int(t) for t in ids], lps

    def feed_lines(self, lines: Iterable[str]) -> None:
        """Recorded streams, e.g. in tests."""
        for line in lines:
            if self.feed_line(line):
                break

    def feed_line(self, line: str) -> bool:
        """Feeds one SSE line; True once the stream's terminator arrived."""
        item = parse_sse_line(line)
        if item is DONE:
            return True
        if item is not None:
            self.feed(item)  # type: ignore[arg-type]
        return False

    def result(self, index: int = 0) -> Generation:
        return self._choices.get(index, Generation())

    def results(self) -> list[Generation]:
        return [self._choices[i] for i in sorted(self._choices)]


@runtime_checkable
class Generator(Protocol):
    """What rollouts need from a generator (the HTTP client, or a fake in tests)."""

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingConfig) -> Generation: ...


def _parse_version_body(body: Any) -> int:
    if isinstance(body, Mapping):
        for key in ("version", VERSION_FIELD, "weight_version"):
            if key in body:
                return int(body[key])
        raise GenerationError(f"no version in {body!r}")
    return int(body)


class GeneratorClient:
    """Async client for the OpenAI completions API of a vLLM server, token ids in and out.

    A group of G samples is G separate streamed requests (vLLM's prefix cache shares the prompt);
    ``n=G`` would interleave the choices of one stream for no gain.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        timeout_s: float | None = 600.0,
        http: Any | None = None,
    ) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        self.model = model
        # an injected client (tests: httpx.MockTransport) keeps its own transport and settings
        self._http = http if http is not None else httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=30.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}  # sent per request
        # None: not known yet whether chunks carry versions; True once one did (then the extra
        # GET per request is skipped); the endpoint being absent pins the fallback to 0
        self._annotates: bool | None = None
        self._version_endpoint_missing = False

    async def __aenter__(self) -> GeneratorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def weight_version(self) -> int:
        """The server's current weight version; 0 when it has no version endpoint."""
        if self._version_endpoint_missing:
            return 0
        r = await self._http.get(self.base_url + VERSION_PATH, headers=self._headers)
        if r.status_code in (404, 405):
            self._version_endpoint_missing = True
            return 0
        r.raise_for_status()
        return _parse_version_body(r.json())

    async def server_state(self, timeout_s: float = 10.0) -> dict[str, Any] | None:
        """The server's version-route answer (``version``, ``boot_id``, ``dirty``, ...), or None when it does
        not answer in ``timeout_s`` (the fleet's probe: is the process that served us still there?)."""
        import httpx

        try:
            r = await self._http.get(self.base_url + VERSION_PATH, headers=self._headers, timeout=timeout_s)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def request_body(self, prompt_ids: Sequence[int], sampling: SamplingConfig) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": [int(t) for t in prompt_ids],
            "stream": True,
            "logprobs": 0,  # the sampled token's logprob only
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            **sampling.request_fields(),
        }

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingConfig) -> Generation:
        # the version *before* the request is a lower bound for unannotated tokens: safe for staleness
        fallback = None if self._annotates else await self.weight_version()
        acc = StreamAccumulator(default_version=fallback)
        async with self._http.stream(
            "POST", self.base_url + "/v1/completions", json=self.request_body(prompt_ids, sampling), headers=self._headers
        ) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                raise GenerationError(f"HTTP {r.status_code} from /v1/completions: {body[:2000]}", r.status_code)
            boot_id = r.headers.get(BOOT_HEADER)
            async for line in sse_lines(r.aiter_bytes()):  # not aiter_lines: see rl.sse
                if acc.feed_line(line):
                    break
        if acc.saw_version_annotation:
            self._annotates = True
        gen = acc.result(0)
        gen.server, gen.boot_id = self.base_url, boot_id
        if any(v is None for v in gen.versions):
            # annotations assumed but missing this time (server restarted without the endpoint)
            self._annotates = None
            v0 = await self.weight_version()
            gen.versions = [v0 if v is None else v for v in gen.versions]
        return gen

    async def generate_group(self, prompt_ids: Sequence[int], sampling: SamplingConfig, n: int) -> list[Generation]:
        return list(await asyncio.gather(*(self.generate(prompt_ids, sampling) for _ in range(n))))
