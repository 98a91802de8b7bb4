"""A whole asynchronous RL loop over ``titan_rl_ext.rl.async_loop.OffPolicyWindow`` with injected rollout, train
and push functions and an injected clock: the window's contract exercised end to end, deterministically, in tests.
The trainer's own loop (``rl/rollout_service.py`` and ``rl/trainer.py``) drives the same window; this harness is
what lets a test script producers, steps and pushes without a model or a server."""

from __future__ import annotations

import asyncio
import inspect
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from titan_rl_ext.rl.async_loop import Clock, OffPolicyWindow, TakenBatch, take_watching
from titan_rl_ext.rl.samples import Sample

RolloutFn = Callable[[Any], Awaitable[list[Sample]]]
TrainResult = int | tuple[int, Mapping[str, Any]]
TrainStep = Callable[[list[list[Sample]]], TrainResult | Awaitable[TrainResult]]
PushWeights = Callable[[int], None | Awaitable[None]]


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    """Coroutine functions run on the loop; plain functions (a training step, a blocking weight
    push) run in a worker thread so producers keep streaming meanwhile -- the point of async RL."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    out = await asyncio.to_thread(fn, *args)
    if inspect.isawaitable(out):
        out = await out
    return out


@dataclass(slots=True)
class StepRecord:
    step: int
    version: int
    """Version the batch was trained at (the new weights are ``version + 1`` normally)."""
    new_version: int
    metrics: dict[str, Any] = field(default_factory=dict)


class AsyncRLLoop:
    """N producer tasks run ``rollout(prompt)`` (e.g. ``functools.partial(rollout_group, client,
    make_env, G=8, sampling=...)``) over a shared prompt iterator into an ``OffPolicyWindow``; the
    trainer takes ``batch_groups`` groups per step, runs ``train_step(groups) -> new_version`` (or
    ``(new_version, metrics)``), then ``push_weights(new_version)``. In-flight sequences are never
    interrupted by a push: their later tokens carry the new version."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        offpolicy: int = 1
        batch_groups: int = 4
        num_producers: int = 4

    def __init__(
        self,
        config: Config,
        rollout: RolloutFn,
        prompts: Iterable[Any],
        train_step: TrainStep,
        push_weights: PushWeights,
        *,
        initial_version: int = 0,
        clock: Clock = time.monotonic,
        logger: Any | None = None,
    ) -> None:
        self.config = config
        self.rollout = rollout
        self.prompts = iter(prompts)
        self.train_step = train_step
        self.push_weights = push_weights
        self.version = initial_version
        self.clock = clock
        self.logger = logger
        self.window = OffPolicyWindow(config.offpolicy, config.batch_groups, initial_version=initial_version, clock=clock)
        self.records: list[StepRecord] = []
        self.started_policy_versions: list[tuple[int, int]] = []
        """(generator version at admission, trainer version at admission) per started group."""

    async def _produce(self) -> None:
        while True:
            ticket = await self.window.reserve()
            try:
                prompt = next(self.prompts)
            except StopIteration:
                self.window.cancel(ticket)
                return
            self.started_policy_versions.append((ticket.policy_version, self.window.trainer_version))
            try:
                group = await self.rollout(prompt)
            except BaseException:
                self.window.cancel(ticket)
                raise
            self.window.put(ticket, group)

    async def _take(self, producers: list[asyncio.Task[None]]) -> TakenBatch | None:
        """The next batch; re-raises a producer's failure; None when the prompts ran out."""
        return await take_watching(self.window, self.config.batch_groups, self.version, producers)

    async def run(self, num_steps: int) -> list[StepRecord]:
        from titan_rl_ext.rl.metrics import (SWAP_LATENCY_S, TOKENS_PER_SECOND_FULL_STEP, TRAINER_STEP_S,
                                             TRAINER_WAIT_S, rollout_metrics)

        producers = [asyncio.create_task(self._produce()) for _ in range(self.config.num_producers)]
        try:
            last = self.clock()
            for step in range(num_steps):
                batch = await self._take(producers)
                if batch is None:
                    break
                t_taken = self.clock()
                groups = [g.samples for g in batch.groups]
                result = await _call(self.train_step, groups)
                new_version, train_metrics = (result, {}) if isinstance(result, int) else result
                if new_version <= self.version:
                    raise ValueError(f"train_step returned version {new_version}; it must exceed {self.version}")
                t_trained = self.clock()
                # the window must know the trainer's version before the push makes producers runnable
                self.window.set_trainer_version(new_version)
                await _call(self.push_weights, new_version)
                t_pushed = self.clock()
                self.window.publish_generator_version(new_version)
                tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for g in groups for s in g)
                full_s = t_pushed - last
                metrics: dict[str, Any] = {
                    **rollout_metrics(groups),
                    "staleness/mean": statistics.fmean(batch.staleness),
                    "staleness/max": max(batch.staleness),
                    "staleness/hist": list(batch.staleness),
                    "rollout/dropped_stale": batch.dropped_stale,
                    "rollout/dropped_stale_total": self.window.dropped_stale_total,
                    "rollout/mixed_version_groups": sum(g.mixed_versions for g in batch.groups) / len(batch.groups),
                    "rollout/producer_wait_s_total": self.window.producer_wait_s,
                    TRAINER_WAIT_S: t_taken - last,
                    TRAINER_STEP_S: t_trained - t_taken,
                    TOKENS_PER_SECOND_FULL_STEP: tokens / full_s if full_s > 0 else float("nan"),
                    SWAP_LATENCY_S: t_pushed - t_trained,
                    "version": new_version,
                    **dict(train_metrics),
                }
                self.records.append(StepRecord(step, self.version, new_version, metrics))
                if self.logger is not None:
                    self.logger.log(step, metrics)
                self.version = new_version
                last = t_pushed
        finally:
            for p in producers:
                p.cancel()
            await asyncio.gather(*producers, return_exceptions=True)
        return self.records
