"""Compare RL runs of the same recipe that differ in the generator (three arms: vLLM's
native class, ``--model-impl titan``, and titan with batch invariance), each arm run once or several times.

    python -m titan_rl_ext.tools.rl_arms native=RUN_A titan=RUN_B titan_bi=RUN_C --out DIR [--json rl_gpu.json]
    python -m titan_rl_ext.tools.rl_arms native=A1,A2 titan=B1,B2 titan_bi=C1,C2 --windows --out DIR --json X.json

Reads each run's ``metrics.jsonl`` and writes ``DIR/arms.png`` (the logprob gap and the full-step tokens/s of
every run against step, overlaid) and the summary JSON: the step-1 gap of each arm, the largest stale gap of
the BI arm, the median full-step tokens/s of each arm over the steps after the first (step 1 carries
start-up), the median swap latency, the first and last five steps' mean reward, and the ratios
titan_bi/titan and titan/native; with several runs per arm, how far an arm's runs spread, and how an arm's
runs combine into its figures (``COMBINE``). With ``--windows`` the runs are grouped by the off-policy window
each recorded, and the JSON is ``{"env": ..., "windows": [{"offpolicy": W, <the summary>}, ...]}``.

``env`` comes from the runs: every field of each run's ``run_env.json`` (written beside ``metrics.jsonl`` by
``tests/gpu/run_rl_e2e.sh``: GPU, versions, recipe, window, commit) on which all runs agree, a list of the
values where they do not; ``--env`` fills what the runs did not record, and the commit and tree of this
checkout fill ``git``/``git_tree`` last (``git_from`` says which). Every figure is read from the runs' own
metrics; none is typed in.

``transport_summary``: the same recipe run under two weight transports instead (``cuda_ipc`` and ``titan_ipc``,
``tests/gpu/run_rl_e2e.sh ipc_arms``): each run's push seconds and bytes, and whether BI held exactly.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from titan_rl_ext.rl import metrics as M
from titan_rl_ext.rl import generation_timeline as T
from titan_rl_ext.tools.plot import _series, gap_axis

ARMS = ("native", "titan", "titan_bi")
RUN_ENV_FILE = "run_env.json"
_PER_RUN_KEYS = ("arm", "run", "offpolicy")  # differ between the runs of one report by design: not ``env``


def _median_after_first(records: list[dict[str, Any]], key: str) -> float:
    xs, ys = _series(records, key)
    later = [y for x, y in zip(xs, ys) if x > 1]
    return statistics.median(later) if later else float("nan")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def generation_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the generator's time went (``rl/generation_timeline.py``), over the steps after the first and before
    the last (the first carries start-up; the last misses the groups never taken): the seconds a group was
    generating per step (median), that time's share of the full steps' time, the completion tokens of those
    steps over it (the generator's rate, to the window's lag), and the median completion length of every
    sample. Totals too, so that runs pool (``COMBINE``). NaN for runs without a timeline."""
    busy = T.generation_busy_s(records)
    last = max(busy, default=0)
    inner = [r for r in records if 1 < int(r["step"]) < last and int(r["step"]) in busy]
    busy_s = sum(busy[int(r["step"])] for r in inner)
    span_s = sum(r[T.STEP_END_S] - r[T.STEP_START_S] for r in inner)
    tokens = sum(sum(r.get(T.COMPLETION_TOKENS, [])) for r in inner)
    lengths = [n for r in records for n in r.get(T.COMPLETION_TOKENS, [])]
    nan = float("nan")
    return {
        "generation_busy_s_median": _median([busy[int(r["step"])] for r in inner]),
        "generation_share": busy_s / span_s if span_s > 0 else nan,
        "generation_tok_s": tokens / busy_s if busy_s > 0 else nan,
        "generation_busy_s_total": busy_s,
        "full_step_s_total": span_s,
        "generation_tokens_total": tokens,
        "median_answer_tokens": _median(lengths),
    }


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
        **generation_summary(records),
    }


def _finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if not (isinstance(v, float) and math.isnan(v))]


def _worst(values: Sequence[float]) -> float:
    return max(_finite(values), default=float("nan"))


# How an arm's runs make the arm's figure: a gap is the worst run's (an exactness claim must hold in every run),
# counts of compared tokens add up (steps and step-1 tokens: the fewest any run had), rewards average, shares and
# rates pool their totals, every per-step median is the median over the runs' medians. One run: its own figures.
COMBINE: dict[str, Callable[[list[float]], float]] = {
    "steps": min, "step1_gap_tokens": min, "step1_gap": _worst, "stale_max_abs": _worst, "stale_tokens": sum,
    "reward_first5": _mean, "reward_last5": _mean,
    "generation_busy_s_total": sum, "full_step_s_total": sum, "generation_tokens_total": sum,
}


def combine_runs(runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One arm's summary over its runs (``COMBINE``; ``median_answer_tokens`` over every run's samples), with
    ``runs``, each run's own headline figures (``per_run``), and ``spread``: the (max - min) / median of the runs'
    full-step tokens/s (NaN for one run)."""
    each = [arm_summary(recs) for recs in runs]
    out = {k: COMBINE.get(k, lambda vs: _median(_finite(vs)))([s[k] for s in each]) for k in each[0]}
    busy, span = out["generation_busy_s_total"], out["full_step_s_total"]
    out["generation_share"] = busy / span if span > 0 else float("nan")
    out["generation_tok_s"] = out["generation_tokens_total"] / busy if busy > 0 else float("nan")
    out["median_answer_tokens"] = _median([n for recs in runs for r in recs for n in r.get(T.COMPLETION_TOKENS, [])])
    tps = [s["full_step_tok_s"] for s in each]
    out["runs"] = len(runs)
    out["per_run"] = {k: [s[k] for s in each] for k in ("full_step_tok_s", "step1_gap", "stale_max_abs",
                                                         "reward_first5", "reward_last5", "generation_share")}
    out["spread"] = (max(tps) - min(tps)) / _median(tps) if len(tps) > 1 and _median(tps) > 0 else float("nan")
    return out


def summarize(runs: dict[str, list[dict[str, Any]]] | dict[str, list[list[dict[str, Any]]]],
              env: dict[str, Any] | None) -> dict[str, Any]:
    """The ``rl_gpu.json`` summary, plus every arm's own summary under ``arms``; an arm is one run's records or a
    list of runs. ``env`` None: the summary of one window, without it."""
    as_runs = {name: (recs if recs and isinstance(recs[0], list) else [recs]) for name, recs in runs.items()}
    arms = {name: combine_runs(rs) for name, rs in as_runs.items()}
    nan = float("nan")
    get = lambda arm, key: arms.get(arm, {}).get(key, nan)  # noqa: E731

    def ratio(a: str, b: str) -> float:
        x, y = get(a, "full_step_tok_s"), get(b, "full_step_tok_s")
        return x / y if y and not math.isnan(y) else nan

    every_run = [recs for rs in as_runs.values() for recs in rs]
    return {
        **({"env": env} if env is not None else {}),
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
        "runs_per_arm": min((s["runs"] for s in arms.values()), default=0),
        "spread": {name: s["spread"] for name, s in arms.items()},
        # the test of the regime: generation's share of the non-BI arm's step time
        "generation_share": get("titan", "generation_share"),
        "median_answer_tokens": _median([n for recs in every_run for r in recs
                                         for n in r.get(T.COMPLETION_TOKENS, [])]),
        "arms": arms,
    }


def report_env(run_envs: list[dict[str, Any]], given: dict[str, Any], repo: Path | None = None) -> dict[str, Any]:
    """``env`` from the runs' records (see the module docstring); ``given`` (``--env``) and this checkout's
    commit fill what they lack."""
    keys = sorted({k for e in run_envs for k in e} - set(_PER_RUN_KEYS))
    env: dict[str, Any] = {}
    for k in keys:
        values = [e.get(k) for e in run_envs]
        distinct = sorted({json.dumps(v, sort_keys=True) for v in values})
        env[k] = values[0] if len(distinct) == 1 else [json.loads(v) for v in distinct]
    env["git_from"] = "run" if "git" in env else "given" if "git" in given else "report checkout"
    for k, v in given.items():
        env.setdefault(k, v)
    for key, rev in (("git", "HEAD"), ("git_tree", "HEAD^{tree}")):
        if key not in env:
            found = subprocess.run(["git", "rev-parse", rev], cwd=repo or Path.cwd(), capture_output=True, text=True)
            env[key] = found.stdout.strip() if found.returncode == 0 else None
    return env


def _nan_to_null(obj: Any) -> Any:
    """NaN (an arm not run, a metric not measured) as JSON null: NaN is not JSON."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_null(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_nan_to_null(v) for v in obj]
    return obj


def plot_arms(runs: dict[str, list[dict[str, Any]]], out: Path) -> Path:
    """``runs``: a label per run (``titan``, ``titan w4 #2``) and its records."""
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


def transport_arm(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One run of a recipe under one weight transport (``run_rl_e2e.sh ipc_arms``): its push seconds over the
    steps after the first (the first push carries a transport's set-up: ``titan_ipc``'s engine init), the whole
    push (``swap/latency_s``: gather, send, commit, keep for the stale gap) and its send-and-commit part
    (``swap/post_s``); the bytes pushed; and whether BI held exactly: step 1's gap, every step's largest fresh
    and stale gap (a step without stale tokens records none)."""
    def later(key: str) -> list[float]:
        xs, ys = _series(records, key)
        return [y for x, y in zip(xs, ys) if x > 1]

    latency = later(M.SWAP_LATENCY_S)
    _, fresh = _series(records, M.LOGPROB_DIFF_MAX)
    _, stale = _series(records, M.STALE_LOGPROB_DIFF_MAX)
    first = next((r for r in records if r.get("step") == 1), {})
    return {
        "steps": max((int(r["step"]) for r in records), default=0),
        "swap_latency_s_median": _median(latency),
        "swap_latency_s_max": max(latency, default=float("nan")),
        "swap_latency_s_step1": first.get(M.SWAP_LATENCY_S, float("nan")),
        "swap_post_s_median": _median(later("swap/post_s")),
        "pushed_bytes": max(_series(records, "swap/pushed_tensor_bytes")[1], default=float("nan")),
        "server_bytes": max(_series(records, "swap/server_bytes")[1], default=float("nan")),
        "step1_gap": first.get(M.LOGPROB_DIFF_ABS_MEAN, float("nan")),
        "every_gap_max_zero": bool(fresh) and all(v == 0 for v in fresh),
        "stale_steps": len(stale),
        "every_stale_max_zero": bool(stale) and all(v == 0 for v in stale),
    }


def transport_summary(runs: dict[str, list[dict[str, Any]]], env: dict[str, Any]) -> dict[str, Any]:
    """``transport_arm`` of each transport's run, and ``titan_ipc``'s median push seconds over ``cuda_ipc``'s."""
    arms = {name: transport_arm(recs) for name, recs in runs.items()}
    nan = float("nan")
    ipc, today = (arms.get(t, {}).get("swap_latency_s_median", nan) for t in ("titan_ipc", "cuda_ipc"))
    return {"env": env, "transports": arms,
            "ratio_titan_ipc_over_cuda_ipc": ipc / today if today and not math.isnan(today) else nan}


def _read_run_env(run_dir: Path) -> dict[str, Any]:
    path = run_dir / RUN_ENV_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="ARM=RUN_DIR[,RUN_DIR...], ARM one of " + ", ".join(ARMS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--json", default="", help="also write the summary here (default: OUT/rl_gpu.json)")
    ap.add_argument("--env", default="{}", help="JSON object: env fields the runs did not record")
    ap.add_argument("--windows", action="store_true",
                    help=f"group the runs by the off-policy window in their {RUN_ENV_FILE}; one summary per window")
    args = ap.parse_args(argv)
    dirs: list[tuple[str, Path]] = []
    for spec in args.runs:
        name, _, run_dirs = spec.partition("=")
        if name not in ARMS or not run_dirs:
            ap.error(f"{spec!r}: give ARM=RUN_DIR[,RUN_DIR...] with ARM one of {ARMS}")
        for d in run_dirs.split(","):
            if not (Path(d) / M.METRICS_FILE).is_file():
                ap.error(f"no {M.METRICS_FILE} in {d}")
            dirs.append((name, Path(d)))
    run_envs = {d: _read_run_env(d) for _, d in dirs}
    window_of = {d: run_envs[d].get("offpolicy") for _, d in dirs}
    if args.windows and None in window_of.values():
        unknown = [str(d) for d, w in window_of.items() if w is None]
        ap.error(f"--windows: {unknown} record no offpolicy in {RUN_ENV_FILE}")
    records = {d: M.read_metrics(d) for _, d in dirs}
    windows = sorted(set(window_of.values())) if args.windows else [None]
    summaries = []
    for w in windows:
        mine = [(name, d) for name, d in dirs if w is None or window_of[d] == w]
        by_arm = {name: [records[d] for n, d in mine if n == name] for name in ARMS if any(n == name for n, _ in mine)}
        head = {"offpolicy": w} if w is not None else {}
        summaries.append({**head, **summarize(by_arm, None),
                          "run_dirs": {name: [str(d) for n, d in mine if n == name] for name in by_arm}})
    env = report_env(list(run_envs.values()), json.loads(args.env))
    summary = {"env": env, "windows": summaries} if args.windows else {"env": env, **summaries[0]}
    out = Path(args.out)
    labels: dict[str, list[dict[str, Any]]] = {}
    for name, d in dirs:
        nth = sum(1 for n, e in dirs[: dirs.index((name, d)) + 1] if n == name and window_of[e] == window_of[d])
        w = window_of[d] if args.windows else None
        labels[name + (f" w{w}" if w is not None else "") + (f" #{nth}" if nth > 1 else "")] = records[d]
    print(plot_arms(labels, out))
    path = Path(args.json) if args.json else out / "rl_gpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_nan_to_null(summary), indent=1, allow_nan=False))
    print(path)
    brief = summary["windows"] if args.windows else [summaries[0]]
    print(json.dumps([{k: v for k, v in s.items() if k not in ("arms", "run_dirs")} for s in brief], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
