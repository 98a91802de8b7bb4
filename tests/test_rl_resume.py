"""Trainer resilience: a trainer SIGKILLed between steps resumes from its checkpoint with the same data
order, and its next step equals the uninterrupted run's bit for bit on CPU.

Two fresh, identically started vLLM servers (tiny Qwen3.5, fp32, batch invariant, swap endpoint on).
Run A trains 3 synchronous steps (``offpolicy=0``, a checkpoint every step). Run B starts the same
3-step run, is SIGKILLed (trainer and torchrun, no clean exit) as soon as its step-2 checkpoint is
complete -- its producers have already drawn step 3's prompts and are generating them -- and is
started again with the same command. Its step 3 must equal A's: the same prompts (the checkpointed
prompt cursor hands the drawn-but-untrained ones out again), the same completions (per-request
sampling seeds derived from the prompt index), the same loss and the same final weights.

The unit tests at the top cover the pieces without a server: seeking the prompt stream, the prompt
ledger's cursor, seeded requests.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from rl_runs import drop_timing, kill_tree, records
from servers import one_core, openai_server, server_env
from titan_rl_ext.rl.rollout import Generation, SamplingConfig, SingleTurnEnv, rollout_group, sample_seed
from titan_rl_ext.rl.config import RLConfig
from titan_rl_ext.rl.prompts import PromptCursor, PromptLedger
from titan_rl_ext.rl.tasks import task_named

REPO = Path(__file__).resolve().parents[1]
TOKEN = "rl-resume-test-token-3b9f"
STEPS = 3
PROMPTS_PER_STEP = 4  # the recipe's
# rewards of the untrained tiny model are rare (~2 % of samples): 16 samples per prompt and this
# prompt/sampling seed give groups with reward variance, so the compared losses, gradients and
# weights are not trivially those of all-zero advantages (asserted below)
RUN_ARGS = ["--rl.seed", "1", "--rl.group-size", "16"]

# ---------------------------------------------------------------------------------------------
# pieces


@pytest.mark.parametrize("task", ["synthetic_sum", "synthetic_copy"])
def test_prompt_stream_seeks_to_any_position(task: str) -> None:
    rl = RLConfig(model_dir="unused", task=task, seed=3)
    stream = task_named(task).prompts
    full = list(itertools.islice(stream(rl, None, 0, None), 700))
    for start in (0, 1, 255, 256, 257, 600):  # inside, at and across the synthetic stream's 256-item epochs
        assert list(itertools.islice(stream(rl, None, start, None), 100)) == full[start:start + 100], start


def test_math_prompt_stream_seeks_across_epochs(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"problem": f"p{i}", "answer": str(i)}) + "\n" for i in range(7)))
    rl = RLConfig(model_dir="unused", task="math", dataset_path=str(rows), seed=1)
    stream = task_named("math").prompts
    full = list(itertools.islice(stream(rl, None, 0, None), 30))
    assert sorted(x.prompt for x in full[:7]) == sorted(f"p{i}" for i in range(7))  # an epoch is a shuffle
    for start in (3, 7, 12):
        assert list(itertools.islice(stream(rl, None, start, None), 10)) == full[start:start + 10]


def _ledger(cursor: PromptCursor) -> PromptLedger:
    return PromptLedger(iter(range(cursor.next, 10_000)), cursor)  # item i is the int i


def test_ledger_redraws_open_prompts_and_skips_done_ones_after_a_restart() -> None:
    ledger = _ledger(PromptCursor())
    assert [ledger.draw() for _ in range(6)] == [(i, i) for i in range(6)]
    for i in (0, 2, 3):  # taken into a batch (or dropped): done; 1, 4, 5 still generating
        ledger.close(i)
    cursor = ledger.cursor()
    assert cursor == PromptCursor(1, (2, 3))
    assert PromptCursor.from_json(cursor.to_json()) == cursor

    resumed = _ledger(cursor)  # the run died: 1, 4, 5 come again, 2 and 3 do not
    assert [resumed.draw() for _ in range(4)] == [(1, 1), (4, 4), (5, 5), (6, 6)]
    assert resumed.cursor() == PromptCursor(1, (2, 3))
    for i in (1, 4, 5, 6):
        resumed.close(i)
    assert resumed.cursor() == PromptCursor(7, ())


def test_ledger_cursor_is_the_step_boundary_when_nothing_is_open() -> None:
    ledger = _ledger(PromptCursor())
    for step in range(3):  # offpolicy=0: each step draws exactly its prompts, then takes them all
        drawn = [ledger.draw()[0] for _ in range(PROMPTS_PER_STEP)]
        assert drawn == list(range(step * PROMPTS_PER_STEP, (step + 1) * PROMPTS_PER_STEP))
        for i in drawn:
            ledger.close(i)
        assert ledger.cursor() == PromptCursor((step + 1) * PROMPTS_PER_STEP, ())
    # done prompts ahead of the draw position (a checkpoint taken while older prompts were open) are skipped
    ahead = _ledger(PromptCursor(4, (5, 6, 9)))
    assert [ahead.draw()[0] for _ in range(4)] == [4, 7, 8, 10]


class _RecordingGenerator:
    def __init__(self) -> None:
        self.seeds: list[int | None] = []

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingConfig) -> Generation:
        self.seeds.append(sampling.seed)
        await asyncio.sleep(0)
        return Generation(token_ids=[5], logprobs=[-1.0], versions=[0], finish_reason="length")


class _Tok:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def test_seeded_requests_per_sample() -> None:
    from titan_rl_ext.rl.rewards import SyntheticTask

    assert SamplingConfig(seed=7).request_fields()["seed"] == 7 and "seed" not in SamplingConfig().request_fields()
    seeds = [sample_seed(0, 12, j) for j in range(4)]
    assert len(set(seeds)) == 4 and all(0 <= s < 2**63 for s in seeds)
    assert sample_seed(1, 2) != sample_seed(2, 1) and sample_seed(0, 12, 3) == seeds[3]
    gen = _RecordingGenerator()
    ex = SyntheticTask().sample(1, seed=0)[0]
    group = asyncio.run(rollout_group(gen, lambda: SingleTurnEnv(_Tok(), SyntheticTask.score), ex, 4, SamplingConfig(),
                                      group_id=12, seeds=seeds))
    assert [s.group_id for s in group] == [12] * 4
    # one request per sample, turn 1 of episode j seeded by sample_seed(seeds[j], 1)
    assert sorted(gen.seeds) == sorted(sample_seed(s, 1) for s in seeds)
    with pytest.raises(ValueError, match="3 seeds for a group of 4"):
        asyncio.run(rollout_group(gen, lambda: SingleTurnEnv(_Tok(), SyntheticTask.score), ex, 4, SamplingConfig(),
                                  seeds=seeds[:3]))


# ---------------------------------------------------------------------------------------------
# end to end: kill -9 between steps, resume, compare with the uninterrupted run


def _train_cmd(out: Path, base: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
            "-m", "titan_rl_ext.train", "--module", "titan_rl_ext.configs", "--config", "rl_tiny_cpu",
            "--training.steps", str(STEPS), "--rl.no-spawn-server", "--rl.generator-urls", base,
            "--rl.offpolicy", "0", "--rl.run-dir", str(out / "run"), "--dump-folder", str(out / "dump"),
            "--checkpoint.enable", "--checkpoint.interval", "1", *RUN_ARGS]


def _train_env(tmp_path: Path, cache: Path) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                HF_HOME=str(tmp_path / "hf"), TITAN_RL_CACHE=str(cache), TITAN_SWAP_TOKEN=TOKEN,
                PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _train(out: Path, base: str, env: dict[str, str], log_name: str) -> str:
    r = subprocess.run(_train_cmd(out, base), capture_output=True, text=True, timeout=300, env=env, cwd=out)
    log = r.stdout + r.stderr
    (out / log_name).write_text(log)
    assert r.returncode == 0, log[-6000:]
    return log


def _train_and_kill_after_checkpoint(out: Path, base: str, env: dict[str, str], step: int, log_name: str) -> None:
    """Start the run and SIGKILL it as soon as its step-``step`` checkpoint is complete (DCP writes
    ``.metadata`` last), i.e. while it works on the next step."""
    marker = out / "dump" / "checkpoint" / f"step-{step}" / ".metadata"
    with (out / log_name).open("wb") as log:
        proc = subprocess.Popen(_train_cmd(out, base), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out)
        try:
            deadline = time.monotonic() + 300
            while not marker.exists():
                if proc.poll() is not None:
                    raise AssertionError(f"the run exited ({proc.returncode}) before its step-{step} checkpoint:\n"
                                         + (out / log_name).read_text()[-6000:])
                if time.monotonic() > deadline:
                    raise AssertionError(f"no step-{step} checkpoint after 300 s")
                time.sleep(0.02)  # polling the file system: there is nothing to wait on
        finally:
            status = kill_tree(proc)
    assert status == -signal.SIGKILL, f"torchrun ended with {status}, not by the SIGKILL"


@pytest.mark.slow
def test_killed_trainer_resumes_bit_equal_to_uninterrupted_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t0 = time.monotonic()
    cache = tmp_path / "cache"
    monkeypatch.setenv("TITAN_RL_CACHE", str(cache))
    from titan_rl_ext.configs.rl_common import tiny_rl_checkpoint

    model_dir = Path(tiny_rl_checkpoint())
    env = _train_env(tmp_path, cache)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    srv_env = server_env(TITAN_SWAP_TOKEN=TOKEN, TITAN_BATCH_INVARIANT="1")
    # two fresh servers, started identically but for the core their engine thread is bound to (one_core: one thread
    # either way, the same bits), booting side by side
    with openai_server(model_dir, a / "server.log", 512, ["--seed", "0"], env={**srv_env, **one_core(0)}) as srv_a, \
            openai_server(model_dir, b / "server.log", 512, ["--seed", "0"], env={**srv_env, **one_core(1)}) as srv_b:
        srv_a.wait_ready()
        srv_b.wait_ready()
        t_boot = time.monotonic()
        # run A and run B side by side, each on its own server (the trainer and its server mostly take turns,
        # so two runs fill the two cores one leaves half idle); nothing either records depends on timing
        # except what drop_timing drops
        with ThreadPoolExecutor(1) as pool:
            run_a = pool.submit(_train, a, srv_a.base, env, "train.log")
            _train_and_kill_after_checkpoint(b, srv_b.base, env, 2, "train_killed.log")
            killed = records(b / "run" / "metrics.jsonl")
            assert [r["step"] for r in killed] == [1, 2], \
                f"the kill landed after step {killed[-1]['step']}, not between steps 2 and 3"
            assert not (b / "dump" / "checkpoint" / "step-3").exists()
            log_b = _train(b, srv_b.base, env, "train_resumed.log")
            t_b = time.monotonic()
            run_a.result()
            t_a = time.monotonic()
    assert "Training starts at step 3" in log_b, log_b[-3000:]
    assert f"prompt stream resumes at index {2 * PROMPTS_PER_STEP}" in log_b
    assert "already serve version 2" in log_b  # the killed run had pushed its step-2 weights

    rec_a, rec_b = records(a / "run" / "metrics.jsonl"), records(b / "run" / "metrics.jsonl")
    assert [r["step"] for r in rec_a] == [1, 2, 3] and [r["step"] for r in rec_b] == [1, 2, 3]
    print(f"\nboot {t_boot - t0:.0f}s, run B (killed + resumed) {t_b - t_boot:.0f}s, run A beside it done at "
          f"{t_a - t_boot:.0f}s")
    for ra, rb in zip(rec_a, rec_b):
        print(f"step {ra['step']}: loss A {ra['loss']!r} B {rb['loss']!r}, grad_norm A {ra['grad_norm']!r} "
              f"B {rb['grad_norm']!r}, reward/mean {ra['reward/mean']}")
    # the point: the resumed step's loss is bit-equal (== on the JSON floats), and so is every other
    # non-timing metric (grad norm, rewards, bit_wise/*, versions)
    assert rec_b[-1]["loss"] == rec_a[-1]["loss"]
    assert drop_timing(rec_b[-1]) == drop_timing(rec_a[-1])
    assert [drop_timing(r) for r in rec_b[:2]] == [drop_timing(r) for r in rec_a[:2]]  # two fresh servers agree
    assert all(r["bit_wise/logprob_diff/max"] == 0.0 for r in rec_a + rec_b)
    # non-zero advantages in every step, so the weights and the optimizer state carried through the
    # checkpoint really moved, and step 3's loss and gradient are not those of all-zero advantages
    # (otherwise these comparisons would be vacuous; another machine's kernels may sample other tokens:
    # then pick another --rl.seed in RUN_ARGS)
    assert all(r["grad_norm"] > 0 for r in rec_a), [r["grad_norm"] for r in rec_a]
    assert rec_a[-1]["reward/zero_variance_group_frac"] < 1 and rec_a[-1]["loss"] != 0.0

    roll_a, roll_b = records(a / "run" / "rollouts.jsonl"), records(b / "run" / "rollouts.jsonl")
    assert [r["step"] for r in roll_b] == [1, 2, 3]
    # data order: step k trains on prompts [(k-1)*P, k*P) in both runs, in prompt order
    for k, (ra, rb) in enumerate(zip(roll_a, roll_b), start=1):
        want = list(range((k - 1) * PROMPTS_PER_STEP, k * PROMPTS_PER_STEP))
        assert [g["prompt_index"] for g in ra["groups"]] == want
        assert [g["prompt_index"] for g in rb["groups"]] == want
    # step 3 after the resume: the same prompts, completions, rewards, versions as the uninterrupted run
    assert [g["prompt_ids"] for g in roll_b[-1]["groups"]] == [g["prompt_ids"] for g in roll_a[-1]["groups"]]
    ids = [[s["completion_ids"] for s in g["samples"]] for g in roll_a[-1]["groups"]]
    assert [[s["completion_ids"] for s in g["samples"]] for g in roll_b[-1]["groups"]] == ids
    assert roll_b[-1] == roll_a[-1]
    assert len({tuple(c) for group in ids for c in group}) > 1  # sampled, not one repeated sequence

    # the final weights: trainer A == trainer B, and each server holds its trainer's
    fin_a = json.loads((a / "run" / "final_checksums.json").read_text())
    fin_b = json.loads((b / "run" / "final_checksums.json").read_text())
    assert fin_a["version"] == fin_b["version"] == STEPS
    assert fin_a["server_matches"] is True and fin_b["server_matches"] is True
    assert fin_b["checksums"] == fin_a["checksums"]
    print(f"test wall time {time.monotonic() - t0:.0f}s")
