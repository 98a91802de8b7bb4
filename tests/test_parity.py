"""Trainer vs generator logprobs through the real vLLM engine (``tools.parity``), on CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINE = re.compile(r"logprob_diff abs_mean=(\S+) max=(\S+) tokens=(\d+) differing=(\d+)")


def _parity(model_dir: Path, *flags: str) -> tuple[int, dict[str, float], str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TITAN_BATCH_INVARIANT", None)
    r = subprocess.run([sys.executable, "-m", "titan_rl_ext.tools.parity", "--model-dir", str(model_dir), *flags],
                       capture_output=True, text=True, timeout=600, env=env)
    m = LINE.search(r.stdout)
    assert m, (r.stdout + r.stderr)[-4000:]
    stats = dict(zip(("abs_mean", "max", "tokens", "differing"), map(float, m.groups())))
    cached = re.search(r"cached_prompt_tokens=(\d+)", r.stdout)
    stats["cached"] = float(cached.group(1)) if cached else -1
    return r.returncode, stats, r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3"])
def test_bi_parity_is_exact_with_prefix_caching(tiny_ckpt, arch: str) -> None:
    rc, st, out = _parity(tiny_ckpt(arch), "--bi", "--prefix-caching")
    assert st["tokens"] >= 200
    assert st["differing"] == 0 and st["max"] == 0.0, out
    assert st["cached"] > 0, "the second wave must hit the prefix cache"
    assert rc == 0


@pytest.mark.slow
def test_parity_without_bi_shows_the_gap(tiny_ckpt) -> None:
    rc, st, out = _parity(tiny_ckpt("qwen3_5"), "--prefix-caching")
    assert rc == 0  # without --bi a difference is reported, not an error
    assert st["differing"] > 0 and 0 < st["max"] < 1e-3, out


@pytest.mark.slow
def test_doctor_names_the_broken_op(tiny_ckpt) -> None:
    """One op nudged by one ulp in the engine only: BI parity fails and the doctor points at that op."""
    op = "layers.2.feed_forward.w13"
    rc, st, out = _parity(tiny_ckpt("qwen3_5"), "--bi", "--doctor", "--perturb-generator-op", op,
                          "--num-seqs", "4", "--max-tokens", "8")
    assert rc == 1 and st["differing"] > 0
    assert f"first divergence at module '{op}'" in out, out
