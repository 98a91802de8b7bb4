"""What a weight transport is: how one version of the weights reaches a set of generators.

A push is four steps, whatever carries the bytes (``push_through`` runs them):

1. ``stage``: the state dict made ready once for every generator (serialised, or exported as handles);
2. ``send``: the staged version delivered to one generator, which validates it whole and swaps it in or
   refuses it (one answer per generator, in parallel);
3. ``commit``: every generator has answered; what staging holds may go (a transport whose generators
   stage first and switch later tells them to switch here);
4. ``abort``: the push stops before every generator answered (an exception, an interrupt); what staging
   holds goes, and no generator is told to switch.

A generator's answer is a ``PushResult``: ``{"url", "ok", "status", "response" | "error"}``. ``send`` does
not raise for a generator that refuses or cannot be reached: the fleet decides who stays in the rollout
pool from the answers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

PushResult = dict[str, Any]
OCTET_STREAM = "application/octet-stream"


@dataclass
class Staged:
    """One version's weights, ready for every generator."""

    body: bytes
    query: dict[str, str] = field(default_factory=dict)  # the transport's own query (``transport=...``)
    content_type: str = OCTET_STREAM
    hold: Any = None  # what must stay alive until every generator has copied (CUDA IPC: the exported tensors)


class Link(Protocol):
    """The pusher's way to a generator's weights route: where it is (its listener or its OpenAI port), and a
    request signed for its current boot (``wire.signing``)."""

    def post(self, url: str, body: bytes, params: Mapping[str, str], content_type: str = OCTET_STREAM) -> PushResult:
        ...


@runtime_checkable
class WeightTransport(Protocol):
    def stage(self, state_dict: Mapping[str, torch.Tensor]) -> Staged: ...

    def send(self, staged: Staged, url: str, params: Mapping[str, str]) -> PushResult:
        """Deliver ``staged`` to the generator at ``url``; ``params``: the push's query (version, mode, ...)."""
        ...

    def commit(self, staged: Staged) -> None: ...

    def abort(self, staged: Staged) -> None: ...


class HttpTransport:
    """A transport whose staged body is POSTed to each generator's weights route through the pusher's
    ``Link``; a subclass says only how a state dict is staged."""

    def __init__(self, link: Link) -> None:
        self.link = link

    def stage(self, state_dict: Mapping[str, torch.Tensor]) -> Staged:
        raise NotImplementedError

    def send(self, staged: Staged, url: str, params: Mapping[str, str]) -> PushResult:
        return self.link.post(url, staged.body, {**params, **staged.query}, staged.content_type)

    def commit(self, staged: Staged) -> None:
        staged.hold = None

    def abort(self, staged: Staged) -> None:
        staged.hold = None


def push_through(transport: WeightTransport, urls: Sequence[str], staged: Staged, params: Mapping[str, str],
                 on_result: Callable[[PushResult], None] | None = None) -> list[PushResult]:
    """Send ``staged`` to every generator at once and commit it; abort it if sending raises. One answer per
    generator, in ``urls`` order; ``on_result`` gets each as soon as it arrives (from a sender thread)."""

    def one(url: str) -> PushResult:
        result = transport.send(staged, url, params)
        if on_result is not None:
            on_result(result)
        return result

    try:
        with ThreadPoolExecutor(max_workers=len(urls)) as pool:
            results = list(pool.map(one, urls))
    except BaseException:
        transport.abort(staged)
        raise
    transport.commit(staged)
    return results
