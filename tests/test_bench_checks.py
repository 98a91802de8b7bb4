"""The verdicts of the GPU checks, on CPU: each must fail where its control shows it could not tell.

- ``tests/gpu/vllm_graphs.py``: BI rows equal across batch sizes prove nothing unless the BI-off control's rows
  vary with the batch;
- ``benchmarks/bi_trainer_step.py``'s order check: on CUDA the BI-off control must differ in some packing;
- its per-block breakdown runs each block's fwd+bwd alone through the block's real return (``block_step``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def vllm_graphs() -> Any:
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    try:
        import vllm_graphs
    finally:
        sys.path.remove(str(ROOT / "tests" / "gpu"))
    return vllm_graphs


@pytest.fixture(scope="module")
def trainer_step() -> Any:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bi_trainer_step
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return bi_trainer_step


def _engine(mode: str, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    graphs = mode == "graphs" or mode == "graphs_nobi"
    return {"mode": mode, "cudagraph_mode": "FULL_DECODE_ONLY" if graphs else "NONE", "graphs": 3 if graphs else 0,
            "init_s": 0.0, "runs": runs}


def test_vllm_graphs_fails_when_the_bi_off_control_does_not_vary(vllm_graphs: Any) -> None:
    rows = [{"ids": [5, 6], "lps": [-0.5, -1.25]}, {"ids": [7, 8], "lps": [-2.0, -0.75]}]
    same = {str(b): [dict(r) for r in rows[: min(b, len(rows))]] for b in vllm_graphs.BATCH_SIZES}
    bi = {m: _engine(m, same) for m in ("graphs", "eager")}
    compared, differing = vllm_graphs._compare(bi)
    assert compared > 0 and differing == 0
    # the control gave every prompt the same bits in every batch: the check could not tell
    flat = vllm_graphs._nobi_spread(_engine("graphs_nobi", same))
    assert flat == 0 and not vllm_graphs.verdict({**bi, "graphs_nobi": _engine("graphs_nobi", same)}, differing, flat)
    # one prompt's logprob moves in one batch size: the control varies, the verdict can pass
    varied = {b: [dict(r) for r in rs] for b, rs in same.items()}
    varied["64"][1] = {"ids": rows[1]["ids"], "lps": [rows[1]["lps"][0], rows[1]["lps"][1] + 2.0**-20]}
    spread = vllm_graphs._nobi_spread(_engine("graphs_nobi", varied))
    assert spread == 1 and vllm_graphs.verdict({**bi, "graphs_nobi": _engine("graphs_nobi", varied)}, differing, spread)
    # and a BI row that differs fails whatever the control did
    assert not vllm_graphs.verdict({**bi, "graphs_nobi": _engine("graphs_nobi", varied)}, 1, spread)


def _check(nonbi: int, nonbi_alone: int, bi_alone: int = 0) -> dict[str, Any]:
    def mode(differing: int, alone: int) -> dict[str, Any]:
        return {"tokens": 100, "differing": differing, "nan_pattern_equal": True, "finite": True,
                "prefix_tokens": 15, "prefix_differing": alone}

    return {"bi": mode(0, bi_alone), "bi_fla_rec": mode(0, 0), "bi_torch_lse": mode(0, 0),
            "nonbi": mode(nonbi, nonbi_alone), "lse_kernel_vs_torch_differing": 0}


def test_trainer_step_order_check_needs_a_differing_control_on_cuda(trainer_step: Any) -> None:
    verdict = trainer_step.order_verdict
    assert not verdict(_check(nonbi=0, nonbi_alone=0), control_must_differ=True)  # could not tell
    assert verdict(_check(nonbi=0, nonbi_alone=0), control_must_differ=False)  # CPU: same bits at any row count
    assert verdict(_check(nonbi=0, nonbi_alone=14), control_must_differ=True)
    assert verdict(_check(nonbi=3, nonbi_alone=0), control_must_differ=True)
    assert not verdict(_check(nonbi=3, nonbi_alone=14, bi_alone=1), control_must_differ=True)


def test_trainer_step_breakdown_runs_each_block(trainer_step: Any) -> None:
    """Each block's fwd+bwd alone, as the breakdown times it, reaches the block's input (a block returns three
    values: unpacking two, as the breakdown did, raises)."""
    from bench_common import build_slice

    from titan_rl_ext.models.common.batch import SeqBatch

    cfg, model = build_slice(torch.device("cpu"), True, None)
    batch = SeqBatch.from_lengths([9, 14])
    rope = model.rope(batch.positions, torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(batch.num_tokens, cfg.dim, generator=g).bfloat16()
    gy = torch.randn(batch.num_tokens, cfg.dim, generator=g).bfloat16()
    for layer in model.layers:
        gx = trainer_step.block_step(layer, x0, batch, rope, gy)
        assert gx.shape == x0.shape and bool(torch.isfinite(gx).all()) and bool((gx != 0).any()), layer.layer_type
        assert any(p.grad is not None and bool((p.grad != 0).any()) for p in layer.parameters()), layer.layer_type
        model.zero_grad(set_to_none=True)
