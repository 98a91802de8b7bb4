"""Trainer vs generator logprobs through the real vLLM engine (``tools.parity``), on CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from servers import one_core

REPO = Path(__file__).resolve().parents[1]
LINE = re.compile(r"logprob_diff abs_mean=(\S+) max=(\S+) tokens=(\d+) differing=(\d+)")


def _parity(model_dir: Path, *flags: str, core: int = 0) -> tuple[int, dict[str, float], str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **one_core(core))
    env.pop("TITAN_BATCH_INVARIANT", None)
    r = subprocess.run([sys.executable, "-m", "titan_rl_ext.tools.parity", "--model-dir", str(model_dir), *flags],
                       capture_output=True, text=True, timeout=600, env=env)
    m = LINE.search(r.stdout)
    assert m, (r.stdout + r.stderr)[-4000:]
    stats = dict(zip(("abs_mean", "max", "tokens", "differing"), map(float, m.groups())))
    cached = re.search(r"cached_prompt_tokens=(\d+)", r.stdout)
    stats["cached"] = float(cached.group(1)) if cached else -1
    return r.returncode, stats, r.stdout


DOCTOR_OP = "layers.2.feed_forward.w13"  # the op test_doctor_names_the_broken_op nudges
# each test's run of the tool: the checkpoint's architecture and the flags
RUNS: dict[str, tuple[str, tuple[str, ...]]] = {
    **{f"bi-{arch}": (arch, ("--bi", "--prefix-caching")) for arch in ("qwen3_5", "qwen3_5_moe", "qwen3")},
    "no-bi": ("qwen3_5", ("--prefix-caching",)),
    "doctor": ("qwen3_5", ("--bi", "--doctor", "--perturb-generator-op", DOCTOR_OP,
                           "--num-seqs", "4", "--max-tokens", "8")),
}
KEY = {"test_bi_parity_is_exact_with_prefix_caching": lambda params: f"bi-{params['arch']}",
       "test_parity_without_bi_shows_the_gap": lambda params: "no-bi",
       "test_doctor_names_the_broken_op": lambda params: "doctor"}


def _key(item: Any) -> str:
    return KEY[item.originalname](getattr(item, "callspec", None) and item.callspec.params)


@pytest.fixture(scope="module")
def parity_runs(request: pytest.FixtureRequest, tiny_ckpt: Any) -> Iterator[dict[str, Future[Any]]]:
    """The collected tests' runs of the tool, two at a time side by side: a run's trainer and engine mostly take
    turns, so one run leaves a core idle; each engine on its turn of the cores (``one_core``). What the tests
    check does not depend on timing (the same bits, however the runs overlap)."""
    keys = [_key(item) for item in request.session.items if item.module is request.module and item.originalname in KEY]
    ckpts = {k: tiny_ckpt(RUNS[k][0]) for k in keys}  # here: tiny_ckpt's cache is not for threads

    def run(key: str) -> tuple[int, dict[str, float], str]:  # in the pool's thread parity_<k>: on core turn k
        return _parity(ckpts[key], *RUNS[key][1], core=int(threading.current_thread().name.rsplit("_", 1)[1]))

    pool = ThreadPoolExecutor(2, thread_name_prefix="parity")
    try:
        yield {k: pool.submit(run, k) for k in keys}
    finally:
        pool.shutdown(cancel_futures=True)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3"])
def test_bi_parity_is_exact_with_prefix_caching(parity_runs: dict[str, Future[Any]], arch: str) -> None:
    rc, st, out = parity_runs[f"bi-{arch}"].result()
    assert st["tokens"] >= 200
    assert st["differing"] == 0 and st["max"] == 0.0, out
    assert st["cached"] > 0, "the second wave must hit the prefix cache"
    assert rc == 0


@pytest.mark.slow
def test_parity_without_bi_shows_the_gap(parity_runs: dict[str, Future[Any]]) -> None:
    rc, st, out = parity_runs["no-bi"].result()
    assert rc == 0  # without --bi a difference is reported, not an error
    assert st["differing"] > 0 and 0 < st["max"] < 1e-3, out


@pytest.mark.slow
def test_doctor_names_the_broken_op(parity_runs: dict[str, Future[Any]]) -> None:
    """One op nudged by one ulp in the engine only: BI parity fails and the doctor points at that op."""
    rc, st, out = parity_runs["doctor"].result()
    assert rc == 1 and st["differing"] > 0
    assert f"first divergence at module '{DOCTOR_OP}'" in out, out
