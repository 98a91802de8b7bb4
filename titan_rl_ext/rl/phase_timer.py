"""Where a trainer step's time goes: host and device seconds per phase, without adding a sync.

``perf/trainer/step_s`` says how long the train step took, not what bounds it (the RL recipe's step takes
many times its FLOP floor: docs/gpu_runs.md §12, "The three RL arms, the resume and the step at one commit"). Each phase boundary records the host clock and, on CUDA, an event on the current
stream; the events are read once the step is over, after the sync the step's logging makes anyway. Per phase
``p``: ``perf/trainer/<p>/host_s`` (the host's time in it: launching, Python, and any sync inside) and
``perf/trainer/<p>/device_s`` (the stream's time between the boundary events: the kernels, plus the idle
time where the stream waited for the host). Host time well above device time: the phase is bound by the host.
"""

from __future__ import annotations

import time

import torch

PREFIX = "perf/trainer/"


class PhaseTimer:
    """``mark(name)`` at the end of each phase (after ``start()``); ``metrics()`` once the step's work is done."""

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._marks: list[tuple[str, float, torch.cuda.Event | None]] = []

    def _event(self) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def start(self) -> None:
        self._marks = [("", time.perf_counter(), self._event())]

    def mark(self, name: str) -> None:
        if not self._marks:
            raise RuntimeError("PhaseTimer.mark before start")
        self._marks.append((name, time.perf_counter(), self._event()))

    def metrics(self) -> dict[str, float]:
        """Host and device seconds of every phase marked since ``start`` (waits for the last event)."""
        out: dict[str, float] = {}
        if self.cuda and self._marks:
            self._marks[-1][2].synchronize()  # type: ignore[union-attr]
        for (_, t0, e0), (name, t1, e1) in zip(self._marks, self._marks[1:]):
            out[f"{PREFIX}{name}/host_s"] = t1 - t0
            if e0 is not None and e1 is not None:
                out[f"{PREFIX}{name}/device_s"] = e0.elapsed_time(e1) / 1e3
        return out
