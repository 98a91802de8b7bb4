"""How much of each RL step the generator spent generating, read back from ``metrics.jsonl``.

The generator runs beside the trainer (the off-policy window lets it run ahead), so a step's time is not split
into "generation" and "training" by any clock the trainer holds: a group the trainer takes at step ``k`` may have
been generating since step ``k - 3``. So each step logs the wall-clock span of every group it took (from its
admission to the window to its last sample, on the window's monotonic clock) and its own span on the same clock;
a step's generation seconds are the part of its span covered by the union of every group's span in the run,
which is only known once the run has logged the later steps (``generation_busy_s``). A step's groups' completion
lengths are logged too, for the median answer length.

Groups dropped as stale and groups still generating when the run ends are never taken, so never logged: the
last steps' busy time can be short by what those groups would have covered. Summaries skip the last step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

GROUP_START_S = "timeline/group_start_s"
GROUP_END_S = "timeline/group_end_s"
STEP_START_S = "timeline/step_start_s"
STEP_END_S = "timeline/step_end_s"
COMPLETION_TOKENS = "rollout/completion_tokens"

__all__ = ["GROUP_START_S", "GROUP_END_S", "STEP_START_S", "STEP_END_S", "COMPLETION_TOKENS", "step_timeline",
           "generation_busy_s", "merge_spans"]


def step_timeline(spans: Sequence[tuple[float, float]], step_start_perf: float, step_end_perf: float,
                  completion_lengths: Sequence[int]) -> dict[str, Any]:
    """A step's record: its groups' ``(started, finished)`` on ``time.monotonic`` (the window's clock), its own
    span given on ``time.perf_counter`` (the trainer's), moved onto the monotonic clock, and the completion
    lengths of its samples."""
    to_mono = time.monotonic() - time.perf_counter()
    return {
        GROUP_START_S: [s for s, _ in spans],
        GROUP_END_S: [e for _, e in spans],
        STEP_START_S: step_start_perf + to_mono,
        STEP_END_S: step_end_perf + to_mono,
        COMPLETION_TOKENS: list(completion_lengths),
    }


def merge_spans(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``spans`` as disjoint spans, in order."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def generation_busy_s(records: Sequence[dict[str, Any]]) -> dict[int, float]:
    """Per step (records that carry a timeline): seconds of the step's span during which at least one group of
    the run was generating."""
    timed = [r for r in records if STEP_START_S in r and STEP_END_S in r]
    busy = merge_spans([(s, e) for r in timed for s, e in zip(r.get(GROUP_START_S, []), r.get(GROUP_END_S, []))])
    out: dict[int, float] = {}
    for r in timed:
        lo, hi = r[STEP_START_S], r[STEP_END_S]
        out[int(r["step"])] = sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in busy)
    return out
