"""Asynchronous RL: generation runs ahead of training by at most ``offpolicy`` policy versions.

Versions: the trainer's weights after ``n`` optimizer steps are version ``initial + n``; a step that
takes its batch at version ``v`` produces ``v + 1``, which is then pushed to the generator. A group's
tag is the OLDEST weight version among its generated tokens (a sequence straddling a swap carries two
versions and counts as the older one). A step at version ``v`` may train on a group iff

    v - oldest_version <= offpolicy          (staleness = v - oldest_version)

so ``offpolicy=0`` is synchronous on-policy RL: every token of the batch came from the weights
being trained.

``OffPolicyWindow`` enforces that on both ends:

* trainer: ``take(batch_groups, v)`` returns groups inside the window, oldest first, and drops (and
  counts) the ones outside it;
* producers: ``reserve()`` admits a new group only if it cannot be stale when consumed. Groups are
  consumed ``batch_groups`` per step, so a group with ``q`` groups ahead of it (buffered or still
  generating) is trained at ``v_next + q // batch_groups``, where ``v_next`` is the version of the next
  take. Starting it with generator weights ``g`` is allowed iff ``g >= v_next + q // B - offpolicy``,
  i.e. ``q < (g - v_next + offpolicy + 1) * B``. Otherwise the producer waits (backpressure) until a
  take frees a slot or new weights arrive. The admitted count is bounded by ``(offpolicy + 1) * B``
  while the generator is current.

Drops remain possible when groups finish out of admission order or a step advances the version by
more than one; they are counted (``rollout/dropped_stale``), never trained on, and handed to the
``on_drop`` hook (the RL trainer closes their prompts in its resumable prompt ledger).

With ``offpolicy=0`` (and a push after every step) the window is strictly step by step: a take admits
nothing until the new weights are published, so the ``B`` groups of step ``k`` are exactly the ``B``
groups admitted after the ``k-1``-th publish -- producers that draw their prompt right after
``reserve()`` draw the prompts of step ``k`` and no others. With ``offpolicy > 0`` which groups form a
batch depends on completion timing.

Time comes from an injected clock (``ManualClock`` in tests) and versions from explicit calls, so
tests are deterministic.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from titan_rl_ext.rl.samples import Sample

__all__ = ["ManualClock", "Ticket", "BufferedGroup", "TakenBatch", "OffPolicyWindow", "take_watching"]

Clock = Callable[[], float]


class ManualClock:
    """A clock that moves only when told to (tests)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        self.now += dt


@dataclass(frozen=True, slots=True)
class Ticket:
    """A producer's admission: the generator weights it starts with."""

    id: int
    policy_version: int
    started_at: float


@dataclass(slots=True)
class BufferedGroup:
    samples: list[Sample]
    oldest_version: int
    newest_version: int
    policy_version: int
    started_at: float
    finished_at: float
    seq: int
    key: Any = None
    """The producer's label (``put(..., key=)``), e.g. the prompt's index in the prompt stream."""

    @property
    def mixed_versions(self) -> bool:
        """Generated across a weight swap."""
        return self.newest_version != self.oldest_version


@dataclass(slots=True)
class TakenBatch:
    version: int
    groups: list[BufferedGroup]
    staleness: list[int]
    dropped_stale: int
    """Groups dropped as stale since the previous take."""


class OffPolicyWindow:
    """Rollout buffer with a staleness bound; see the module docstring for the rule."""

    def __init__(
        self, offpolicy: int, batch_groups: int, *, initial_version: int = 0, clock: Clock = time.monotonic,
        on_drop: Callable[[BufferedGroup], None] | None = None,
    ) -> None:
        """``on_drop(group)`` runs (on the caller's thread, synchronously) for every group dropped as stale."""
        if offpolicy < 0:
            raise ValueError(f"offpolicy must be >= 0, got {offpolicy}")
        if batch_groups <= 0:
            raise ValueError(f"batch_groups must be > 0, got {batch_groups}")
        self.offpolicy = offpolicy
        self.batch_groups = batch_groups
        self.clock = clock
        self.on_drop = on_drop
        self.generator_version = initial_version
        """Weights live on the generator (``publish_generator_version`` after each push)."""
        self.trainer_version = initial_version
        """Version of the next ``take``."""
        self._buffer: list[BufferedGroup] = []
        self._in_flight = 0
        self._seq = itertools.count()
        self._tickets = itertools.count()
        self._changed = asyncio.Event()
        self.dropped_stale_total = 0
        self._dropped_since_take = 0
        self.staleness_hist: Counter[int] = Counter()
        self.producer_wait_s = 0.0

    # -- state -------------------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def admission_limit(self) -> int:
        """How many groups may be buffered or generating now without any becoming stale."""
        return (self.generator_version - self.trainer_version + self.offpolicy + 1) * self.batch_groups

    def can_start(self) -> bool:
        return self._in_flight + len(self._buffer) < self.admission_limit()

    def is_fresh(self, oldest_version: int, at_version: int) -> bool:
        return at_version - oldest_version <= self.offpolicy

    def _notify(self) -> None:
        # wake every waiter; each re-checks its own condition (one Event per generation of changes,
        # so sync methods can notify without holding an asyncio lock)
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            await self._changed.wait()

    # -- versions ----------------------------------------------------------------------------------
    def publish_generator_version(self, version: int) -> None:
        """New weights are live on the generator: waiting producers may be admitted."""
        if version < self.generator_version:
            raise ValueError(f"generator version went back from {self.generator_version} to {version}")
        self.generator_version = version
        self._notify()

    def set_trainer_version(self, version: int) -> None:
        """The trainer's next take happens at ``version`` (normally ``take``'s version + 1, set by
        ``take`` itself); buffered groups that will be stale then are dropped now, so they never hold
        admission slots."""
        if version < self.trainer_version:
            raise ValueError(f"trainer version went back from {self.trainer_version} to {version}")
        self.trainer_version = version
        self._prune()
        self._notify()

    def _prune(self) -> None:
        keep: list[BufferedGroup] = []
        stale: list[BufferedGroup] = []
        for g in self._buffer:
            (keep if self.is_fresh(g.oldest_version, self.trainer_version) else stale).append(g)
        self._buffer = keep
        self._drop(stale)

    def _drop(self, groups: list[BufferedGroup]) -> None:
        self.dropped_stale_total += len(groups)
        self._dropped_since_take += len(groups)
        if self.on_drop is not None:
            for g in groups:
                self.on_drop(g)

    # -- producers ---------------------------------------------------------------------------------
    async def reserve(self) -> Ticket:
        """Wait until a group started now is sure to be fresh when consumed, then claim its slot."""
        t0 = self.clock()
        await self._wait_until(self.can_start)
        self._in_flight += 1
        now = self.clock()
        self.producer_wait_s += now - t0
        return Ticket(next(self._tickets), self.generator_version, now)

    def cancel(self, ticket: Ticket) -> None:
        """The producer gave up (no more prompts, or its rollout failed)."""
        self._in_flight -= 1
        self._notify()

    def put(self, ticket: Ticket, samples: Sequence[Sample], key: Any = None) -> bool:
        """A finished group; False when it was already stale for the next take (dropped, counted).
        ``key`` travels with the group (``BufferedGroup.key``), to the batch or to ``on_drop``."""
        self._in_flight -= 1
        versions = [v for s in samples if (v := s.oldest_version) is not None]
        newest = [v for s in samples if (v := s.newest_version) is not None]
        # a group without generated tokens (all max_tokens=0) is as old as the weights it started on
        oldest = min(versions, default=ticket.policy_version)
        group = BufferedGroup(
            samples=list(samples), oldest_version=oldest, newest_version=max(newest, default=oldest),
            policy_version=ticket.policy_version, started_at=ticket.started_at, finished_at=self.clock(),
            seq=next(self._seq), key=key,
        )
        fresh = self.is_fresh(oldest, self.trainer_version)
        if fresh:
            self._buffer.append(group)
        else:
            self._drop([group])
        self._notify()
        return fresh

    # -- trainer -----------------------------------------------------------------------------------
    def try_take(self, batch_groups: int, current_version: int) -> TakenBatch | None:
        """``batch_groups`` groups fresh at ``current_version`` (oldest first: those are the closest
        to falling out of the window), or None when fewer are buffered. Stale ones are dropped."""
        if current_version > self.trainer_version:
            self.set_trainer_version(current_version)
        elif current_version < self.trainer_version:
            raise ValueError(f"take at version {current_version} after the window moved to {self.trainer_version}")
        self._prune()
        if len(self._buffer) < batch_groups:
            return None
        order = sorted(self._buffer, key=lambda g: (g.oldest_version, g.seq))
        taken, chosen = order[:batch_groups], {id(g) for g in order[:batch_groups]}
        self._buffer = [g for g in self._buffer if id(g) not in chosen]
        staleness = [current_version - g.oldest_version for g in taken]
        self.staleness_hist.update(staleness)
        batch = TakenBatch(current_version, taken, staleness, self._dropped_since_take)
        self._dropped_since_take = 0
        # the optimizer step that follows produces current_version + 1: admit producers against it
        self.set_trainer_version(current_version + 1)
        return batch

    async def take(self, batch_groups: int, current_version: int) -> TakenBatch:
        batch: TakenBatch | None = None

        def ready() -> bool:
            nonlocal batch
            batch = self.try_take(batch_groups, current_version)
            return batch is not None

        await self._wait_until(ready)
        assert batch is not None
        return batch


async def take_watching(window: OffPolicyWindow, batch_groups: int, version: int,
                        producers: list[asyncio.Task[None]]) -> TakenBatch | None:
    """``window.take`` that does not wait forever on producers that are gone: re-raises the first failed
    producer's exception, and once every producer has stopped returns what is buffered (``try_take``:
    None when too few groups are)."""
    take = asyncio.ensure_future(window.take(batch_groups, version))
    try:
        while True:
            for p in producers:
                if p.done() and not p.cancelled() and p.exception() is not None:
                    raise p.exception()  # type: ignore[misc]
            pending = [p for p in producers if not p.done()]
            if not pending:
                # nothing more will arrive; the last put may not have reached the take task yet
                take.cancel()
                return window.try_take(batch_groups, version)
            done, _ = await asyncio.wait([take, *pending], return_when=asyncio.FIRST_COMPLETED)
            if take in done:
                return take.result()
    finally:
        if not take.done():
            take.cancel()
