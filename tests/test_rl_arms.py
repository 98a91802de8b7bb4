"""The arms report (``tools/rl_arms.py``) on fabricated runs: several runs per arm and two off-policy windows
combine into the issue-41 summary -- each arm's run-to-run spread, generation's share of the step from the groups'
logged spans (overlapping spans counted once, the first and last steps left out), the median answer length --
and ``env`` comes from the runs' ``run_env.json``, not from the command line. Seconds, no engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from titan_rl_ext.rl import generation_timeline as T
from titan_rl_ext.rl import metrics as M
from titan_rl_ext.tools.rl_arms import main as arms

# four 10 s steps; groups generating over 2-5, 11-15, 13-16 (overlapping), 19-22 (across steps 2 and 3), 25-27, 35-45
_GROUPS = {1: [(2.0, 5.0)], 2: [(11.0, 15.0), (13.0, 16.0), (19.0, 22.0)], 3: [(25.0, 27.0)], 4: [(35.0, 45.0)]}
_BUSY = {1: 3.0, 2: 5.0 + 1.0, 3: 2.0 + 2.0, 4: 5.0}
_LENGTHS = {1: [50, 60], 2: [100, 300], 3: [200, 200], 4: [1000, 1000]}


def _write_run(d: Path, tok_s: list[float], gap: float, env: dict[str, Any]) -> Path:
    d.mkdir(parents=True)
    recs = []
    for step in (1, 2, 3, 4):
        groups = _GROUPS[step]
        recs.append({
            "step": step, M.TOKENS_PER_SECOND_FULL_STEP: tok_s[step - 1],
            M.LOGPROB_DIFF_ABS_MEAN: gap if step == 1 else 0.5,
            "bit_wise/num_tokens": 64, M.STALE_LOGPROB_DIFF_MAX: gap, "bit_wise_stale/num_tokens": 10,
            M.REWARD_MEAN: 0.1 * step, M.TRAINER_STEP_S: 3.0, M.TRAINER_WAIT_S: 6.0, M.SWAP_LATENCY_S: 0.5,
            T.STEP_START_S: 10.0 * (step - 1), T.STEP_END_S: 10.0 * step,
            T.GROUP_START_S: [s for s, _ in groups], T.GROUP_END_S: [e for _, e in groups],
            T.COMPLETION_TOKENS: _LENGTHS[step],
        })
    (d / M.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in recs))
    (d / "run_env.json").write_text(json.dumps(env))
    return d


def test_busy_seconds_count_overlapping_groups_once_and_only_inside_each_step() -> None:
    recs = [{"step": s, T.STEP_START_S: 10.0 * (s - 1), T.STEP_END_S: 10.0 * s,
             T.GROUP_START_S: [a for a, _ in g], T.GROUP_END_S: [b for _, b in g]} for s, g in _GROUPS.items()]
    assert T.generation_busy_s(recs) == pytest.approx(_BUSY)
    assert T.merge_spans([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]


def test_several_runs_per_arm_and_two_windows(tmp_path: Path) -> None:
    env = {"gpu": "Fake GPU", "recipe": "rl_gpu_long", "git": "abc123", "git_tree": "def456"}
    specs: dict[str, list[str]] = {}
    # per run: full-step tok/s at steps 1-4 (step 1 is left out of the medians); window 12 runs faster
    for w, scale in ((4, 1.0), (12, 2.0)):
        for arm, gap, runs in (("titan_bi", 0.0, ([9, 100, 110, 120], [9, 90, 100, 95])),
                               ("titan", 0.02, ([9, 104, 104, 104], [9, 96, 96, 96])),
                               ("native", 0.03, ([9, 100, 100, 100], [9, 100, 100, 100]))):
            for i, tok_s in enumerate(runs):
                d = _write_run(tmp_path / f"w{w}" / f"{arm}_{i}", [t * scale for t in tok_s], gap,
                               {**env, "arm": arm, "run": i + 1, "offpolicy": w})
                specs.setdefault(arm, []).append(str(d))
    out = tmp_path / "report"
    argv = [f"{arm}={','.join(ds)}" for arm, ds in specs.items()]
    assert arms([*argv, "--windows", "--out", str(out), "--json", str(out / "long.json")]) == 0
    summary = json.loads((out / "long.json").read_text())
    assert summary["env"]["gpu"] == "Fake GPU" and summary["env"]["git_tree"] == "def456"
    assert summary["env"]["git_from"] == "run" and "offpolicy" not in summary["env"]
    assert [w["offpolicy"] for w in summary["windows"]] == [4, 12]
    for w, scale in zip(summary["windows"], (1.0, 2.0)):
        assert w["runs_per_arm"] == 2 and len(w["run_dirs"]["titan"]) == 2
        # per-run medians over steps 2-4: titan_bi 110 and 95 -> spread 15 / 102.5; titan 104 and 96; native equal
        assert w["spread"]["titan_bi"] == pytest.approx(15 / 102.5)
        assert w["spread"]["titan"] == pytest.approx(8 / 100) and w["spread"]["native"] == 0.0
        assert w["nonbi_full_step_tok_s"] == pytest.approx(100 * scale)
        assert w["ratio_bi_over_nonbi"] == pytest.approx(102.5 / 100)
        # steps 2 and 3 (the first and last left out): (6 + 4) s busy of 20 s, 800 tokens in those 10 s
        assert w["generation_share"] == pytest.approx(0.5)
        assert w["arms"]["titan"]["generation_tok_s"] == pytest.approx(80.0)
        assert w["median_answer_tokens"] == 200.0
        assert w["bi_step1_gap"] == 0.0 and w["bi_stale_max_abs"] == 0.0 and w["nonbi_step1_gap"] == 0.02
        assert w["arms"]["titan"]["stale_tokens"] == 2 * 4 * 10  # two runs' compared tokens add up
        assert w["arms"]["titan_bi"]["per_run"]["full_step_tok_s"] == [110 * scale, 95 * scale]
    assert (out / "arms.png").is_file()


def test_one_run_per_arm_keeps_the_flat_summary(tmp_path: Path) -> None:
    bi = _write_run(tmp_path / "bi", [9, 100, 110, 120], 0.0, {"gpu": "Fake GPU"})
    out = tmp_path / "report"
    assert arms([f"titan_bi={bi}", "--out", str(out), "--env", '{"recipe": "given", "gpu": "typed"}']) == 0
    summary = json.loads((out / "rl_gpu.json").read_text())
    assert summary["steps"] == 4 and summary["bi_full_step_tok_s"] == 110 and summary["runs_per_arm"] == 1
    assert summary["spread"]["titan_bi"] is None and summary["generation_share"] is None  # no titan arm
    # the run's own record wins over --env; --env fills what the run did not record
    assert summary["env"]["gpu"] == "Fake GPU" and summary["env"]["recipe"] == "given"


def test_transport_summary_reads_push_seconds_after_the_first_and_the_exactness_of_every_step() -> None:
    """``run_rl_e2e.sh ipc_arms``: per transport, push seconds over steps 2.. (step 1's set-up left out), bytes,
    step 1's gap and whether every step's fresh and stale largest gap was 0; the ratio of the medians."""
    from titan_rl_ext.tools.rl_arms import transport_summary

    def run(latency: list[float], stale: list[float | None]) -> list[dict[str, Any]]:
        recs = []
        for step, (lat, st) in enumerate(zip(latency, stale), start=1):
            r = {"step": step, M.SWAP_LATENCY_S: lat, "swap/post_s": lat / 2, "swap/pushed_tensor_bytes": 4096.0,
                 "swap/server_bytes": 4096.0, M.LOGPROB_DIFF_ABS_MEAN: 0.0, M.LOGPROB_DIFF_MAX: 0.0}
            if st is not None:  # a step without off-policy tokens records no stale gap
                r[M.STALE_LOGPROB_DIFF_MAX] = st
            recs.append(r)
        return recs

    s = transport_summary({"cuda_ipc": run([5.0, 0.2, 0.4, 0.3], [None, 0.0, 0.0, 0.0]),
                           "titan_ipc": run([9.0, 0.1, 0.1, 0.7], [None, 0.0, 0.25, None])}, {"gpu": "Fake GPU"})
    today, ipc = s["transports"]["cuda_ipc"], s["transports"]["titan_ipc"]
    assert today["swap_latency_s_median"] == 0.3 and today["swap_latency_s_max"] == 0.4
    assert today["swap_latency_s_step1"] == 5.0  # the first push, left out of the median and the max
    assert (ipc["swap_latency_s_median"], ipc["swap_latency_s_max"]) == (0.1, 0.7)
    assert ipc["swap_post_s_median"] == 0.05 and ipc["pushed_bytes"] == 4096.0 and ipc["steps"] == 4
    assert today["step1_gap"] == 0.0 and today["every_gap_max_zero"] and ipc["every_gap_max_zero"]
    assert today["every_stale_max_zero"] and today["stale_steps"] == 3
    assert not ipc["every_stale_max_zero"] and ipc["stale_steps"] == 2
    assert s["ratio_titan_ipc_over_cuda_ipc"] == pytest.approx(0.1 / 0.3) and s["env"] == {"gpu": "Fake GPU"}
