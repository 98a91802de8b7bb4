"""Helpers for tests that run a trainer as a process, in the background or killed (``test_rl_resume.py``,
``test_rl_agents.py``, ``test_rl_train.py``, ``test_torchtitan_train.py`` on CPU, ``tests/gpu/rl_window_resume.py``
on the GPU)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

# what a metrics record holds that depends on timing: wall-clock quantities, and the window's occupancy
# (producers admitted for the next step right after the push may or may not have started)
TIMING_PREFIXES = ("time", "perf/", "swap/", "rollout/producer_wait_s_total", "rollout/buffered", "rollout/in_flight")


def records(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a run's ``metrics.jsonl`` or ``rollouts.jsonl``."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def drop_timing(rec: dict[str, Any]) -> dict[str, Any]:
    """A metrics record without what depends on timing (``TIMING_PREFIXES``)."""
    return {k: v for k, v in rec.items() if not k.startswith(TIMING_PREFIXES)}


def kill_tree(proc: subprocess.Popen[bytes]) -> int | None:
    """SIGKILL torchrun and every process under it; torchrun's exit status. torchrun starts its workers
    in sessions of their own (and the trainer its spawned generator), so killing its process group would
    leave them running: collect the tree first (a killed parent's children get re-parented), then kill
    each process by pid."""
    root = psutil.Process(proc.pid)
    procs = [*root.children(recursive=True), root]
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    # wait_procs reaps torchrun (our child), so its status is read here, not from proc.wait()
    gone, alive = psutil.wait_procs(procs, timeout=60)
    assert not alive, f"still alive after SIGKILL: {alive}"
    return next(p.returncode for p in gone if p.pid == proc.pid)


@dataclass
class BackgroundRun:
    """A trainer command started in the background (``start_run``), its output in ``dir / log_name``: tests
    whose runs are independent start them side by side and wait for each where they read it."""

    dir: Path
    proc: subprocess.Popen[bytes]
    started: float
    timeout_s: float
    log_name: str = "train.log"

    @property
    def log(self) -> Path:
        return self.dir / self.log_name

    def wait(self) -> int:
        """The exit status; a run past its timeout is killed (its tree) and fails the test with its log's end."""
        try:
            return self.proc.wait(max(1.0, self.started + self.timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_tree(self.proc)
            raise AssertionError(f"no exit in {self.timeout_s} s:\n{self.log.read_text(errors='replace')[-6000:]}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc)


def start_run(cmd: Sequence[str], dir: Path, env: Mapping[str, str], timeout_s: float,
              log_name: str = "train.log") -> BackgroundRun:
    """``cmd`` started in ``dir`` with stdout and stderr to ``dir / log_name``."""
    with (dir / log_name).open("wb") as log:
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=dict(env), cwd=dir)
    return BackgroundRun(dir, proc, time.monotonic(), timeout_s, log_name)
