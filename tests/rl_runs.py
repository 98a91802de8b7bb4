"""Helpers for tests that run the RL trainer as a process and kill it (``test_rl_resume.py`` and
``test_rl_agents.py`` on CPU, ``tests/gpu/rl_window_resume.py`` on the GPU)."""

from __future__ import annotations

import json
import signal
import subprocess
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
