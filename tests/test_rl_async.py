"""The off-policy window and the async loop, with a manual clock and fake rollouts (no model, no
server); and the metrics they log (JSONL, TensorBoard, plots)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from rl_async_harness import AsyncRLLoop

from titan_rl_ext.rl.async_loop import ManualClock, OffPolicyWindow
from titan_rl_ext.rl.metrics import (
    DROPPED_STALE,
    LOGPROB_DIFF_ABS_MEAN,
    LOGPROB_DIFF_MAX,
    RATIO_TOKENS_DIFFERENT,
    STALENESS_MAX,
    SWAP_LATENCY_S,
    TOKENS_PER_SECOND_FULL_STEP,
    MetricsLogger,
    bit_wise_metrics,
    gap_metrics,
    read_metrics,
)
from titan_rl_ext.rl.rollout import ENV_TOKEN_VERSION, Sample


def _sample(versions: list[int], reward: float = 1.0, group_id: int = 0) -> Sample:
    n = len(versions)
    return Sample(prompt_ids=[1, 2], completion_ids=list(range(3, 3 + n)), gen_logprobs=[-1.0] * n,
                  token_versions=versions, loss_mask=[v != ENV_TOKEN_VERSION for v in versions], reward=reward,
                  finish_reason="length", group_id=group_id)


def _group(oldest: int, newest: int | None = None, g: int = 2) -> list[Sample]:
    return [_sample([oldest, newest if newest is not None else oldest]) for _ in range(g)]


async def _put(w: OffPolicyWindow, group: list[Sample]) -> bool:
    return w.put(await w.reserve(), group)


# -- the window -------------------------------------------------------------------------------------


def test_staleness_boundary_is_inclusive_and_drops_are_counted() -> None:
    async def go() -> None:
        w = OffPolicyWindow(offpolicy=2, batch_groups=1, initial_version=5)
        assert await _put(w, _group(3))           # 5 - 3 = 2 = offpolicy: kept
        assert not await _put(w, _group(2))       # 3 > 2: stale on arrival, dropped
        # env tokens (version -1) never count as the oldest policy
        assert await _put(w, [_sample([4, ENV_TOKEN_VERSION, 4])])
        batch = w.try_take(1, 5)
        assert batch is not None and batch.staleness == [2] and batch.dropped_stale == 1  # oldest first
        assert w.dropped_stale_total == 1
        # a buffered group falls out when the trainer moves on: 7 - 4 = 3 > 2
        assert w.try_take(1, 7) is None
        assert w.dropped_stale_total == 2 and w.buffered == 0
        assert dict(w.staleness_hist) == {2: 1}

    asyncio.run(go())


def test_take_returns_oldest_first_and_waits_for_a_full_batch() -> None:
    async def go() -> None:
        w = OffPolicyWindow(offpolicy=3, batch_groups=2, initial_version=3)
        for v in (3, 1, 2):
            assert await _put(w, _group(v))
        batch = w.try_take(2, 3)
        assert batch is not None and [g.oldest_version for g in batch.groups] == [1, 2] and batch.staleness == [2, 1]
        taker = asyncio.create_task(w.take(2, 4))
        await asyncio.sleep(0)
        assert not taker.done()  # one group buffered, two needed
        w.publish_generator_version(4)
        await _put(w, _group(4, 5))
        b2 = await taker
        assert b2.staleness == [1, 0] and b2.groups[1].mixed_versions

    asyncio.run(go())


def test_backpressure_blocks_producers_until_new_weights_and_measures_wait() -> None:
    clock = ManualClock()

    async def go() -> None:
        w = OffPolicyWindow(offpolicy=1, batch_groups=2, clock=clock)
        tickets = [await w.reserve() for _ in range(4)]  # (1 + offpolicy) * B slots with current weights
        assert w.admission_limit() == 4 and w.in_flight == 4
        fifth = asyncio.create_task(w.reserve())
        await asyncio.sleep(0)
        assert not fifth.done()
        for t in tickets[:2]:
            w.put(t, _group(0))
        clock.advance(3.0)
        assert w.try_take(2, 0) is not None  # the trainer moves to version 1 ...
        await asyncio.sleep(0)
        # ... but the generator still has version 0: a group started now would be trained at version 2
        assert not fifth.done()
        w.set_trainer_version(1)
        clock.advance(1.5)
        w.publish_generator_version(1)
        ticket = await fifth
        assert ticket.policy_version == 1 and w.producer_wait_s == pytest.approx(4.5)

    asyncio.run(go())


def test_offpolicy_zero_is_synchronous() -> None:
    async def go() -> None:
        w = OffPolicyWindow(offpolicy=0, batch_groups=2)
        ts = [await w.reserve() for _ in range(2)]
        blocked = asyncio.create_task(w.reserve())
        await asyncio.sleep(0)
        assert not blocked.done()  # only one batch may be generated per policy version
        for t in ts:
            w.put(t, _group(0))
        assert w.try_take(2, 0) is not None
        await asyncio.sleep(0)
        assert not blocked.done()  # training with version 0 in progress: nothing may start on it
        w.publish_generator_version(1)
        assert (await blocked).policy_version == 1
        # a group from the old policy arriving late is dropped, never trained on
        late = OffPolicyWindow(offpolicy=0, batch_groups=1)
        t = await late.reserve()
        late.set_trainer_version(1)
        assert not late.put(t, _group(0)) and late.dropped_stale_total == 1

    asyncio.run(go())


# -- the loop ---------------------------------------------------------------------------------------


class FakeGenerator:
    """Stands in for the server: a rollout emits one token per event-loop turn, each stamped with the
    weight version current at that moment (so pushes land mid-sequence)."""

    def __init__(self, tokens: int = 6) -> None:
        self.version = 0
        self.tokens = tokens
        self.prompts_seen: list[int] = []

    async def rollout(self, prompt: int) -> list[Sample]:
        self.prompts_seen.append(prompt)
        versions: list[list[int]] = [[], []]
        for _ in range(self.tokens):
            for vs in versions:
                vs.append(self.version)
            await asyncio.sleep(0)
        return [_sample(vs, reward=float(prompt % 2), group_id=prompt) for vs in versions]


def _run_loop(offpolicy: int, steps: int, clock: ManualClock | None = None, logger: Any = None,
              prompts: Any = None, batch_groups: int = 2, tokens: int = 6) -> tuple[AsyncRLLoop, FakeGenerator]:
    gen = FakeGenerator(tokens)
    clock = clock or ManualClock()

    async def train_step(groups: list[list[Sample]]) -> tuple[int, dict[str, float]]:
        assert len(groups) == batch_groups
        for _ in range(4):  # producers keep streaming while the trainer works
            await asyncio.sleep(0)
        clock.advance(2.0)
        return loop.version + 1, {"loss/clip_frac_low": 0.0}

    async def push_weights(version: int) -> None:
        await asyncio.sleep(0)
        clock.advance(0.5)
        gen.version = version

    loop = AsyncRLLoop(
        AsyncRLLoop.Config(offpolicy=offpolicy, batch_groups=batch_groups, num_producers=3), gen.rollout,
        prompts if prompts is not None else iter(range(10_000)), train_step, push_weights, clock=clock, logger=logger,
    )
    asyncio.run(loop.run(steps))
    return loop, gen


def test_loop_offpolicy_zero_trains_only_on_current_weights() -> None:
    loop, _ = _run_loop(offpolicy=0, steps=4)
    assert [r.version for r in loop.records] == [0, 1, 2, 3]
    for r in loop.records:
        assert r.metrics["staleness/max"] == 0 and r.metrics["rollout/mixed_version_groups"] == 0
    assert loop.window.dropped_stale_total == 0
    # every group started on the weights it was trained with
    assert all(gv == tv for gv, tv in loop.started_policy_versions)


def test_loop_offpolicy_one_runs_ahead_with_straddling_sequences() -> None:
    clock = ManualClock()
    # rollouts (16 event-loop turns) outlast a training step (~8 turns): pushes land mid-sequence
    loop, _ = _run_loop(offpolicy=1, steps=6, clock=clock, tokens=16)
    st = [r.metrics[STALENESS_MAX] for r in loop.records]
    assert max(st) == 1 and all(s <= 1 for s in st)  # ran ahead, within the window
    assert any(r.metrics["rollout/mixed_version_groups"] > 0 for r in loop.records)  # a swap mid-sequence
    assert loop.window.dropped_stale_total == 0  # admission control kept every started group usable
    assert all(gv >= tv - 1 for gv, tv in loop.started_policy_versions)
    m = loop.records[-1].metrics
    # the manual clock: 2 s of training + 0.5 s of push per step, rollouts take no clock time
    assert m[SWAP_LATENCY_S] == pytest.approx(0.5) and m["perf/trainer/step_s"] == pytest.approx(2.0)
    tokens = 2 * 2 * (2 + 16)  # groups x samples x (prompt + completion)
    assert m[TOKENS_PER_SECOND_FULL_STEP] == pytest.approx(tokens / 2.5)
    assert m["loss/clip_frac_low"] == 0.0 and m["version"] == 6


def test_loop_stops_when_prompts_run_out_and_propagates_producer_errors() -> None:
    loop, gen = _run_loop(offpolicy=1, steps=10, prompts=iter(range(5)))
    assert len(loop.records) == 2 and sorted(gen.prompts_seen) == [0, 1, 2, 3, 4]

    async def boom(prompt: int) -> list[Sample]:
        raise RuntimeError("generator down")

    loop = AsyncRLLoop(AsyncRLLoop.Config(offpolicy=0, batch_groups=1, num_producers=2), boom, iter(range(3)),
                       lambda groups: 1, lambda v: None)
    with pytest.raises(RuntimeError, match="generator down"):
        asyncio.run(loop.run(1))


def test_loop_runs_sync_callbacks_in_threads() -> None:
    gen = FakeGenerator()
    pushed: list[int] = []

    def push(v: int) -> None:
        gen.version = v
        pushed.append(v)

    loop = AsyncRLLoop(AsyncRLLoop.Config(offpolicy=1, batch_groups=2, num_producers=2), gen.rollout, iter(range(100)),
                       lambda groups: loop.version + 1, push)
    asyncio.run(loop.run(3))
    assert pushed == [1, 2, 3] and all(r.metrics[STALENESS_MAX] <= 1 for r in loop.records)


# -- metrics ----------------------------------------------------------------------------------------


def test_bit_wise_metrics_over_mask_only() -> None:
    gen_T = torch.tensor([float("nan"), -1.0, -2.0, -3.0, 5.0])
    ours_T = torch.tensor([float("nan"), -1.0, -2.5, -3.0, float("nan")])
    mask_T = torch.tensor([False, True, True, True, False])
    m = bit_wise_metrics(gen_T, ours_T, mask_T)
    assert m[LOGPROB_DIFF_ABS_MEAN] == pytest.approx(0.5 / 3) and m[LOGPROB_DIFF_MAX] == 0.5
    assert m[RATIO_TOKENS_DIFFERENT] == pytest.approx(1 / 3)
    assert bit_wise_metrics(gen_T, gen_T.clone(), mask_T)[RATIO_TOKENS_DIFFERENT] == 0.0


def test_only_whole_turns_of_a_version_are_compared_at_it() -> None:
    from titan_rl_ext.rl.samples import exact_at_mask

    E = ENV_TOKEN_VERSION
    # fresh at 3; a turn a swap split (2 -> 3: its tail is at 3 but sampled over a cache version 2 wrote);
    # stale at 2; two turns at 3; turns on both sides of a swap (2 | 3); a split second turn after a whole one
    whole, split, old = _sample([3, 3]), _sample([2, 3, 3]), _sample([2, 2])
    turns, across, split2 = _sample([3, E, 3]), _sample([2, 2, E, E, 3]), _sample([2, E, 2, 3])
    assert [s.exact_versions for s in (whole, split, old, turns, across, split2)] == [
        [3, 3], [None] * 3, [2, 2], [3, None, 3], [2, 2, None, None, 3], [2, None, None, None]]
    p = [False, False]  # the prompt
    assert exact_at_mask([whole, split, old, turns, across, split2], 3).tolist() == (
        p + [True, True] + p + [False] * 3 + p + [False] * 2 + p + [True, False, True] + p + [False] * 4 + [True]
        + p + [False] * 4)
    assert exact_at_mask([across, split2], 2).tolist() == p + [True, True, False, False, False] + p + [True] + [False] * 3


def test_gap_metrics_named_counted_and_nan_when_empty() -> None:
    m = gap_metrics(torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -2.5]), "bit_wise_stale")
    assert m == {"bit_wise_stale/logprob_diff/abs_mean": 0.25, "bit_wise_stale/logprob_diff/max": 0.5,
                 "bit_wise_stale/ratio_tokens_different": 0.5, "bit_wise_stale/num_tokens": 2}
    empty = gap_metrics(torch.zeros(0), torch.zeros(0))
    assert empty["bit_wise/num_tokens"] == 0
    assert all(v != v for k, v in empty.items() if k != "bit_wise/num_tokens")  # NaN: undefined, not 0


def test_metrics_jsonl_tensorboard_and_plots(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=True) as logger:
        _run_loop(offpolicy=1, steps=3, logger=logger)
        logger.log(3, {**bit_wise_metrics(torch.zeros(4), torch.zeros(4), torch.ones(4, dtype=torch.bool)),
                       "loss/clip_frac_high": torch.tensor(0.25)})
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for key in ("reward/mean", "reward/std", "response_length/mean", "staleness/mean", STALENESS_MAX, DROPPED_STALE,
                SWAP_LATENCY_S, TOKENS_PER_SECOND_FULL_STEP):
        assert all(isinstance(r[key], (int, float)) and not math.isnan(r[key]) for r in records[:3]), key
    assert isinstance(records[0]["staleness/hist"], list) and records[3]["loss/clip_frac_high"] == 0.25
    assert records[3][LOGPROB_DIFF_MAX] == 0.0
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))

    pytest.importorskip("matplotlib")
    from titan_rl_ext.tools.plot import main

    assert main([str(tmp_path)]) == 0
    for name in ("gap.png", "reward.png", "throughput.png", "staleness.png"):
        png = tmp_path / "plots" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_phase_timer_host_and_device_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per phase: host seconds between marks; on CUDA also the stream's seconds between the boundary events
    (read after waiting for the last one). A fake event stands in for CUDA's: it records a device clock."""
    from titan_rl_ext.rl import phase_timer as pt

    clock = {"t": 0.0}

    class FakeEvent:
        waited: list[float] = []

        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.at = None

        def record(self) -> None:
            self.at = clock["t"]

        def synchronize(self) -> None:
            FakeEvent.waited.append(self.at)

        def elapsed_time(self, end: "FakeEvent") -> float:
            return (end.at - self.at) * 1e3  # ms, as CUDA's

    cpu = pt.PhaseTimer("cpu")
    with pytest.raises(RuntimeError, match="before start"):
        cpu.mark("x")
    cpu.start()
    cpu.mark("a")
    cpu.mark("b")
    m = cpu.metrics()
    assert set(m) == {"perf/trainer/a/host_s", "perf/trainer/b/host_s"} and all(v >= 0 for v in m.values())
    monkeypatch.setattr(pt.torch.cuda, "Event", FakeEvent)
    gpu = pt.PhaseTimer("cuda")
    gpu.start()
    clock["t"] = 0.25
    gpu.mark("fwd_bwd")
    clock["t"] = 1.0
    gpu.mark("optim")
    m = gpu.metrics()
    assert m["perf/trainer/fwd_bwd/device_s"] == pytest.approx(0.25) and m["perf/trainer/optim/device_s"] == pytest.approx(0.75)
    assert FakeEvent.waited == [1.0] and "perf/trainer/optim/host_s" in m
