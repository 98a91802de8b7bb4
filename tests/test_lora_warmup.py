"""The LoRA warm-up that gives ``rl_lora_9b`` a base RL can learn from (``rl/lora_warmup.py``), on a small Qwen3.5 of
HF's own initialisation (the 9B checkpoint's): it raises the copy task's answer probability, the saved checkpoint is
the base with the adapters merged (logits equal to the base + adapter model's within fp32 rounding; every other
tensor and the config unchanged), and the recipes' cache builds it once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

# fp32 merge: W + (alpha / r) B A rounded once to fp32, then two different summation orders (one matmul with the
# merged weight vs. base matmul + adapter matmuls): ~1e-6 on logits of std ~0.5 here; test_lora's PEFT tolerance
MERGE_TOL = 1e-4
STEPS = 10


@pytest.fixture(scope="module")
def small_init(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Hidden 256, one GDN and one attention layer, HF's initialisation (noise 0), VLM layout. Not the tiny
    default's hidden 64: with a frozen random LM head (std 0.02) and an RMS-normed final state, no adapter can push
    a logit past ~0.02 * hidden, which at 64 keeps every answer near 1 % (docs/training.md, "LoRA RL")."""
    from titan_rl_ext.tools.make_tiny import make_tiny

    d = tmp_path_factory.mktemp("lora_warmup") / "init"
    make_tiny("qwen3_5", d, seed=0, layout="vlm", noise=0.0, hidden_size=256, intermediate_size=512,
              num_hidden_layers=2, full_attention_interval=2)
    return d


def _weights(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _dtypes(cfg: Any) -> set[str]:
    """Every ``dtype`` value in a (nested) config."""
    if not isinstance(cfg, dict):
        return set()
    return ({cfg["dtype"]} if "dtype" in cfg else set()) | {d for v in cfg.values() for d in _dtypes(v)}


def _no_dtype(cfg: Any) -> Any:
    return {k: _no_dtype(v) for k, v in cfg.items() if k != "dtype"} if isinstance(cfg, dict) else cfg


def test_lora_warmup_learns_merges_and_is_cached(small_init: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import titan_rl_ext.rl.lora_warmup as lw
    from peft import PeftModel

    from titan_rl_ext.configs.rl_lora import lora_warmed_checkpoint
    from titan_rl_ext.models.common.lora import HYBRID_TARGETS
    from titan_rl_ext.rl.rewards import SyntheticTask
    from titan_rl_ext.rl.warmup import answer_batch, answer_prob, load_hf

    monkeypatch.setenv("TITAN_RL_CACHE", str(tmp_path / "cache"))
    adapter = tmp_path / "adapter"
    # a target it cannot reach in STEPS: every step runs, so the rise measured is STEPS steps'
    warm: dict[str, Any] = dict(targets=HYBRID_TARGETS, target=0.999, rank=8, alpha=16.0, lr=1e-3,
                                max_steps=STEPS, eval_every=5, adapter_dir=adapter, verbose=False)
    out = Path(lora_warmed_checkpoint(small_init, "warm", **warm))
    info = json.loads((out / "warmup.json").read_text())
    assert info["steps"] == STEPS and info["stopped_by"] == "max_steps"
    assert info["answer_prob_after"] > 10 * info["answer_prob_before"], info["curve"]

    # the saved checkpoint is what was measured, and the source is where it started
    held_out = SyntheticTask(kind="copy").sample(100, seed=10_000)
    merged, tok = load_hf(out, torch.float32, "cpu")
    base, _ = load_hf(small_init, torch.float32, "cpu")
    assert answer_prob(merged, tok, held_out) == pytest.approx(info["answer_prob_after"], rel=1e-3)
    assert answer_prob(base, tok, held_out) == pytest.approx(info["answer_prob_before"], rel=1e-3)

    # merged == base + adapter
    ids, mask, _ = answer_batch(tok, SyntheticTask(kind="copy").sample(16, seed=5))
    with torch.no_grad():
        want = PeftModel.from_pretrained(base, str(adapter))(input_ids=ids, attention_mask=mask).logits
        got = merged(input_ids=ids, attention_mask=mask).logits
    on = mask.bool()
    assert (got[on] - want[on]).abs().max().item() <= MERGE_TOL

    # only the adapted projections changed, each of them did, and the config is the source's
    before, after = _weights(small_init), _weights(out)
    assert before.keys() == after.keys()
    adapted = {k for k in before if any(k.endswith(f".{t}.weight") for t in HYBRID_TARGETS) and ".layers." in k}
    assert len(adapted) == 15  # 1 GDN layer x (5 + 3) + 1 attention layer x (4 + 3)
    for k in before:
        assert torch.equal(before[k], after[k]) != (k in adapted), k
    src_cfg, out_cfg = (json.loads((d / "config.json").read_text()) for d in (small_init, out))
    assert _dtypes(out_cfg) <= {src_cfg["dtype"]}  # transformers' save also writes the dtype into the sub-configs
    assert _no_dtype(out_cfg) == _no_dtype(src_cfg)
    from titan_rl_ext.models.hf import load_hf_model

    load_hf_model(out)  # the titan side (RL's trainer and vLLM --model-impl titan) reads it

    # a second call reuses the cache: no warm-up runs, nothing is rewritten
    stamp = (out / "warmup.json").stat().st_mtime_ns

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the cached warm-up was rebuilt")

    monkeypatch.setattr(lw, "lora_warmup", refuse)
    assert lora_warmed_checkpoint(small_init, "warm", **warm) == str(out)
    assert (out / "warmup.json").stat().st_mtime_ns == stamp
