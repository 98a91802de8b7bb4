"""RL training entry point end to end: a real vLLM server (tiny Qwen3.5, fp32, batch invariant, swap
endpoint on) and ``torchrun -m titan_rl_ext.train --module titan_rl_ext.configs --config rl_tiny_cpu``
for 3 synchronous steps, then a resume from the step-3 checkpoint for a 4th step.

On-policy (``offpolicy=0``) with batch invariance on both sides, every step's rollouts were sampled by
the weights the trainer holds at that step -- the ones it pushed after the previous step -- so the
trainer's recompute must equal the generator's logprobs bit for bit at *every* step, which checks the
push/swap as much as the kernels. After the run the server's weights equal the trainer's final ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rl_runs import BackgroundRun, start_run
from servers import float32_server, one_core, server_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TOKEN = "rl-train-test-token-7d1e"


def _other_weights(model_dir: Path, dest: Path) -> Path:
    """A copy of the checkpoint with one tensor changed: what a generator started from another checkpoint
    serves, at weight version 0 like any fresh server."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, dest)
    for f in dest.glob("*.safetensors"):
        sd = load_file(str(f))
        name = next(k for k in sorted(sd) if sd[k].is_floating_point() and sd[k].dim() == 2)
        sd[name] = sd[name] * 1.01
        save_file(sd, str(f), metadata={"format": "pt"})
        return dest
    raise AssertionError(f"no safetensors in {model_dir}")


# the tests that train against a server of their own, and how it is started (batch invariance, another checkpoint)
SERVED = {"test_rl_train_end_to_end_bitwise_push_and_resume": (True, False),
          "test_rl_train_batch_invariant_window": (False, True),
          "test_rl_train_two_ranks_data_parallel": (True, False)}


@dataclass
class Served:
    boot: Callable[[], Any]  # starts the server
    cache: Path  # the recipe cache (TITAN_RL_CACHE) with the tiny checkpoint the trainer starts from
    model_dir: Path  # what the server serves
    srv: Any = None  # the server, once started

    def start(self) -> Any:
        if self.srv is None:
            self.srv = self.boot()
        return self.srv


@pytest.fixture(scope="module")
def booting(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Served]]:
    """A fresh server for each collected test of ``SERVED`` (the recipe's tiny checkpoint, swap endpoint on), its
    test's alone (a fresh process at version 0, as if the test had started it) and stopped when that test ends. The
    first test's starts now, the others' once it is up (``served``): they boot beside the first test's run, which
    leaves a core mostly idle (a boot is ~25 s of one core), instead of each before its own test. Each engine runs
    on its turn of the cores (``one_core``)."""
    cache = tmp_path_factory.mktemp("rl_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TITAN_RL_CACHE", str(cache))
        from titan_rl_ext.configs.rl_common import tiny_rl_checkpoint

        model_dir = Path(tiny_rl_checkpoint())
    names = [n for n in SERVED if any(item.module is request.module and item.originalname == n
                                      for item in request.session.items)]
    servers: dict[str, Served] = {}
    for i, name in enumerate(names):
        bi, other = SERVED[name]
        d = tmp_path_factory.mktemp("server")
        served_dir = _other_weights(model_dir, d / "other_ckpt") if other else model_dir
        env = server_env(TITAN_SWAP_TOKEN=TOKEN, TITAN_BATCH_INVARIANT="1" if bi else "0", **one_core(i))
        servers[name] = Served(lambda served_dir=served_dir, d=d, env=env: float32_server(
            served_dir, d / "server.log", 512, ["--seed", "0"], env), cache, served_dir)
    try:
        if names:
            servers[names[0]].start()
        yield servers
    finally:
        for s in servers.values():
            if s.srv is not None:
                s.srv.close()


@pytest.fixture
def served(request: pytest.FixtureRequest, booting: dict[str, Served]) -> Iterator[Served]:
    """This test's server from ``booting``, ready (the later tests' start booting then); stopped after the test."""
    s = booting[request.node.originalname]
    try:
        s.start().wait_ready()
        for other in booting.values():
            other.start()
        yield s
    finally:
        s.srv.close()


def _train_env(tmp_path: Path, cache: Path, **extra: str) -> dict[str, str]:
    """A torchrun trainer's environment: offline, one thread, the recipe cache in ``cache``."""
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                HF_HOME=str(tmp_path / "hf"), TITAN_RL_CACHE=str(cache),
                PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)


def _torchrun(tmp_path: Path, cache: Path, base: str, steps: int, log_name: str, nproc: int = 1,
              extra: tuple[str, ...] = (), timeout: float = 300) -> str:
    env = _train_env(tmp_path, cache, TITAN_SWAP_TOKEN=TOKEN)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "titan_rl_ext.train", "--module", "titan_rl_ext.configs", "--config", "rl_tiny_cpu",
           "--training.steps", str(steps), "--rl.no-spawn-server", "--rl.generator-urls", base,
           "--rl.offpolicy", "0", "--rl.run-dir", str(tmp_path / "run"), "--dump-folder", str(tmp_path / "dump"),
           "--checkpoint.enable", "--checkpoint.interval", "1", "--rl.eval-every", "2", "--rl.eval-items", "16",
           *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    log = r.stdout + r.stderr
    (tmp_path / log_name).write_text(log)
    assert r.returncode == 0, log[-6000:]
    return log


def test_rl_train_end_to_end_bitwise_push_and_resume(tmp_path: Path, served: Served) -> None:
    import requests

    srv, cache = served.srv, served.cache
    log1 = _torchrun(tmp_path, cache, srv.base, 3, "train1.log", extra=("--rl.export-hf-dir", str(tmp_path / "export")))
    # a fresh run admits the server only after comparing what it serves with the trainer's weights (after the
    # kernel warm-up's forward and backward, which must leave them as they were)
    assert "RL: kernels warmed in" in log1 and "already serve version 0 (checksums match)" in log1, log1[-3000:]
    run = tmp_path / "run"
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3] and [r["version"] for r in recs] == [1, 2, 3]
    for r in recs:
        print({k: r[k] for k in ("step", "reward/mean", "reward/std", "response_length/mean", "loss",
                                 "bit_wise/logprob_diff/abs_mean", "swap/latency_s")})
        assert r["batch_invariant"] == 1
        assert r["bit_wise/num_tokens"] > 0
        assert r["bit_wise/logprob_diff/abs_mean"] == 0.0 and r["bit_wise/logprob_diff/max"] == 0.0, r
        assert r["bit_wise/ratio_tokens_different"] == 0.0
        assert r["staleness/max"] == 0 and r["rollout/dropped_stale"] == 0
        assert r["swap/latency_s"] > 0
        # the push's phases (trainer: gather, post round, keeping the weights; server: its swap) fit in it
        phases = r["swap/gather_s"] + r["swap/post_s"] + r["swap/remember_s"]
        assert 0 < phases <= r["swap/latency_s"] and 0 < r["swap/server_swap_s"] <= r["swap/post_s"], r
        # held-out greedy evaluation every 2 steps and at the last step
        assert ("eval/reward_mean" in r) == (r["step"] in (2, 3)), r
        if "eval/reward_mean" in r:
            assert r["eval/items"] == 16 and 0.0 <= r["eval/reward_mean"] <= 1.0
    # every token carries the version of the weights that sampled it: step k trains on version k-1
    rolls = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    # a full step runs from the last step's push to this one's: its parts add up to it, and from step 2 on
    # it includes what the loop did between the steps (the last step's logging)
    for r, rec in zip(recs, rolls):
        ntok = sum(s["prompt_len"] + len(s["completion_ids"]) for g in rec["groups"] for s in g["samples"])
        full_s = ntok / r["perf/trainer/tokens_per_second_full_step"]
        parts = [r[f"perf/trainer/{k}"] for k in ("between_steps_s", "wait_s", "step_s")] + [r["swap/latency_s"]]
        assert sum(parts) <= full_s * (1 + 1e-9) and (r["perf/trainer/between_steps_s"] > 0) == (r["step"] > 1), (r, full_s)
        # the train step's phases (host time on CPU; device time too on CUDA) fit in the step
        steps = [r[f"perf/trainer/{p}/host_s"] for p in ("fwd_bwd", "parity", "optim")]
        assert all(x > 0 for x in steps) and sum(steps) <= r["perf/trainer/step_s"], r
    for rec in rolls:
        samples = [s for g in rec["groups"] for s in g["samples"]]
        assert len(samples) == 4 * 8
        for s in samples:
            assert len(s["token_versions"]) == len(s["completion_ids"]) > 0
            assert set(s["token_versions"]) == {rec["step"] - 1}
    # the server swapped to every pushed version and holds the trainer's final weights bit for bit
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert requests.get(f"{srv.base}/titan/v1/weights/version", timeout=10).json()["version"] == 3
    server_sums = requests.get(f"{srv.base}/titan/v1/weights/checksums", headers=auth, timeout=60).json()["checksums"]
    final = json.loads((run / "final_checksums.json").read_text())
    assert final["version"] == 3 and final["server_matches"] is True
    assert server_sums == final["checksums"]
    # the policy exported as a stock HF checkpoint at the end holds exactly the trainer's final weights
    from titan_rl_ext.models.hf import load_hf_model
    from titan_rl_ext.rl.weight_sync import checksum

    exported, _ = load_hf_model(tmp_path / "export")
    assert checksum(exported.state_dict()) == final["checksums"]
    log = srv.log_path.read_text()
    assert TOKEN not in log and (tmp_path / "train1.log").read_text().count(TOKEN) == 0

    # resume: the step-3 checkpoint restores weights, optimizer and the RL version; step 4 trains
    # on version-3 rollouts and pushes version 4
    log2 = _torchrun(tmp_path, cache, srv.base, 4, "train2.log")
    assert "already serve version 3" in log2, log2[-3000:]
    recs2 = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs2] == [1, 2, 3, 4] and recs2[-1]["version"] == 4
    assert recs2[-1]["bit_wise/logprob_diff/max"] == 0.0
    last = json.loads((run / "rollouts.jsonl").read_text().splitlines()[-1])
    assert {v for g in last["groups"] for s in g["samples"] for v in s["token_versions"]} == {3}
    final = json.loads((run / "final_checksums.json").read_text())
    assert final["version"] == 4 and final["server_matches"] is True
    assert requests.get(f"{srv.base}/titan/v1/weights/version", timeout=10).json()["version"] == 4


def test_rl_train_batch_invariant_window(tmp_path: Path, served: Served) -> None:
    """BI as a debug switch over a window of steps: step 2 only. Both sides switch (the generator when the
    weights that generate the next step's groups are published), so step 2's groups were sampled with
    BI and its gap is exactly 0; steps 1 and 3 run the normal kernels.

    The server starts from other weights than the trainer's checkpoint (a fresh server: version 0 too), so
    the trainer's start-up comparison must find them different and push its own before the first rollout
    (issue 23, risk 7): step 2's exact 0 is then also the proof that it did."""
    import re

    log = _torchrun(tmp_path, served.cache, served.srv.base, 3, "train.log",
                    extra=("--rl.batch-invariant-from", "2", "--rl.batch-invariant-steps", "1",
                           "--rl.eval-every", "0", "--rl.served-model-name", str(served.model_dir)))
    assert "holds other weights than the trainer's version 0" in log and "pushing them as version 1" in log, log[-3000:]
    rolls = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert {v for g in rolls[0]["groups"] for s in g["samples"] for v in s["token_versions"]} == {1}
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for r in recs:
        print({k: r[k] for k in ("step", "batch_invariant", "bit_wise/num_tokens", "bit_wise/logprob_diff/abs_mean",
                                 "bit_wise/logprob_diff/max")})
    assert [r["batch_invariant"] for r in recs] == [0, 1, 0]
    # outside the window the generator's and the trainer's kernels differ, and so do the logprobs: the 0
    # inside it is the switch's doing, not a gap that is always 0
    for r in (recs[0], recs[2]):
        assert r["bit_wise/num_tokens"] > 0 and r["bit_wise/logprob_diff/max"] > 0.0, r
    step2 = recs[1]
    assert step2["bit_wise/num_tokens"] > 0
    assert step2["bit_wise/logprob_diff/abs_mean"] == 0.0 and step2["bit_wise/logprob_diff/max"] == 0.0, step2
    switches = re.findall(r"titan batch invariance (on|off)", served.srv.log_path.read_text())
    assert switches == ["off", "on", "off"], switches  # at start, before step 2's rollouts, before step 3's


def test_rl_train_two_ranks_data_parallel(tmp_path: Path, served: Served) -> None:
    """2 ranks (gloo, FSDP2-sharded model): rank 0 generates and broadcasts, each rank trains on half the
    groups, the sharded weights are gathered and pushed. On-policy with BI on, every rank's recompute
    equals the generator's logprobs bit for bit (``bit_wise/*`` gather all ranks' tokens), and the
    server ends on the trainer's gathered final weights."""
    srv, cache = served.srv, served.cache
    _torchrun(tmp_path, cache, srv.base, 2, "train_dp.log", nproc=2)
    run = tmp_path / "run"
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    rolls = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    for r, roll in zip(recs, rolls):
        # every completion token of the step's 4 groups x 8 samples, both ranks' halves
        assert r["bit_wise/num_tokens"] == sum(len(s["completion_ids"]) for g in roll["groups"] for s in g["samples"]), r
        assert r["bit_wise/logprob_diff/max"] == 0.0 and r["bit_wise/ratio_tokens_different"] == 0.0, r
    final = json.loads((run / "final_checksums.json").read_text())
    assert final["version"] == 2 and final["server_matches"] is True
    # both ranks resume from the step-2 checkpoint against the same server: the start-up check of what it
    # serves (a checksum of the gathered weights) is collective, so every rank must take part in it
    log = _torchrun(tmp_path, cache, srv.base, 3, "train_dp_resume.log", nproc=2, timeout=240)
    assert "already serve version 2" in log, log[-3000:]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3] and recs[-1]["version"] == 3
    assert recs[-1]["bit_wise/num_tokens"] > 0 and recs[-1]["bit_wise/logprob_diff/max"] == 0.0, recs[-1]
    final = json.loads((run / "final_checksums.json").read_text())
    assert final["version"] == 3 and final["server_matches"] is True


# the recipes that spawn their own generator, and their extra arguments
SPAWNING = {"test_rl_native_arm_at_toy_size": ("rl_native_cpu", "--training.steps", "2"),
            "test_rl_gpu_recipe_at_toy_size": ("rl_gpu_hybrid_toy", "--rl.batch-invariant-steps", "1000000"),
            "test_a_spawned_generator_takes_pushes_through_vllms_transfer_calls": (
                "rl_gpu_hybrid_toy", "--rl.batch-invariant-steps", "1000000", "--training.steps", "2",
                "--rl.weight-transport", "titan_gloo")}
# what a recipe's run adds to ``_train_env`` (its spawned server inherits it). The native arm: vLLM's own CPU CI setting,
# its model still traced by dynamo but run by the eager backend, with no warm-up pass, instead of ~50 s of one core in
# inductor's code generation at boot; what the test asserts (pushes before the first rollout and at every step land,
# the gap to the trainer is measured and nonzero) depends on vLLM's class and the push path, not on that backend
SPAWN_ENV = {"test_rl_native_arm_at_toy_size": {"VLLM_CPU_CI_ENV": "1"}}


@pytest.fixture(scope="module")
def spawning_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, BackgroundRun]]:
    """The collected ``SPAWNING`` recipes' runs, started at once (as ``test_rl_agents`` does): each is a process
    tree of its own (trainer, spawned server on its turn of the cores, cache), its trainer and generator mostly take
    turns, so side by side the two fill the cores one leaves idle; nothing asserted depends on timing."""
    names = [n for n in SPAWNING if any(item.module is request.module and item.originalname == n
                                        for item in request.session.items)]
    runs: dict[str, BackgroundRun] = {}
    try:
        for i, name in enumerate(names):
            config, *extra = SPAWNING[name]
            d = tmp_path_factory.mktemp(config)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                   "-m", "titan_rl_ext.train", "--module", "titan_rl_ext.configs", "--config", config,
                   "--rl.run-dir", str(d / "run"), "--dump-folder", str(d / "dump"), *extra]
            runs[name] = start_run(cmd, d, _train_env(d, d / "cache", **one_core(i), **SPAWN_ENV.get(name, {})), 600)
        yield runs
    finally:
        for r in runs.values():
            r.stop()


def _spawning_run(request: pytest.FixtureRequest, runs: dict[str, BackgroundRun]) -> tuple[Path, str]:
    """This test's recipe run (``spawning_runs``), waited for to the end; its run folder and log."""
    r = runs[request.node.originalname]
    status = r.wait()
    log = r.log.read_text(errors="replace")
    assert status == 0, log[-6000:]
    return r.dir / "run", log


def test_rl_native_arm_at_toy_size(request: pytest.FixtureRequest, spawning_runs: dict[str, BackgroundRun]) -> None:
    """The comparison's native arm (``rl_native_cpu``): vLLM's own Qwen3.5 class as the spawned generator, fed
    the trainer's bf16 weights every step. It cannot give per-tensor checksums under titan names, so the run
    pushes before its first rollout; every step's pushed weights land (the server's own swap time is there),
    and its logprobs differ from the trainer's (another class's kernels): the gap is measured and nonzero."""
    run, log = _spawning_run(request, spawning_runs)
    assert "cannot compare checksums" in log and "pushing them as version 1" in log, log[-3000:]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs] == [1, 2] and [x["version"] for x in recs] == [2, 3]
    for x in recs:
        assert x["swap/server_swap_s"] > 0 and x["fleet/live"] == 1.0, x
        assert x["loss/num_tokens"] > 0 and x["bit_wise_all/logprob_diff/max"] > 0.0, x
    rolls = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert {v for g in rolls[0]["groups"] for smp in g["samples"] for v in smp["token_versions"]} == {1}
    final = json.loads((run / "final_checksums.json").read_text())
    assert final["version"] == 3 and "server_error" in final  # recorded, not fatal


def test_rl_gpu_recipe_at_toy_size(tmp_path: Path, request: pytest.FixtureRequest,
                                   spawning_runs: dict[str, BackgroundRun]) -> None:
    """The one-GPU recipe of the three-arm comparison (``rl_gpu_hybrid``) at toy size on CPU, its BI arm: it
    spawns its own generator, warms the model up and trains 3 steps off-policy (window 2). The tokens of
    older versions are recomputed with the weights that sampled them (``stale_gap_versions`` 3), so every
    single-version sample's tokens are compared -- fresh ones under ``bit_wise/*``, stale ones under
    ``bit_wise_stale/*`` -- and all are exactly equal; the arms report reads the run into ``rl_gpu.json``."""
    run, _ = _spawning_run(request, spawning_runs)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rolls = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs] == [1, 2, 3]
    assert recs[0]["bit_wise/num_tokens"] > 0 and recs[0]["bit_wise/logprob_diff/max"] == 0.0, recs[0]
    stale_total = 0
    for r, roll in zip(recs, rolls):
        samples = [smp for g in roll["groups"] for smp in g["samples"]]
        single = sum(len(smp["completion_ids"]) for smp in samples if len(set(smp["token_versions"])) == 1)
        mixed = sum(len(set(smp["token_versions"])) > 1 for smp in samples)
        # a window of 2 with 3 remembered versions: every single-version sample is fresh (bit_wise/*) or
        # recomputed with the weights that sampled it (bit_wise_stale/*); a sample straddling a swap is skipped
        assert r["bit_wise/num_tokens"] + r["bit_wise_stale/num_tokens"] == single, (r, single)
        assert r["bit_wise_stale/skipped_samples"] == mixed
        for k, n in (("bit_wise/logprob_diff/max", "bit_wise/num_tokens"),
                     ("bit_wise_stale/logprob_diff/max", "bit_wise_stale/num_tokens")):
            # exactly 0 over the compared tokens; NaN only where this step compared none
            assert (r[k] == 0.0) if r[n] > 0 else (r[k] != r[k]), (k, r[k], n, r[n])
        stale_total += r["bit_wise_stale/num_tokens"]
    assert stale_total > 0  # the window let the generator run ahead: some steps trained on older samples
    from titan_rl_ext.tools.rl_arms import main as arms

    assert arms([f"titan_bi={run}", "--out", str(tmp_path / "report"), "--env", '{"git": "test"}']) == 0
    summary = json.loads((tmp_path / "report" / "rl_gpu.json").read_text())
    assert summary["steps"] == 3 and summary["bi_step1_gap"] == 0.0 and summary["bi_stale_max_abs"] == 0.0
    assert summary["bi_full_step_tok_s"] > 0 and (tmp_path / "report" / "arms.png").is_file()
    # an arm not run is null (valid JSON), not NaN; each arm says where its full step went
    assert summary["native_full_step_tok_s"] is None and summary["ratio_bi_over_nonbi"] is None
    assert summary["arms"]["titan_bi"]["train_s_median"] > 0 and summary["arms"]["titan_bi"]["wait_s_median"] >= 0
    # and where its train step went (host seconds on CPU; no device seconds without CUDA)
    bi_arm = summary["arms"]["titan_bi"]
    assert 0 < bi_arm["fwd_bwd_host_s_median"] <= bi_arm["train_s_median"] and bi_arm["fwd_bwd_device_s_median"] is None


def test_a_spawned_generator_takes_pushes_through_vllms_transfer_calls(
        request: pytest.FixtureRequest, spawning_runs: dict[str, BackgroundRun]) -> None:
    """``--rl.weight-transport titan_gloo`` with a spawned generator and no engine flags in the recipe: the server
    is started with the transfer engine, the commit's extension and the dev routes (``transports.server_flags``), so
    every step's push lands through vLLM's weight-transfer calls -- the BI gap stays exactly 0 on the new weights
    -- and the server serves the trainer's final weights."""
    run, _ = _spawning_run(request, spawning_runs)
    server_log = (run / "server.log").read_text(errors="replace")
    assert "TitanTransferExtension" in server_log and "titan_gloo" in server_log, server_log[-3000:]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs] == [1, 2]
    for r in recs:
        assert r["fleet/live"] == 1.0 and r["swap/server_bytes"] > 0, r  # the transfer's answer, bytes counted
        assert r["bit_wise/num_tokens"] == 0 or r["bit_wise/logprob_diff/max"] == 0.0, r
    final = json.loads((run / "final_checksums.json").read_text())
    assert final["version"] == recs[-1]["version"] and final["server_matches"] is True
