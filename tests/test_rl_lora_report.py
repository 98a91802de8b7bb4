"""The LoRA run's report (``tools/rl_lora_report.py``) on a fabricated run dir: exactness, reward and adapter-only
flags follow the records (and turn false when one record says otherwise), the generator's memory comes from NVML's
process figures or, without them, from the device's used memory, and a run dir missing a file or a record is
refused naming it. Also ``rl/gpu_memory.py``'s CPU side: no figure where nothing was measured. Seconds, no engine."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from titan_rl_ext.rl import gpu_memory as G
from titan_rl_ext.rl import metrics as M
from titan_rl_ext.tools.rl_lora_report import ReportError, main, summarize

STEPS = 12
ADAPTER = {"a.lora_A": (16, 64), "a.lora_B": (32, 16), "b.lora_A": (16, 32), "b.lora_B": (64, 16)}  # 3584 params
ENV = {"gpu": "Fake GPU", "recipe": "rl_lora_9b", "rl_steps": STEPS, "git": "abc123", "git_tree": "def456",
       "gpu_memory_utilization": 0.34}


def _record(step: int) -> dict[str, Any]:
    return {
        "step": step, M.LOGPROB_DIFF_ABS_MEAN: 0.0, M.LOGPROB_DIFF_MAX: 0.0, "bit_wise/num_tokens": 100,
        # the window runs ahead from step 3: off-policy tokens, each recomputed with its own version
        M.STALE_LOGPROB_DIFF_MAX: 0.0 if step >= 3 else float("nan"), "bit_wise_stale/num_tokens": 50 if step >= 3 else 0,
        M.REWARD_MEAN: 0.1 + 0.01 * step,
        # step 1's push gathers the base once: slower
        M.SWAP_LATENCY_S: 4.0 if step == 1 else 0.1 * step, "swap/post_s": 0.05,
        "swap/pushed_tensors": 4.0, "swap/server_tensors": 4.0, "swap/pushed_tensor_bytes": 7168.0,
        "swap/server_bytes": 900.0,
        G.TRAINER_PEAK_ALLOCATED: 30.0 + step, G.TRAINER_PEAK_RESERVED: 33.0 + step, G.TRAINER_RESERVED: 31.0,
        G.DEVICE_USED: 60.0, G.DEVICE_TOTAL: 79.2, G.TRAINER_PROCESS: 32.0, G.GENERATOR_PROCESSES: 26.5,
    }


def _run_dir(d: Path, records: list[dict[str, Any]] | None = None, drop: tuple[str, ...] = ()) -> Path:
    from safetensors.torch import save_file

    d.mkdir(parents=True)
    recs = records if records is not None else [_record(s) for s in range(1, STEPS + 1)]
    (d / M.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in recs))
    (d / "run_env.json").write_text(json.dumps(ENV))
    (d / "warmup.json").write_text(json.dumps({"steps": 7, "answer_prob_before": 0.01, "answer_prob_after": 0.22,
                                               "stopped_by": "target", "seconds": 95.0, "curve": [[0, 0.01]]}))
    (d / "adapter").mkdir()
    (d / "adapter" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 16, "lora_alpha": 32.0,
                                                                   "target_modules": ["q_proj", "v_proj"]}))
    save_file({k: torch.zeros(s, dtype=torch.bfloat16) for k, s in ADAPTER.items()},
              str(d / "adapter" / "adapter_model.safetensors"))
    for name in drop:
        (d / name).unlink()
    return d


def test_report_of_an_exact_rising_run(tmp_path: Path) -> None:
    run = _run_dir(tmp_path / "run")
    out = tmp_path / "rl_lora.json"
    assert main([str(run), "--out", str(out)]) == 0
    s = json.loads(out.read_text())
    env = s["env"]
    assert (env["gpu"], env["git"], env["git_tree"], env["git_from"]) == ("Fake GPU", "abc123", "def456", "run")
    assert (env["rank"], env["targets"], env["adapter_tensors"]) == (16, ["q_proj", "v_proj"], 4)
    assert env["adapter_params"] == 16 * 64 + 32 * 16 + 16 * 32 + 64 * 16 and env["adapter_dtypes"] == ["BF16"]
    assert env["adapter_bytes"] == 2 * env["adapter_params"]
    assert s["warmup"]["answer_prob_after"] == 0.22 and s["steps"] == STEPS and s["complete"] is True
    ex = s["exactness"]
    assert ex["step1_logprob_diff_abs_mean"] == 0.0 and ex["step1_exact"] and ex["every_step_fresh_exact"]
    assert ex["stale_max_over_steps"] == 0.0 and ex["every_step_stale_exact"] is True
    assert ex["stale_tokens"] == 50 * (STEPS - 2) and ex["stale_steps"] == STEPS - 2
    rw = s["reward"]
    assert rw["first5_mean"] == pytest.approx(0.13) and rw["last5_mean"] == pytest.approx(0.2)
    assert rw["rising"] is True and len(rw["per_step"]) == STEPS
    p = s["push"]
    assert p["pushes"] == STEPS and p["seconds_max"] == 4.0 and p["adapter_only"] is True
    assert p["seconds_median_after_first"] == pytest.approx(0.7)  # steps 2..12: 0.2..1.2
    assert p["bytes"] == 7168 and p["tensors"] == 4
    mem = s["memory_gib"]
    assert mem["trainer_peak"] == 33.0 + STEPS and mem["trainer_peak_allocated"] == 30.0 + STEPS
    assert mem["generator"] == 26.5 and mem["generator_from"].startswith("nvml")
    assert mem["generator_budget"] == pytest.approx(0.34 * 79.2)


def test_one_record_against_turns_a_flag(tmp_path: Path) -> None:
    recs = [_record(s) for s in range(1, STEPS + 1)]
    recs[0][M.LOGPROB_DIFF_ABS_MEAN], recs[0][M.LOGPROB_DIFF_MAX] = 1e-3, 4e-3
    recs[7][M.STALE_LOGPROB_DIFF_MAX] = 2e-5
    recs[5]["swap/server_tensors"] = 3.0  # the server took fewer tensors than the adapter has
    for r in recs:
        r[M.REWARD_MEAN] = 0.3 - 0.01 * r["step"]
        del r[G.GENERATOR_PROCESSES], r[G.TRAINER_PROCESS]  # NVML named no process of ours
    s = summarize(_run_dir(tmp_path / "run", recs))
    ex = s["exactness"]
    assert not ex["step1_exact"] and not ex["every_step_fresh_exact"] and ex["step1_logprob_diff_abs_mean"] == 1e-3
    assert ex["stale_max_over_steps"] == 2e-5 and ex["every_step_stale_exact"] is False
    assert s["reward"]["rising"] is False and s["push"]["adapter_only"] is False
    assert s["memory_gib"]["generator"] == 60.0 - 31.0 and s["memory_gib"]["generator_from"].startswith("device used")

    # no stale token checked at all proves nothing; too few steps for two reward windows: no verdict
    short = [{**_record(s), "bit_wise_stale/num_tokens": 0, M.STALE_LOGPROB_DIFF_MAX: float("nan")} for s in (1, 2, 3)]
    s = summarize(_run_dir(tmp_path / "short", short))
    assert s["exactness"]["every_step_stale_exact"] is False and math.isnan(s["exactness"]["stale_max_over_steps"])
    assert s["reward"]["rising"] is None and s["complete"] is False


@pytest.mark.parametrize("what, needle", [
    ("warmup.json", "no warmup.json"),
    ("adapter/adapter_model.safetensors", "no adapter_model.safetensors"),
    ("run_env.json", "no run_env.json"),
    ("cpu", r"lacks \['memory/device_used_gib'"),
    ("resumed", "once each"),
    ("nopush", "no step pushed"),
])
def test_refuses_a_run_dir_without_what_it_needs(tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str,
                                                needle: str) -> None:
    recs = [_record(s) for s in range(1, STEPS + 1)]
    drop: tuple[str, ...] = ()
    if what == "cpu":  # a CPU run: no memory/* in its records
        recs = [{k: v for k, v in r.items() if not k.startswith("memory/")} for r in recs]
    elif what == "resumed":
        recs = recs + recs[-2:]
    elif what == "nopush":
        recs = [{**r, M.SWAP_LATENCY_S: float("nan")} for r in recs]
    else:
        drop = (what,)
    run = _run_dir(tmp_path / "run", recs, drop)
    with pytest.raises(ReportError, match=needle):
        summarize(run)
    # the command line says so too (argparse's exit 2), and writes nothing
    with pytest.raises(SystemExit) as stop:
        main([str(run), "--out", str(tmp_path / "x.json")])
    assert stop.value.code == 2 and re.search(needle, capsys.readouterr().err) and not (tmp_path / "x.json").exists()


class _FakeNvml:
    """NVML's process list: pid -> bytes used (None: NVML_VALUE_NOT_AVAILABLE)."""

    def __init__(self, used: dict[int, int | None]) -> None:
        self.used = used

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        return [SimpleNamespace(pid=p, usedGpuMemory=u) for p, u in self.used.items()]


def test_memory_metrics_measure_or_stay_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    assert G.step_memory_metrics(torch.device("cpu"), os.getpid()) == {}
    # a child's child belongs to the tree (vLLM's API server starts its engine core as a child)
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                              "subprocess.run([sys.executable, '-c', 'import time; time.sleep(30)'])"])
    try:
        for _ in range(100):
            tree = G.process_tree(child.pid)
            if len(tree) == 2:
                break
            subprocess.run(["sleep", "0.05"])
        assert child.pid in tree and len(tree) == 2, tree
        assert os.getpid() not in tree
        # per process: this one is the trainer, the spawned server's tree the generator, any other process neither
        gib = 2**30
        grandchild = next(iter(tree - {child.pid}))
        monkeypatch.setattr(torch.cuda, "_get_nvml_device_index", lambda device: 0)
        nvml = _FakeNvml({os.getpid(): 30 * gib, child.pid: gib, grandchild: 25 * gib, 999_999_999: 7 * gib})
        monkeypatch.setattr(G, "_nvml", lambda: nvml)
        cuda = torch.device("cuda", 0)
        assert G._per_process(cuda, child.pid) == {G.TRAINER_PROCESS: 30.0, G.GENERATOR_PROCESSES: 26.0}
        assert G._per_process(cuda, None) == {G.TRAINER_PROCESS: 30.0}  # generators not this run's
        nvml.used[grandchild] = None  # one of the server's figures unknown: no generator figure
        assert G._per_process(cuda, child.pid) == {G.TRAINER_PROCESS: 30.0}
        # the host's pids (a container's own pid namespace): none is ours, so nothing is attributed
        nvml.used = {p + 1_000_000: u for p, u in nvml.used.items()}
        assert G._per_process(cuda, child.pid) == {}
    finally:
        for pid in G.process_tree(child.pid) - {child.pid}:
            os.kill(pid, 9)
        child.kill()
        child.wait()
