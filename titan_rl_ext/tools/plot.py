"""Plot a run's ``metrics.jsonl`` against step.

    python -m titan_rl_ext.tools.plot RUN_DIR [--out DIR]

Writes ``gap.png`` (trainer/generator logprob gap, an axis from 0), ``reward.png`` (mean +- std clipped to
the rewards' range, response length),
``throughput.png`` (trainer tokens/s over the full step, swap latency) and ``staleness.png`` into
``RUN_DIR/plots`` (or ``--out``). A metric the run never logged leaves its axes empty with a note,
so every file is always written. Needs matplotlib (headless Agg backend).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from titan_rl_ext.rl import metrics as M


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v):
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def _plot_lines(ax: Any, records: Sequence[dict[str, Any]], keys: Sequence[str], ylabel: str) -> bool:
    drawn = False
    for key in keys:
        xs, ys = _series(records, key)
        if xs:
            ax.plot(xs, ys, marker=".", label=key)
            drawn = True
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if drawn:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "not logged: " + ", ".join(keys), ha="center", va="center", transform=ax.transAxes, fontsize="small")
    return drawn


REWARD_RANGE = (0.0, 1.0)
"""Every reward of this project's tasks (synthetic, math, exact match) is in [0, 1]."""


def gap_axis(ax: Any) -> None:
    """A logprob gap is an absolute difference: symlog (batch-invariant runs log exact zeros, which a log
    axis cannot show) from 0 up, so the axis has no negative half."""
    ax.set_yscale("symlog", linthresh=1e-8)
    ax.set_ylim(bottom=0)


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    records = M.read_metrics(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig: Any, name: str, title: str) -> None:
        fig.suptitle(title)
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    fig, (ax_gap, ax_ratio) = plt.subplots(1, 2, figsize=(10, 4))
    gap_keys = [M.LOGPROB_DIFF_ABS_MEAN, M.LOGPROB_DIFF_MAX, M.STALE_LOGPROB_DIFF_ABS_MEAN, M.STALE_LOGPROB_DIFF_MAX]
    if _plot_lines(ax_gap, records, gap_keys, "|lp_gen - lp_trainer|"):
        gap_axis(ax_gap)
    _plot_lines(ax_ratio, records, [M.RATIO_TOKENS_DIFFERENT, M.STALE_RATIO_TOKENS_DIFFERENT],
                "fraction of tokens differing")
    save(fig, "gap.png", "trainer vs generator logprobs")

    fig, (ax_rew, ax_len) = plt.subplots(1, 2, figsize=(10, 4))
    if _plot_lines(ax_rew, records, [M.REWARD_MEAN], "reward"):
        xs, mean = _series(records, M.REWARD_MEAN)
        sx, std = _series(records, M.REWARD_STD)
        if sx == xs:
            lo, hi = REWARD_RANGE  # the band is clipped to the rewards that exist: mean +- std can leave them
            ax_rew.fill_between(xs, [max(lo, m - s) for m, s in zip(mean, std)],
                                [min(hi, m + s) for m, s in zip(mean, std)], alpha=0.2)
            ax_rew.set_ylim(lo - 0.02, hi + 0.02)
    _plot_lines(ax_len, records, [M.RESPONSE_LENGTH_MEAN], "generated tokens")
    save(fig, "reward.png", "reward")

    fig, (ax_tps, ax_swap) = plt.subplots(1, 2, figsize=(10, 4))
    _plot_lines(ax_tps, records, [M.TOKENS_PER_SECOND_FULL_STEP], "tokens / s")
    _plot_lines(ax_swap, records, [M.SWAP_LATENCY_S], "seconds")
    save(fig, "throughput.png", "throughput")

    fig, (ax_st, ax_drop) = plt.subplots(1, 2, figsize=(10, 4))
    _plot_lines(ax_st, records, [M.STALENESS_MEAN, M.STALENESS_MAX], "versions behind")
    _plot_lines(ax_drop, records, [M.DROPPED_STALE], "groups dropped")
    save(fig, "staleness.png", "off-policy staleness")
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--out", default=None, help="output folder (default RUN_DIR/plots)")
    args = ap.parse_args(argv)
    if not (Path(args.run_dir) / M.METRICS_FILE).is_file():
        print(f"no {M.METRICS_FILE} in {args.run_dir}", file=sys.stderr)
        return 2
    for p in plot_run(args.run_dir, args.out):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
