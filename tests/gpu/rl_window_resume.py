"""Issue 22, item 4 on the GPU: the BI window switch and a killed trainer's resume, with the GPU recipe's whole
path (FSDP2 bf16 compute, a spawned vLLM generator on the same GPU, CUDA IPC pushes) at toy size.

    python tests/gpu/rl_window_resume.py OUT_DIR      (run_rl_e2e.sh's `resume` stage runs it)

Run A: ``rl_gpu_hybrid_toy``, 5 synchronous steps (``--rl.offpolicy 0``), a checkpoint every step, batch
invariance on both sides for steps 1-3 only (``--rl.batch-invariant-from 1 --rl.batch-invariant-steps 3``).
Run B: the same command, SIGKILLed (torchrun, the trainer and its generator) once its step-1 checkpoint is
complete, then started again: it resumes at step 2 against a freshly spawned generator.

Checked: A's gap is exactly 0 at steps 1-3 (fresh at 1, stale or fresh after) and nonzero at 4-5 (the window
closed); B's steps 2 and 3 after the resume equal A's -- loss, gradient norm, rewards, the completions and
every other non-timing metric -- bit for bit (steps 1-3 run BI and per-request seeds fix the sampling, so the
two runs are the same computation). Step 3 is sampled from the weights of the resumed step 2's update, so it
checks the restored optimizer state too. A resumed step whose gradient is 0 (every group's reward equal: no
advantage) proves nothing about the update: the check fails unless some compared step has a gradient. On the
H200 (2026-12-05) step 3 of this recipe had reward 0 in every group and gradient 0, step 2 a gradient of
7.7, hence the kill after step 1. Writes OUT_DIR/window_resume.json and exits 1 when a check fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

STEPS, BI_STEPS, KILL_AFTER = 5, 3, 1
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers the CPU resume test uses
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the commit stamp every result carries
from bench_common import git_state  # noqa: E402
from rl_runs import drop_timing, kill_tree, records  # noqa: E402


def _dump(out: Path) -> Path:
    """Checkpoints live outside OUT_DIR: only the runs' logs and metrics come back from the GPU machine."""
    return Path(os.environ.get("TMPDIR", "/tmp")) / "rl_window_resume" / out.name


def _cmd(out: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "titan_rl_ext.train",
            "--module", "titan_rl_ext.configs", "--config", "rl_gpu_hybrid_toy", "--training.steps", str(STEPS),
            "--rl.offpolicy", "0", "--rl.batch-invariant-from", "1", "--rl.batch-invariant-steps", str(BI_STEPS),
            "--rl.run-dir", str(out / "run"), "--dump-folder", str(_dump(out)),
            "--checkpoint.enable", "--checkpoint.interval", "1"]


def _failed(out: Path, log_name: str, what: str) -> RuntimeError:
    """The generator's own log sits in run/, deeper than the device returns: keep a copy beside the train log."""
    server_log = out / "run" / "server.log"
    if server_log.exists():
        shutil.copy(server_log, out / f"{Path(log_name).stem}_server.log")
    return RuntimeError(f"{out.name}: {what}:\n" + (out / log_name).read_text()[-4000:])


def _run(out: Path, log_name: str, kill_after: int | None = None) -> float:
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with (out / log_name).open("wb") as log:
        proc = subprocess.Popen(_cmd(out), stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        if kill_after is None:
            rc = proc.wait(timeout=900)
            if rc != 0:
                raise _failed(out, log_name, f"the run failed ({rc})")
        else:
            marker = _dump(out) / "checkpoint" / f"step-{kill_after}" / ".metadata"  # DCP writes it last
            try:
                while not marker.exists():
                    if proc.poll() is not None:
                        raise _failed(out, log_name, f"exited ({proc.returncode}) before its step-{kill_after} checkpoint")
                    time.sleep(0.05)  # polling the file system: there is nothing to wait on
            finally:
                kill_tree(proc)
    return time.monotonic() - t0


def main(out: Path) -> int:
    a, b = out / "resume_a", out / "resume_b"
    for d in (a, b):
        shutil.rmtree(_dump(d), ignore_errors=True)
    secs = {"a": _run(a, "train.log"), "b_killed": _run(b, "train_killed.log", kill_after=KILL_AFTER),
            "b_resumed": _run(b, "train_resumed.log")}
    rec_a, rec_b = records(a / "run" / "metrics.jsonl"), records(b / "run" / "metrics.jsonl")
    roll_a, roll_b = records(a / "run" / "rollouts.jsonl"), records(b / "run" / "rollouts.jsonl")
    resumed_log = (b / "train_resumed.log").read_text()
    gap = lambda r: max(r.get("bit_wise/logprob_diff/max", float("nan")), r.get("bit_wise_stale/logprob_diff/max", float("nan")))  # noqa: E731

    def compared(r: dict[str, Any]) -> int:
        return int(r.get("bit_wise/num_tokens", 0) or 0) + int(r.get("bit_wise_stale/num_tokens", 0) or 0)

    resumed = range(KILL_AFTER + 1, BI_STEPS + 1)  # the BI steps B ran after its resume
    # keyed by step, the last record of each: a step the killed run finished before its kill landed is run again
    by_step_a, by_step_b = ({r["step"]: r for r in recs} for recs in (rec_a, rec_b))
    rolls_a, rolls_b = ({r["step"]: r for r in rolls} for rolls in (roll_a, roll_b))
    checks = {
        "a_steps": [r["step"] for r in rec_a] == list(range(1, STEPS + 1)),
        "a_bi_flags": [r["batch_invariant"] for r in rec_a] == [1] * BI_STEPS + [0] * (STEPS - BI_STEPS),
        # inside the window every compared token is bit-equal; outside it the kernels differ and so do the logprobs
        "a_gap_zero_in_window": all(compared(r) > 0 and r["bit_wise_all/logprob_diff/max"] == 0.0 for r in rec_a[:BI_STEPS]),
        "a_gap_nonzero_after": all(r["bit_wise_all/logprob_diff/max"] > 0.0 for r in rec_a[BI_STEPS:]),
        "b_resumed": f"Training starts at step {KILL_AFTER + 1}" in resumed_log,
        "b_steps": sorted(by_step_b)[:BI_STEPS] == list(range(1, BI_STEPS + 1)),
        "resumed_loss_equal": all(s in by_step_b and by_step_b[s]["loss"] == by_step_a[s]["loss"] for s in resumed),
        "resumed_metrics_equal": all(s in by_step_b and drop_timing(by_step_b[s]) == drop_timing(by_step_a[s]) for s in resumed),
        "resumed_rollouts_equal": all(s in rolls_b and rolls_b[s] == rolls_a[s] for s in resumed),
        "steps_before_kill_equal": all(s in by_step_b and drop_timing(by_step_b[s]) == drop_timing(by_step_a[s]) for s in range(1, KILL_AFTER + 1)),
        "resumed_step_with_gradient": any(by_step_a[s]["grad_norm"] > 0 for s in resumed),
    }
    summary = {
        "env": git_state(), "checks": checks, "seconds": secs,
        "a": [{k: r.get(k) for k in ("step", "batch_invariant", "loss", "grad_norm", "reward/mean",
                                     "bit_wise_all/logprob_diff/max", "bit_wise/num_tokens", "bit_wise_stale/num_tokens")}
              for r in rec_a],
        "b_resumed_steps": [{k: by_step_b.get(s, {}).get(k) for k in ("step", "loss", "grad_norm", "reward/mean")}
                            for s in resumed],
        "gap_max_per_step_a": [gap(r) for r in rec_a],
    }
    (out / "window_resume.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps(summary, indent=1, default=str))
    failed = [k for k, ok in checks.items() if not ok]
    print("FAILED: " + ", ".join(failed) if failed else "window + resume: all checks hold")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
