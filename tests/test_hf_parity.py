"""titan vs transformers, fp32 logits, through the same entry point as ``tools.check_hf``.

Tolerance 1e-4 (the tool's threshold): both sides compute in fp32 but sum in different orders
(chunked gated delta rule, SDPA vs eager attention, per-expert GEMMs); measured max 1e-5 here.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from titan_rl_ext.tools.check_hf import max_logit_diff

TOL = 1e-4

CASES = [
    ("qwen3", "text", False),
    ("qwen3", "text", True),
    ("qwen3_moe", "text", False),
    ("qwen3_5", "vlm", False),
    ("qwen3_5", "vlm", True),
    ("qwen3_5", "text", False),
    ("qwen3_5", "text", True),
    ("qwen3_5_moe", "vlm", False),
    ("qwen3_5_moe", "text", True),
]


@pytest.mark.parametrize("arch,layout,tie", CASES, ids=[f"{a}-{l}-{'tied' if t else 'untied'}" for a, l, t in CASES])
def test_logits_match_transformers(tiny_ckpt, arch: str, layout: str, tie: bool) -> None:
    diff = max_logit_diff(tiny_ckpt(arch, layout=layout, tie=tie))
    assert diff <= TOL, f"max |logit diff| {diff:.3e} > {TOL}"


# Configs far from the tiny defaults: odd layer patterns, GQA ratios, head dims, partial rotary.
ODD = {
    "qwen3_5-full-first-gqa3-partial0.5": (
        "qwen3_5",
        dict(layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"],
             num_hidden_layers=5, num_attention_heads=6, num_key_value_heads=2, head_dim=24,
             rope_parameters={"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5,
                              "mrope_section": [3, 2, 1], "mrope_interleaved": True},
             linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=8, linear_value_head_dim=12,
             linear_conv_kernel_dim=3),
    ),
    "qwen3_5-all-linear-mha": (
        "qwen3_5",
        dict(layer_types=["linear_attention"] * 3, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
             linear_num_key_heads=4, linear_num_value_heads=4),
    ),
    "qwen3_5_moe-top1-interval3": (
        "qwen3_5_moe",
        dict(num_hidden_layers=3, layer_types=None, full_attention_interval=3, num_experts=5, num_experts_per_tok=1,
             shared_expert_intermediate_size=24, head_dim=8, num_attention_heads=8, num_key_value_heads=1),
    ),
    "qwen3-mqa-hd8-bias": (
        "qwen3",
        dict(num_attention_heads=8, num_key_value_heads=1, head_dim=8, attention_bias=True),
    ),
    "qwen3_moe-sparse-step2-no-renorm": (
        "qwen3_moe",
        dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False, num_experts_per_tok=3),
    ),
}


# The odd configs get 3e-4: on an AVX2 CPU the full-first/GQA-3/partial-rotary Qwen3.5 (GDN key/value head
# dims 8/12, conv 3) measured titan vs HF 1.05e-4 while each side's own fp32 error is larger: against a
# float64 run of the same weights titan is off by 1.3e-4 and transformers by 2.0e-4 (its GDN reference
# computes in fp32 even for float64 inputs). 1e-4 held on an AVX-512 machine; the gap is rounding, not
# a modelling difference (titan in float64 vs transformers in float64: 4.5e-5, transformers' inner fp32).
ODD_TOL = 3e-4


@pytest.mark.parametrize("name", list(ODD))
def test_odd_configs_match_transformers(tiny_ckpt, name: str) -> None:
    arch, overrides = ODD[name]
    diff = max_logit_diff(tiny_ckpt(arch, layout="text", tie=name.endswith("mha"), **overrides))
    assert diff <= ODD_TOL, f"{name}: max |logit diff| {diff:.3e} > {ODD_TOL}"


def test_check_hf_cli_prints_and_exits_zero(tiny_ckpt) -> None:
    d = tiny_ckpt("qwen3_5")
    r = subprocess.run(
        [sys.executable, "-m", "titan_rl_ext.tools.check_hf", "--model-dir", str(d)],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("max_abs_logit_diff=")]
    assert len(line) == 1 and float(line[0].split("=")[1]) <= TOL


def test_check_hf_cli_fails_above_tolerance(tiny_ckpt) -> None:
    # a zero tolerance cannot be met by two different fp32 implementations: exit code must say so
    d = tiny_ckpt("qwen3_5")
    r = subprocess.run(
        [sys.executable, "-m", "titan_rl_ext.tools.check_hf", "--model-dir", str(d), "--tolerance", "0"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 1
    assert "exceeds tolerance" in r.stderr
