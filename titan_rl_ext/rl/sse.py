"""Server-sent-event framing of vLLM's streamed completions: bytes -> lines -> chunk objects.

Lines end only where the SSE spec ends them: CRLF, LF or CR. ``httpx``'s ``aiter_lines`` follows
``str.splitlines`` and also breaks at U+0085, U+2028, U+2029 (and a few ASCII controls). vLLM writes
those characters unescaped inside a chunk's JSON strings whenever a sampled token decodes to one, so
that reader cuts the chunk in two and the JSON no longer parses (seen under load with random weights:
``Unterminated string``). Read raw bytes and split them here instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

__all__ = ["DONE", "SSELineDecoder", "sse_lines", "parse_sse_line"]

DONE = object()  # the stream's ``data: [DONE]`` terminator
_EOL = re.compile(rb"\r\n|\r|\n")


class SSELineDecoder:
    """Incremental: ``feed`` bytes as they arrive, get the complete lines (without their ending).
    A CR at the end of a piece is held back: the next piece may start with the LF of a CRLF."""

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, data: bytes) -> list[str]:
        buf = self._rest + data
        held = b"\r" if buf.endswith(b"\r") else b""
        *lines, rest = _EOL.split(buf[:len(buf) - len(held)])
        self._rest = rest + held
        # lines split at ASCII bytes only, so a multi-byte UTF-8 character is never cut
        return [line.decode("utf-8", errors="replace") for line in lines]

    def flush(self) -> list[str]:
        """The last line, if the stream ended without a line ending."""
        rest, self._rest = self._rest, b""
        return [line.decode("utf-8", errors="replace") for line in _EOL.split(rest) if line] if rest else []


async def sse_lines(chunks: AsyncIterable[bytes]) -> AsyncIterator[str]:
    """The lines of a streamed response body (e.g. ``response.aiter_bytes()``)."""
    decoder = SSELineDecoder()
    async for chunk in chunks:
        for line in decoder.feed(chunk):
            yield line
    for line in decoder.flush():
        yield line


def parse_sse_line(line: str) -> dict[str, Any] | object | None:
    """One line of a server-sent-event stream: the chunk's JSON object, ``DONE`` for the terminator, or
    None for lines that carry no data (blank separators, comments, other fields)."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    if payload == "[DONE]":
        return DONE
    if not payload:
        return None
    return json.loads(payload)
