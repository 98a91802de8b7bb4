"""Run metrics: one JSON object per step in ``RUN_DIR/metrics.jsonl``, mirrored to TensorBoard when
it is installed and to Weights & Biases when ``WANDB_PROJECT`` is set (both imported lazily, both
optional). The JSONL file is the source of truth: ``python -m titan_rl_ext.tools.plot RUN_DIR``
reads it.

Metric names (constants below): the trainer/generator logprob gap ``bit_wise/*`` (0 and 0.0 under
batch invariance), throughput, reward and length, PPO clip fractions, staleness of the trained
groups, stale groups dropped, and weight-swap latency; on a GPU also what it holds per side (``memory/*``, from
``rl/gpu_memory.py``). Scalars are logged as numbers; a list value
(``staleness/hist``) is logged as a list in JSONL and as a histogram elsewhere.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from titan_rl_ext.rl.samples import Sample

__all__ = [
    "LOGPROB_DIFF_ABS_MEAN", "LOGPROB_DIFF_MAX", "RATIO_TOKENS_DIFFERENT", "TOKENS_PER_SECOND_FULL_STEP",
    "REWARD_MEAN", "REWARD_STD", "RESPONSE_LENGTH_MEAN", "CLIP_FRAC_LOW", "CLIP_FRAC_HIGH", "STALENESS_MEAN",
    "STALENESS_MAX", "STALE_LOGPROB_DIFF_ABS_MEAN", "STALE_LOGPROB_DIFF_MAX",
    "STALE_RATIO_TOKENS_DIFFERENT", "DROPPED_STALE", "SWAP_LATENCY_S", "TRAINER_BETWEEN_S", "TRAINER_WAIT_S", "TRAINER_STEP_S", "METRICS_FILE",
    "bit_wise_metrics", "gap_metrics", "rollout_metrics", "loss_metrics", "MetricsLogger", "read_metrics",
]

METRICS_FILE = "metrics.jsonl"

LOGPROB_DIFF_ABS_MEAN = "bit_wise/logprob_diff/abs_mean"
LOGPROB_DIFF_MAX = "bit_wise/logprob_diff/max"
RATIO_TOKENS_DIFFERENT = "bit_wise/ratio_tokens_different"
STALE_LOGPROB_DIFF_ABS_MEAN = "bit_wise_stale/logprob_diff/abs_mean"  # off-policy tokens vs the weights that sampled them
STALE_LOGPROB_DIFF_MAX = "bit_wise_stale/logprob_diff/max"
STALE_RATIO_TOKENS_DIFFERENT = "bit_wise_stale/ratio_tokens_different"
TOKENS_PER_SECOND_FULL_STEP = "perf/trainer/tokens_per_second_full_step"
REWARD_MEAN = "reward/mean"
REWARD_STD = "reward/std"
RESPONSE_LENGTH_MEAN = "response_length/mean"
CLIP_FRAC_LOW = "loss/clip_frac_low"
CLIP_FRAC_HIGH = "loss/clip_frac_high"
STALENESS_MEAN = "staleness/mean"
STALENESS_MAX = "staleness/max"
DROPPED_STALE = "rollout/dropped_stale"
SWAP_LATENCY_S = "swap/latency_s"
# a full step = between steps (the last step's logging, torchtitan's loop) + wait (for the window's groups)
# + step (train) + swap (push)
TRAINER_BETWEEN_S = "perf/trainer/between_steps_s"
TRAINER_WAIT_S = "perf/trainer/wait_s"
TRAINER_STEP_S = "perf/trainer/step_s"


@torch.no_grad()
def bit_wise_metrics(lp_gen_T: torch.Tensor, lp_trainer_T: torch.Tensor, mask_T: torch.Tensor) -> dict[str, float]:
    """Generator vs trainer logprobs of the same sampled tokens, over ``mask_T`` only (positions
    outside it may hold NaN, e.g. ``token_logprobs``' first token or env tokens)."""
    if lp_gen_T.shape != lp_trainer_T.shape or lp_gen_T.shape != mask_T.shape:
        raise ValueError(f"shapes differ: {tuple(lp_gen_T.shape)}, {tuple(lp_trainer_T.shape)}, {tuple(mask_T.shape)}")
    mask_T = mask_T.bool()
    gen_T, ref_T = lp_gen_T.float(), lp_trainer_T.float()
    n = int(mask_T.sum())
    if n == 0:
        return {LOGPROB_DIFF_ABS_MEAN: 0.0, LOGPROB_DIFF_MAX: 0.0, RATIO_TOKENS_DIFFERENT: 0.0}
    # select before subtracting: NaN outside the mask must not reach the reductions
    diff_T = (gen_T[mask_T] - ref_T[mask_T]).abs()
    differ = int((gen_T[mask_T] != ref_T[mask_T]).sum())
    return {
        LOGPROB_DIFF_ABS_MEAN: float(diff_T.mean()),
        LOGPROB_DIFF_MAX: float(diff_T.max()),
        RATIO_TOKENS_DIFFERENT: differ / n,
    }


def gap_metrics(lp_gen_T: torch.Tensor, lp_trainer_T: torch.Tensor, prefix: str = "bit_wise") -> dict[str, float]:
    """``bit_wise_metrics`` over every element, named ``<prefix>/...``, plus ``<prefix>/num_tokens``; with no
    tokens the gap is undefined, so NaN rather than 0."""
    n = int(lp_gen_T.numel())
    m = bit_wise_metrics(lp_gen_T, lp_trainer_T, torch.ones_like(lp_gen_T, dtype=torch.bool))
    out = {k.replace("bit_wise/", f"{prefix}/", 1): (v if n else float("nan")) for k, v in m.items()}
    out[f"{prefix}/num_tokens"] = n
    return out


def rollout_metrics(groups: Sequence[Sequence[Sample]]) -> dict[str, float]:
    """Reward mean/std over all samples; response length = generated (loss) tokens per sample."""
    samples = [s for g in groups for s in g]
    if not samples:
        return {}
    rewards = [s.reward for s in samples]
    return {
        REWARD_MEAN: statistics.fmean(rewards),
        REWARD_STD: statistics.pstdev(rewards),
        RESPONSE_LENGTH_MEAN: statistics.fmean(s.num_loss_tokens for s in samples),
    }


def loss_metrics(metrics: Mapping[str, Any], prefix: str = "loss/") -> dict[str, float]:
    """A loss's metric dict (``clip_frac_low``, ``approx_kl``, ... as 0-dim tensors) under ``prefix``."""
    return {prefix + k: _scalar(v) for k, v in metrics.items()}


def _scalar(v: Any) -> float:
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().item())
    return float(v)


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().float().item() if v.numel() == 1 else v.detach().float().flatten().tolist()
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    return float(v)


class MetricsLogger:
    """``log(step, metrics)`` appends ``{"step": step, "time": unix_s, **metrics}`` to
    ``run_dir/metrics.jsonl`` (flushed per line, so a crashed run keeps its history).

    ``tensorboard``: None = on when ``torch.utils.tensorboard`` imports. W&B: on when
    ``wandb_project`` (default: env ``WANDB_PROJECT``) is set.
    """

    def __init__(
        self, run_dir: str | Path, *, tensorboard: bool | None = None, wandb_project: str | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self._file = self.path.open("a")
        self._tb = self._open_tensorboard() if tensorboard is not False else None
        if tensorboard and self._tb is None:
            raise ImportError("tensorboard=True but torch.utils.tensorboard does not import (pip install tensorboard)")
        project = wandb_project if wandb_project is not None else os.environ.get("WANDB_PROJECT")
        self._wandb = self._open_wandb(project, config) if project else None

    def _open_tensorboard(self) -> Any | None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return None
        return SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def _open_wandb(self, project: str, config: Mapping[str, Any] | None) -> Any:
        import wandb  # optional: only when a project is configured

        return wandb.init(project=project, dir=str(self.run_dir), config=dict(config or {}))

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        record: dict[str, Any] = {"step": int(step), "time": time.time()}
        record.update({k: _jsonable(v) for k, v in metrics.items()})
        # NaN stays NaN (json's default; Python's json reads it back), so a missing value is visible
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in record.items():
                if k in ("step", "time") or isinstance(v, str) or v is None:
                    continue
                if isinstance(v, list):
                    if v:
                        self._tb.add_histogram(k, torch.tensor(v, dtype=torch.float32), step)
                elif not (isinstance(v, float) and math.isnan(v)):
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            import wandb

            self._wandb.log(
                {k: (wandb.Histogram(v) if isinstance(v, list) else v) for k, v in record.items() if k != "step"},
                step=int(step),
            )
        return record

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
