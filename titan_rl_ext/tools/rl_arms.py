"""Compare RL runs of the same recipe that differ in the generator (three arms: vLLM's
native class, ``--model-impl titan``, and titan with batch invariance).

    python -m titan_rl_ext.tools.rl_arms native=RUN_A titan=RUN_B titan_bi=RUN_C --out DIR [--json rl_gpu.json]

Reads each run's ``metrics.jsonl`` and writes ``DIR/arms.png`` (the logprob gap and the full-step tokens/s of
every arm against step, overlaid) and the summary JSON: the step-1 gap of each arm, the largest stale gap of
the BI arm, the median full-step tokens/s of each arm over the steps after the first (step 1 carries
start-up), the median swap latency, the first and last five steps' mean reward, and the ratios
titan_bi/titan and titan/native. Every figure is read from the runs' own metrics; none is typed in.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from titan_rl_ext.rl import metrics as M
from titan_rl_ext.tools.plot import _series, gap_axis

ARMS = ("native", "titan", "titan_bi")


def _median_after_first(records: list[dict[str, Any]], key: str) -> float:
    xs, ys = _series(records, key)
    later = [y for x, y in zip(xs, ys) if x > 1]
    return statistics.median(later) if later else float("nan")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def arm_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    first = next((r for r in records if r.get("step") == 1), {})
    _, stale = _series(records, M.STALE_LOGPROB_DIFF_MAX)
    _, rewards = _series(records, M.REWARD_MEAN)
    return {
        "steps": max((int(r["step"]) for r in records), default=0),
        "step1_gap": first.get(M.LOGPROB_DIFF_ABS_MEAN, float("nan")),
        "step1_gap_tokens": first.get("bit_wise/num_tokens", 0),
        "stale_max_abs": max(stale) if stale else float("nan"),
        "stale_tokens": sum(int(r.get("bit_wise_stale/num_tokens", 0) or 0) for r in records),
        "full_step_tok_s": _median_after_first(records, M.TOKENS_PER_SECOND_FULL_STEP),
        "swap_s_median": _median_after_first(records, M.SWAP_LATENCY_S),
        # a full step is between steps + wait (for the window's groups) + train + push: the largest bounds the arm
        "between_s_median": _median_after_first(records, M.TRAINER_BETWEEN_S),
        "wait_s_median": _median_after_first(records, M.TRAINER_WAIT_S),
        "train_s_median": _median_after_first(records, M.TRAINER_STEP_S),
        # the train step's phases (rl/phase_timer.py; absent in runs before it): host vs device seconds each
        **{f"{phase}_{side}_s_median": _median_after_first(records, f"perf/trainer/{phase}/{side}_s")
           for phase in ("fwd_bwd", "parity", "optim") for side in ("host", "device")},
        "reward_first5": _mean(rewards[:5]),
        "reward_last5": _mean(rewards[-5:]),
    }


def summarize(runs: dict[str, list[dict[str, Any]]], env: dict[str, Any]) -> dict[str, Any]:
    """The ``rl_gpu.json`` summary, plus every arm's own summary under ``arms``."""
    arms = {name: arm_summary(recs) for name, recs in runs.items()}
    nan = float("nan")
    get = lambda arm, key: arms.get(arm, {}).get(key, nan)  # noqa: E731

    def ratio(a: str, b: str) -> float:
        x, y = get(a, "full_step_tok_s"), get(b, "full_step_tok_s")
        return x / y if y and not math.isnan(y) else nan

    return {
        "env": env,
        "steps": min((s["steps"] for s in arms.values()), default=0),
        "bi_step1_gap": get("titan_bi", "step1_gap"),
        "bi_stale_max_abs": get("titan_bi", "stale_max_abs"),
        "nonbi_step1_gap": get("titan", "step1_gap"),
        "native_step1_gap": get("native", "step1_gap"),
        "bi_full_step_tok_s": get("titan_bi", "full_step_tok_s"),
        "nonbi_full_step_tok_s": get("titan", "full_step_tok_s"),
        "native_full_step_tok_s": get("native", "full_step_tok_s"),
        "ratio_bi_over_nonbi": ratio("titan_bi", "titan"),
        "ratio_nonbi_over_native": ratio("titan", "native"),
        "swap_s_median": statistics.median([s["swap_s_median"] for s in arms.values() if not math.isnan(s["swap_s_median"])] or [nan]),
        "reward_first5": get("titan_bi", "reward_first5"),
        "reward_last5": get("titan_bi", "reward_last5"),
        "arms": arms,
    }


def _nan_to_null(obj: Any) -> Any:
    """NaN (an arm not run, a metric not measured) as JSON null: NaN is not JSON."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_null(v) for k, v in obj.items()}
    return obj


def plot_arms(runs: dict[str, list[dict[str, Any]]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_gap, ax_tps) = plt.subplots(1, 2, figsize=(11, 4))
    for name, recs in runs.items():
        for key, style in ((M.LOGPROB_DIFF_ABS_MEAN, "-"), (M.STALE_LOGPROB_DIFF_ABS_MEAN, ":")):
            xs, ys = _series(recs, key)
            if xs:
                ax_gap.plot(xs, ys, style, marker=".", label=f"{name} {'stale' if 'stale' in key else 'fresh'}")
        xs, ys = _series(recs, M.TOKENS_PER_SECOND_FULL_STEP)
        if xs:
            ax_tps.plot(xs, ys, marker=".", label=name)
    from matplotlib.ticker import MaxNLocator

    for ax in (ax_gap, ax_tps):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_gap.set_xlabel("step")
    ax_gap.set_ylabel("mean |lp_gen - lp_trainer|")
    gap_axis(ax_gap)
    ax_gap.legend(fontsize="small")
    ax_tps.set_xlabel("step")
    ax_tps.set_ylabel("trainer tokens / s (full step)")
    ax_tps.set_ylim(bottom=0)
    ax_tps.legend(fontsize="small")
    fig.suptitle("generator arms: logprob gap and full-step throughput")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "arms.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="ARM=RUN_DIR, ARM one of " + ", ".join(ARMS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--json", default="", help="also write the summary here (default: OUT/rl_gpu.json)")
    ap.add_argument("--env", default="{}", help="JSON object for the summary's env (git, gpu, ...)")
    args = ap.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {}
    for spec in args.runs:
        name, _, run_dir = spec.partition("=")
        if name not in ARMS or not run_dir:
            ap.error(f"{spec!r}: give ARM=RUN_DIR with ARM one of {ARMS}")
        if not (Path(run_dir) / M.METRICS_FILE).is_file():
            ap.error(f"no {M.METRICS_FILE} in {run_dir}")
        runs[name] = M.read_metrics(run_dir)
    out = Path(args.out)
    print(plot_arms(runs, out))
    summary = summarize(runs, json.loads(args.env))
    path = Path(args.json) if args.json else out / "rl_gpu.json"
    path.write_text(json.dumps(_nan_to_null(summary), indent=1, allow_nan=False))
    print(path)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("arms", "env")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
