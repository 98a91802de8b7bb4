"""The LoRA RL run's summary (issue 44, ``rl_lora_9b``): ``benchmarks/results/rl_lora.json``, from the run's own
records alone.

    python -m titan_rl_ext.tools.rl_lora_report RUN_DIR --out rl_lora.json [--adapter DIR]

``RUN_DIR`` holds what ``tests/gpu/run_rl_e2e.sh lora`` leaves: the trainer's ``metrics.jsonl``, ``run_env.json``
(GPU, versions, recipe and its settings, commit), ``warmup.json`` (the LoRA warm-up that made the start checkpoint)
and the exported adapter (``adapter/``, or ``--adapter``: its ``adapter_config.json`` and the header of its
``adapter_model.safetensors``, the tensors' names, dtypes and shapes). The summary:

- ``exactness``: step 1's trainer/generator logprob gap, and the largest gap of any off-policy token recomputed with
  the adapter version that sampled it (``bit_wise_stale/*``), with whether every step was exact;
- ``reward``: each step's mean reward, the first and last five steps' means, ``rising`` (last above first; null
  with fewer than ten steps, where the two windows would overlap);
- ``push``: the trainer's push seconds (gather + post + keep for the stale gap, ``swap/latency_s``) and bytes, and
  ``adapter_only``: every push's tensor count, as the trainer sent it and as the server took it, is the exported
  adapter's;
- ``memory_gib``: the trainer's peak (its allocator's reserved bytes) and the generator's, from the records'
  ``memory/*`` (``rl/gpu_memory.py``): the spawned server's processes from NVML where it named them, else the
  device's used memory less the trainer's reserved (then the trainer's CUDA context counts as the generator's:
  ``generator_from`` says which).

A run dir that lacks a file or a record this needs is refused with the reason. NaN (not measured) is written as
null.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
from pathlib import Path
from typing import Any

from titan_rl_ext.rl import gpu_memory as G
from titan_rl_ext.rl import metrics as M
from titan_rl_ext.tools.plot import _series
from titan_rl_ext.tools.rl_arms import _mean, _median, _nan_to_null, arm_summary, report_env

WARMUP_FILE = "warmup.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
REWARD_WINDOW = 5  # steps averaged at each end of the run
_NEEDED_EVERY_STEP = (M.LOGPROB_DIFF_ABS_MEAN, M.LOGPROB_DIFF_MAX, "bit_wise/num_tokens", M.REWARD_MEAN,
                      M.SWAP_LATENCY_S, G.TRAINER_PEAK_RESERVED, G.TRAINER_RESERVED, G.DEVICE_USED)
_NEEDED_ON_PUSH = ("swap/pushed_tensors", "swap/server_tensors", "swap/pushed_tensor_bytes")
_NEEDED_WARMUP = ("steps", "answer_prob_before", "answer_prob_after", "stopped_by", "seconds")
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class ReportError(ValueError):
    """The run dir lacks what the summary is made from."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ReportError(f"no {path.name} in {path.parent}")
    return json.loads(path.read_text())


def adapter_tensors(path: Path) -> dict[str, Any]:
    """From a safetensors file's header alone (no tensor is read): its tensor count, parameters, bytes and dtypes."""
    if not path.is_file():
        raise ReportError(f"no {path.name} in {path.parent}: the exported adapter's tensors are needed")
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    params = sum(math.prod(v["shape"]) for v in tensors.values())
    return {"tensors": len(tensors), "params": params,
            "bytes": sum(math.prod(v["shape"]) * _DTYPE_BYTES[v["dtype"]] for v in tensors.values()),
            "dtypes": sorted({v["dtype"] for v in tensors.values()})}


def _check_records(records: list[dict[str, Any]]) -> None:
    steps = [int(r["step"]) for r in records]
    if not steps:
        raise ReportError("metrics.jsonl holds no step")
    if steps != list(range(1, len(steps) + 1)):
        raise ReportError(f"steps are not 1..{len(steps)} once each ({steps[:12]}...): a resumed or appended run; "
                          "give one run's records")
    missing = sorted({k for r in records for k in _NEEDED_EVERY_STEP if k not in r})
    if missing:
        raise ReportError(f"metrics.jsonl lacks {missing} (a CPU run records no memory/*)")
    pushes = [r for r in records if not math.isnan(r[M.SWAP_LATENCY_S])]
    if not pushes:
        raise ReportError("no step pushed (swap/latency_s is NaN in every record)")
    missing = sorted({k for r in pushes for k in _NEEDED_ON_PUSH if k not in r})
    if missing:
        raise ReportError(f"metrics.jsonl's pushes lack {missing}")


def exactness(records: list[dict[str, Any]]) -> dict[str, Any]:
    arm = arm_summary(records)
    first = records[0]
    stale = [r for r in records if (r.get("bit_wise_stale/num_tokens") or 0) > 0]
    fresh = [r for r in records if r["bit_wise/num_tokens"] > 0]
    return {
        "step1_logprob_diff_abs_mean": arm["step1_gap"],
        "step1_logprob_diff_max": first[M.LOGPROB_DIFF_MAX],
        "step1_tokens": first["bit_wise/num_tokens"],
        "step1_exact": first["bit_wise/num_tokens"] > 0 and first[M.LOGPROB_DIFF_MAX] == 0.0,
        "every_step_fresh_exact": bool(fresh) and all(r[M.LOGPROB_DIFF_MAX] == 0.0 for r in fresh),
        "fresh_tokens": sum(int(r["bit_wise/num_tokens"]) for r in fresh),
        "stale_max_over_steps": arm["stale_max_abs"],
        "stale_tokens": arm["stale_tokens"],
        "stale_steps": len(stale),
        # no stale token checked proves nothing: the window never ran ahead
        "every_step_stale_exact": bool(stale) and all(r[M.STALE_LOGPROB_DIFF_MAX] == 0.0 for r in stale),
    }


def reward(records: list[dict[str, Any]]) -> dict[str, Any]:
    _, per_step = _series(records, M.REWARD_MEAN)
    first, last = _mean(per_step[:REWARD_WINDOW]), _mean(per_step[-REWARD_WINDOW:])
    return {"first5_mean": first, "last5_mean": last,
            "rising": last > first if len(per_step) >= 2 * REWARD_WINDOW else None, "per_step": per_step}


def push(records: list[dict[str, Any]], adapter: dict[str, Any]) -> dict[str, Any]:
    pushes = [r for r in records if not math.isnan(r[M.SWAP_LATENCY_S])]
    seconds = [r[M.SWAP_LATENCY_S] for r in pushes]
    sent = [int(r["swap/pushed_tensors"]) for r in pushes]
    taken = [r["swap/server_tensors"] for r in pushes]
    tensor_bytes = sorted({int(r["swap/pushed_tensor_bytes"]) for r in pushes})
    return {
        "pushes": len(pushes),
        "seconds_median": _median(seconds),
        "seconds_max": max(seconds),
        # step 1's push may gather the frozen base once for the stale gap (rl/trainer.py, _push)
        "seconds_median_after_first": arm_summary(records)["swap_s_median"],
        "post_seconds_median": _median([r["swap/post_s"] for r in pushes if "swap/post_s" in r]),
        "bytes": tensor_bytes[0] if len(tensor_bytes) == 1 else tensor_bytes,
        "server_bytes_median": _median([r["swap/server_bytes"] for r in pushes if "swap/server_bytes" in r]),
        "tensors": sent[0] if len(set(sent)) == 1 else sent,
        "adapter_only": all(s == t == adapter["tensors"] for s, t in zip(sent, taken)),
    }


def memory(records: list[dict[str, Any]], env: dict[str, Any]) -> dict[str, Any]:
    def peak(key: str) -> float:
        return max(_series(records, key)[1], default=float("nan"))

    by_nvml = peak(G.GENERATOR_PROCESSES)
    if not math.isnan(by_nvml):
        generator, source = by_nvml, "nvml: the spawned server's processes"
    else:
        generator = max(r[G.DEVICE_USED] - r[G.TRAINER_RESERVED] for r in records)
        source = "device used - trainer reserved (the trainer's CUDA context counted as the generator's)"
    total = peak(G.DEVICE_TOTAL)
    share = env.get("gpu_memory_utilization")
    return {
        "trainer_peak": peak(G.TRAINER_PEAK_RESERVED),
        "trainer_peak_allocated": peak(G.TRAINER_PEAK_ALLOCATED),
        "trainer_process_max": peak(G.TRAINER_PROCESS),
        "generator": generator,
        "generator_from": source,
        # what vLLM was told it may take: its --gpu-memory-utilization share of the device
        "generator_budget": float(share) * total if share is not None else float("nan"),
        "device_used_max": peak(G.DEVICE_USED),
        "device_total": total,
    }


def summarize(run_dir: Path, adapter_dir: Path | None = None) -> dict[str, Any]:
    """The ``rl_lora.json`` summary of ``run_dir`` (module docstring); ``ReportError`` names what is missing."""
    adapter_dir = adapter_dir or run_dir / "adapter"
    if not (run_dir / M.METRICS_FILE).is_file():
        raise ReportError(f"no {M.METRICS_FILE} in {run_dir}")
    run_env = _read_json(run_dir / "run_env.json")
    warmup = _read_json(run_dir / WARMUP_FILE)
    missing = [k for k in _NEEDED_WARMUP if k not in warmup]
    if missing:
        raise ReportError(f"{WARMUP_FILE} lacks {missing}")
    config = _read_json(adapter_dir / ADAPTER_CONFIG)
    tensors = adapter_tensors(adapter_dir / ADAPTER_WEIGHTS)
    records = M.read_metrics(run_dir)
    _check_records(records)
    steps = len(records)
    # report_env leaves out the window (rl_arms compares runs of several windows); here it is one of the settings
    env = {**report_env([run_env], {}), **({"offpolicy": run_env["offpolicy"]} if "offpolicy" in run_env else {}),
           "rank": config["r"], "alpha": config["lora_alpha"], "targets": config["target_modules"],
           "adapter_params": tensors["params"], "adapter_tensors": tensors["tensors"],
           "adapter_dtypes": tensors["dtypes"], "adapter_bytes": tensors["bytes"]}
    return {
        "env": env,
        "warmup": warmup,
        "steps": steps,
        "complete": steps >= int(run_env.get("rl_steps", steps)),
        "exactness": exactness(records),
        "reward": reward(records),
        "push": push(records, tensors),
        "memory_gib": memory(records, run_env),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="the JSON to write (e.g. benchmarks/results/rl_lora.json)")
    ap.add_argument("--adapter", type=Path, default=None, help="the exported adapter (default: RUN_DIR/adapter)")
    args = ap.parse_args(argv)
    try:
        summary = summarize(args.run_dir, args.adapter)
    except ReportError as e:
        ap.error(str(e))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(_nan_to_null(summary), indent=1, allow_nan=False) + "\n")
    print(args.out)
    brief = {k: v for k, v in summary.items() if k not in ("env", "warmup")}
    brief["reward"] = {k: v for k, v in summary["reward"].items() if k != "per_step"}
    print(json.dumps(_nan_to_null(brief), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
