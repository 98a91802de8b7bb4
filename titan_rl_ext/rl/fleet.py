"""Several generators as one rollout pool that never mixes weights silently.

A push to the fleet is one operation with one outcome (``FleetPush``): every generator that answered
"swapped" serves the new version; every other one is **out of the pool** until a later push to it
succeeds. Samples are admitted only from a generator in the pool, only from the server process that
acknowledged the pushes (``x-titan-boot-id``: a restarted server on the same address is a new process
that has not been given the trainer's weights), and only with token versions that process acknowledged:
tokens of the version being pushed can reach the client before that server's answer reaches the pusher,
so such a sample waits for the answer (or the push's end) instead of being taken on trust.

- ``GeneratorFleet``: the members and their confirmed versions (thread-safe: the trainer pushes from its
  thread, the rollout loop picks and admits from its own).
- ``FleetClient``: the ``Generator`` the rollout producers use: a live member per request, retried on
  another member when one fails or its sample is refused.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from titan_rl_ext.rl.generator_client import GenerationError
from titan_rl_ext.rl.samples import Generation, SamplingConfig
from titan_rl_ext.rl.weight_sync import WeightPusher, WeightPushError

logger = logging.getLogger(__name__)


@dataclass
class Member:
    url: str
    live: bool = False
    boot_id: str | None = None  # the server process that confirmed ``versions``
    versions: set[int] = field(default_factory=set)  # versions pushed to (or verified on) that process
    reason: str = "not pushed yet"  # why it is out of the pool
    # out after a failed request only (not a failed push, a restart or a foreign version): a probe that finds
    # the same process serving whole weights brings it back
    probe: bool = False


@dataclass
class FleetPush:
    """What one push did: who serves ``version`` now, and who is out (and why)."""

    version: int
    live: list[str]
    out: dict[str, str]
    seconds: float
    responses: dict[str, dict[str, Any]] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """Who serves the version, and where the push's wall time went: ``swap/post_s`` is the whole
        request round (the slowest server), the rest the slowest server's own phases from its answer
        (reading the body, waiting to get onto the engine loop, the swap itself)."""
        out = {"fleet/live": float(len(self.live)), "fleet/out": float(len(self.out)), "swap/post_s": self.seconds}
        for key, phase in (("receive_seconds", "swap/server_receive_s"), ("hop_seconds", "swap/server_hop_s"),
                           ("swap_seconds", "swap/server_swap_s")):
            seen = [float(r[key]) for r in self.responses.values() if isinstance(r.get(key), (int, float))]
            if seen:
                out[phase] = max(seen)
        return out


class GeneratorFleet:
    def __init__(self, pusher: WeightPusher) -> None:
        self.pusher = pusher
        self.members = {u: Member(u) for u in pusher.urls}
        self.pending: int | None = None  # the version being pushed: its tokens may arrive before a server's answer
        self.refused = 0  # samples refused since the start
        self._lock = threading.Lock()

    # -- trainer side --------------------------------------------------------------------------------
    def verify(self, url: str, version: int, boot_id: str) -> None:
        """Admit ``url`` as serving ``version`` without a push (the trainer checked it holds the same
        weights, e.g. by checksums at start-up)."""
        with self._lock:
            m = self.members[url]
            if m.boot_id != boot_id:
                m.versions = set()
            m.live, m.boot_id, m.reason = True, boot_id, ""
            m.versions.add(int(version))

    def push(self, state_dict: Mapping[str, torch.Tensor], version: int, mode: str = "keep") -> FleetPush:
        """Push to every member (those out of the pool too: this is how they come back). Raises
        ``WeightPushError`` only when no generator serves the new version."""
        t0 = time.perf_counter()
        with self._lock:
            self.pending = int(version)
        try:
            results = self.pusher.push_each(state_dict, version, mode,
                                            on_result=lambda r: self._apply(version, r))
        finally:
            with self._lock:
                self.pending = None
        return self._record(version, results, time.perf_counter() - t0)

    def _apply(self, version: int, r: Mapping[str, Any]) -> None:
        """One server's answer to the push of ``version`` (as it arrives; applying it twice changes nothing)."""
        with self._lock:
            m = self.members[r["url"]]
            if r["ok"]:
                boot = r["response"].get("boot_id")
                if boot != m.boot_id:  # a new process: what the old one was given does not carry over
                    m.versions = set()
                m.live, m.boot_id, m.reason, m.probe = True, boot, "", False
                m.versions.add(int(version))
            else:
                m.live, m.probe = False, False  # it may hold another version now: back only by a push
                m.reason = f"push v{version}: HTTP {r['status']} {str(r['error'])[:300]}"

    def _record(self, version: int, results: Sequence[dict[str, Any]], seconds: float) -> FleetPush:
        live, out, responses = [], {}, {}
        for r in results:
            self._apply(version, r)
        with self._lock:
            for r in results:
                m = self.members[r["url"]]
                if r["ok"]:
                    live.append(m.url)
                    responses[m.url] = r["response"]
                else:
                    out[m.url] = m.reason
        outcome = FleetPush(int(version), live, out, seconds, responses)
        if out:
            logger.warning("weight push v%d: %d/%d generators out of the rollout pool: %s", version, len(out),
                           len(results), "; ".join(f"{u}: {why}" for u, why in out.items()))
        if not live:
            raise WeightPushError(f"weight push v{version}: no generator serves it: "
                                  + "; ".join(f"{u}: {why}" for u, why in out.items()), list(results))
        return outcome

    # -- rollout side --------------------------------------------------------------------------------
    def live(self) -> list[str]:
        with self._lock:
            return [m.url for m in self.members.values() if m.live]

    def mark_out(self, url: str, reason: str, probe: bool = False) -> None:
        """Take ``url`` out of the pool; ``probe``: a later ``revive`` may bring it back without a push (it
        failed a request, nothing says its weights changed)."""
        with self._lock:
            m = self.members[url]
            if m.live:
                logger.warning("generator %s out of the rollout pool: %s", url, reason)
            m.live, m.reason, m.probe = False, reason, probe

    def boot_of(self, url: str) -> str | None:
        with self._lock:
            m = self.members.get(url)
            return None if m is None else m.boot_id

    def probeable(self) -> list[str]:
        """Members out of the pool only for a failed request."""
        with self._lock:
            return [m.url for m in self.members.values() if not m.live and m.probe]

    def revive(self, url: str, boot_id: str | None) -> bool:
        """Back into the pool if it went out for a failed request and ``boot_id`` is still the process that
        was pushed to (a restarted one must wait for a push)."""
        with self._lock:
            m = self.members[url]
            if m.live or not m.probe or boot_id is None or boot_id != m.boot_id:
                return False
            m.live, m.probe, m.reason = True, False, ""
            logger.info("generator %s back in the rollout pool (probe: same process, whole weights)", url)
            return True

    def awaiting(self, gen: Generation) -> bool:
        """Whether ``gen`` holds tokens of the version being pushed from a server whose answer to that push
        has not arrived: admit it once the answer (or the push's end) has."""
        with self._lock:
            m = self.members.get(gen.server or "")
            return (m is not None and self.pending is not None and self.pending in gen.versions
                    and self.pending not in m.versions)

    def admit(self, gen: Generation) -> str | None:
        """None if the sample may be trained on, else why not (and its server leaves the pool when the
        reason is the server's, not the sample's)."""
        with self._lock:
            m = self.members.get(gen.server or "")
            if m is None:
                return f"sample from {gen.server!r}, which is not in the fleet"
            if not m.live:
                return f"{m.url} is out of the rollout pool ({m.reason})"
            if gen.boot_id != m.boot_id:
                m.live, m.reason = False, f"restarted (boot id {gen.boot_id} is not the one that was pushed to)"
                self.refused += 1
                return m.reason
            unknown = sorted({v for v in gen.versions if v not in m.versions})
            if unknown:
                m.live, m.reason = False, f"served versions {unknown}, never pushed to it"
                self.refused += 1
                return m.reason
            return None


class FleetClient:
    """A ``Generator`` over a fleet: each request goes to the next live member; a request the server failed
    (unreachable, 5xx, an error mid-stream) or a refused sample is retried on another member
    (``max_attempts`` in all). A 4xx is the request's own fault and is raised as it is. After a failed
    request the server is asked who it is (its version route): the same process with whole weights stays in
    the pool (the request failed, not the server); one that does not answer leaves it and is probed back in
    every ``probe_every_s``; a different process (restarted) or dirty weights leave it until a push."""

    def __init__(self, fleet: GeneratorFleet, clients: Mapping[str, Any], max_attempts: int = 8,
                 wait_s: float = 600.0, probe_every_s: float = 5.0,
                 exited: Callable[[str], str | None] | None = None) -> None:
        """``exited(url)``: why that member's process is gone for good (a generator this trainer spawned
        exited), None when unknown or alive. With every member out and gone, a request fails at once with
        those reasons instead of waiting ``wait_s`` for one to come back."""
        self.fleet, self.clients = fleet, dict(clients)
        self.max_attempts, self.wait_s, self.probe_every_s = max_attempts, wait_s, probe_every_s
        self.exited = exited
        self._turn = itertools.count()
        self._last_probe = 0.0

    async def _serving(self, url: str) -> tuple[str | None, str | None]:
        """(boot id, dirty) of the process at ``url`` from its version route: (None, None) if it does not
        answer or its client cannot ask; ``dirty`` says why its weights may be mixed after a failed push."""
        ask = getattr(self.clients[url], "server_state", None)
        doc = await ask() if ask is not None else None
        if not isinstance(doc, dict):
            return None, None
        return doc.get("boot_id"), doc.get("dirty") or None

    async def _probe(self) -> None:
        """Members out for a failed request come back when the same process answers again."""
        now = time.monotonic()
        if now - self._last_probe < self.probe_every_s:
            return
        self._last_probe = now
        for url in self.fleet.probeable():
            boot, dirty = await self._serving(url)
            if dirty is None:
                self.fleet.revive(url, boot)

    async def _pick(self) -> str:
        deadline = time.monotonic() + self.wait_s
        while True:
            await self._probe()
            live = self.fleet.live()
            if live:
                return live[next(self._turn) % len(live)]
            gone = [why for u in self.clients if self.exited is not None and (why := self.exited(u))]
            if len(gone) == len(self.clients):
                raise GenerationError("every generator has exited: " + "; ".join(gone))
            if time.monotonic() > deadline:
                raise GenerationError(f"no generator in the rollout pool for {self.wait_s:.0f} s")
            await asyncio.sleep(0.2)

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingConfig) -> Generation:
        import httpx

        why = []
        for _ in range(self.max_attempts):
            url = await self._pick()
            try:
                gen = await self.clients[url].generate(prompt_ids, sampling)
            except (httpx.TransportError, GenerationError) as e:
                if isinstance(e, GenerationError) and e.status is not None and 400 <= e.status < 500:
                    raise  # the request's fault: another server would refuse it too
                why.append(f"{url}: {type(e).__name__}")
                boot, dirty = await self._serving(url)
                if boot is not None and boot == self.fleet.boot_of(url) and dirty is None:
                    # the same process answers with whole weights: this request failed (a read timeout, one
                    # bad prompt), not the server -- it stays in the pool and the request goes elsewhere
                    continue
                # silent: probed back in later; restarted or dirty: only a push brings it back
                self.fleet.mark_out(url, f"request failed: {type(e).__name__}: {e}"
                                    + (f" (server dirty: {dirty})" if dirty else ""), probe=boot is None)
                continue
            deadline = time.monotonic() + self.wait_s
            while self.fleet.awaiting(gen) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # the push's answers come on the pusher's threads
            refused = self.fleet.admit(gen)
            if refused is None:
                return gen
            why.append(f"{url}: {refused}")
        raise GenerationError(f"no admissible sample after {self.max_attempts} attempts: {'; '.join(why)}")

    async def generate_group(self, prompt_ids: Sequence[int], sampling: SamplingConfig, n: int) -> list[Generation]:
        return list(await asyncio.gather(*(self.generate(prompt_ids, sampling) for _ in range(n))))
