"""Which weight version produced each output token of each request: counted by the engine core at the swap,
kept by the API server per request. Works the same on every vLLM the plugin supports, because it relies on
nothing a release may lack (vLLM 0.26 stamps no version on engine outputs):

- The engine core changes version only inside a utility call, between two steps, with no batch in flight
  (``swap.engine``). At that moment it knows exactly how many output tokens every unfinished request has:
  tokens ``0..k-1`` came from the old weights, token ``k`` on from the new ones. It returns those counts.
- The API server sends a request's ADD message in the same event-loop turn as it registers the request's
  output state (``AsyncLLM._add_request``: no ``await`` between the two), and the utility message in the
  turn the swap calls it; one socket carries both, and the engine core handles its input in order. So a
  request registered before the swap's utility call is in the engine when the swap happens (unfinished:
  it has a count; finished: all its tokens are old), and one registered after it reaches the engine after
  the swap (all its tokens are new).

The result is per-request spans ``(version, first output-token index)`` that do not depend on when the API
server gets around to sending a chunk. Nor on when it gets around to the utility's answer: the answer and the
next step's outputs can arrive in one read of the engine's socket, and vLLM's output handler, already woken by
an earlier output, may process that step -- finishing a request and dropping its output state from
``OutputProcessor.request_states`` -- before the swap's task resumes to ``commit``. So ``commit`` finds a
request's state through the ledger's own map of registered states (weak: a state lives as long as its HTTP
request holds it), not only through the API server's unfinished ones.

``begin`` is called right before the version-setting utility is sent, ``commit`` with its answer, ``cancel``
when it failed or did nothing. Everything runs on the API server's event loop (registration, output
processing and the swap), so no lock is needed.
"""

from __future__ import annotations

import weakref
from typing import Any

from vllm_titan_plugin import compat

STARTS_ATTR = "titan_version_starts"  # on vLLM's RequestState: [(version, first output-token index), ...]


class VersionLedger:
    """API-server side of the per-token versions (one per API-server process)."""

    def __init__(self, version: int = 0) -> None:
        self.version = version  # the engine's version as the API server last learnt it
        self._pending: int | None = None  # a version-setting utility is on its way to the engine core
        self._during: dict[int, Any] = {}  # id -> request state registered while it was
        # engine request id -> output state, finished ones included while their HTTP request still holds them
        self._registered: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()

    def on_register(self, request_state: Any) -> None:
        """A request's output state was just registered: its ADD message is sent in this same turn."""
        if self._pending is not None:
            self._during[id(request_state)] = request_state
        rid = getattr(request_state, "request_id", None)
        if rid is not None:
            try:
                self._registered[rid] = request_state
            except TypeError:  # not weak-referenceable (vLLM's RequestState is): found via request_states only
                pass
        setattr(request_state, STARTS_ATTR, [(self.version if self._pending is None else self._pending, 0)])

    def begin(self, version: int) -> None:
        """Right before the utility that sets ``version`` is sent (no ``await`` in between)."""
        self._pending, self._during = int(version), {}

    def commit(self, version: int, counts: dict[str, int], request_states: dict[str, Any]) -> None:
        """The utility set ``version``; ``counts``: output tokens of each request the engine core held then.
        Requests it did not hold had finished (all old) or were registered after ``begin`` (all new).
        ``request_states`` (the API server's unfinished requests) may already lack a request the engine
        held: its post-swap tokens were processed, and finished it, before this ran."""
        version = int(version)
        for rid, n in counts.items():
            state = self._registered.get(rid)
            if state is None:
                state = request_states.get(rid)
            starts = getattr(state, STARTS_ATTR, None)
            if starts is not None and id(state) not in self._during:
                starts.append((version, int(n)))
        self.version, self._pending, self._during = version, None, {}

    def cancel(self) -> None:
        """The utility set nothing (refused, busy or failed): requests registered meanwhile keep the old
        version."""
        for state in self._during.values():
            setattr(state, STARTS_ATTR, [(self.version, 0)])
        self._pending, self._during = None, {}


def spans_of(request_state: Any) -> tuple[list[tuple[int, int]], int] | None:
    """(version, first output-token index) of each span, and the request's output tokens so far; None for
    a request registered before the swap routes were installed."""
    starts = getattr(request_state, STARTS_ATTR, None)
    if starts is None:
        return None
    return list(starts), compat.num_output_tokens(request_state)
