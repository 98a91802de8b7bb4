"""The trained policy out as a stock HF checkpoint (``titan_rl_ext.tools.export``): same layout and files as the
source, reloaded logits bit-equal to the trainer's, loadable by transformers, served by vLLM's native class."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from titan_rl_ext.models.common.batch import SeqBatch
from titan_rl_ext.models.common.state_dict_adapter import CheckpointMismatchError
from titan_rl_ext.models.hf import load_hf_model
from titan_rl_ext.tools.check_hf import max_logit_diff
from titan_rl_ext.tools.export import export_hf, main
from requires import require


def _keys_and_tensor(d: Path, key: str | None = None) -> tuple[set[str], torch.Tensor | None]:
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        return set(f.keys()), (f.get_tensor(key) if key else None)


def _trained(src: Path) -> torch.nn.Module:
    """The source model after some 'training': every parameter moved."""
    model, _ = load_hf_model(src)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-2)
    return model


def _logits(model: torch.nn.Module, vocab: int) -> torch.Tensor:
    toks = torch.randint(0, vocab, (23,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(toks, SeqBatch.from_lengths([9, 14]))


@pytest.mark.parametrize("layout", ["vlm", "text"])
def test_export_roundtrip_bit_exact_with_the_source_layout(tiny_ckpt, tmp_path: Path, layout: str) -> None:
    src = tiny_ckpt("qwen3_5", layout=layout)
    model = _trained(src)
    out = export_hf(model.state_dict(), src, tmp_path / "out")
    src_keys, _ = _keys_and_tensor(src)
    out_keys, _ = _keys_and_tensor(out)
    assert out_keys == src_keys  # text or VLM keys, vision tower and MTP head included
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).read_bytes() == (src / f).read_bytes(), f
    visual = sorted(k for k in src_keys if k.startswith("model.visual."))
    if visual:  # untrained parts are the source's, bit for bit
        assert torch.equal(_keys_and_tensor(out, visual[0])[1], _keys_and_tensor(src, visual[0])[1])
    reloaded, _ = load_hf_model(out)
    vocab = model.config.vocab_size
    assert torch.equal(_logits(reloaded, vocab), _logits(model, vocab))
    assert not torch.equal(_logits(load_hf_model(src)[0], vocab), _logits(model, vocab))  # the export carries the training
    # transformers loads it and agrees with titan (the HF-parity tolerance of the project, fp32)
    assert max_logit_diff(out) < 1e-4


def test_export_from_a_dcp_checkpoint_step(tiny_ckpt, tmp_path: Path) -> None:
    """torchtitan checkpoints store the model's flattened parameter names at the top level."""
    import torch.distributed.checkpoint as dcp

    src = tiny_ckpt("qwen3_5", layout="vlm")
    model = _trained(src)
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "step-3"))
    assert main(["--source", str(src), "--dcp", str(tmp_path / "step-3"), "--out", str(tmp_path / "out")]) == 0
    reloaded, _ = load_hf_model(tmp_path / "out")
    assert torch.equal(_logits(reloaded, model.config.vocab_size), _logits(model, model.config.vocab_size))


def test_export_refuses_a_state_dict_that_does_not_fit(tiny_ckpt, tmp_path: Path) -> None:
    src = tiny_ckpt("qwen3_5", layout="vlm")
    sd = dict(_trained(src).state_dict())
    sd.pop("norm.weight")
    with pytest.raises(CheckpointMismatchError, match="missing .*norm.weight"):
        export_hf(sd, src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="overwrite"):
        export_hf(dict(_trained(src).state_dict()), src, src)


def test_exported_checkpoint_serves_with_vllms_native_class(tiny_ckpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``--model-impl titan``: vLLM's own Qwen3 class serves the export; greedy tokens equal titan's."""
    require("vllm")
    for k, v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}.items():
        monkeypatch.setenv(k, v)
    src = tiny_ckpt("qwen3", layout="text", head_dim=32)  # a head size vLLM's CPU attention supports
    model = _trained(src)
    out = export_hf(model.state_dict(), src, tmp_path / "out")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = [5, 17, 3, 99, 42]
    llm = LLM(model=str(out), dtype="float32", max_model_len=256, seed=0, enforce_eager=True)
    try:
        served = llm.collective_rpc(lambda w: type(w.model_runner.get_model()).__name__)[0]
        got = llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(max_tokens=6, temperature=0.0))
        tokens = list(got[0].outputs[0].token_ids)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    assert served == "Qwen3ForCausalLM"
    seq = list(prompt)
    with torch.no_grad():  # titan greedy, one full forward per token
        for _ in range(6):
            seq.append(int(model(torch.tensor(seq), SeqBatch.from_lengths([len(seq)]))[-1].argmax()))
    assert tokens == seq[len(prompt):]
