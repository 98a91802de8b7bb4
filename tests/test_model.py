"""Model-level properties: packing, dtype rules, torch-only imports, flavors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from titan_rl_ext.models.common.batch import SeqBatch
from titan_rl_ext.models.hf import load_hf_model


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "qwen3_5_moe"])
@torch.no_grad()
def test_packed_equals_one_by_one(tiny_ckpt, arch: str) -> None:
    # fp32 tolerance 2e-5: CPU GEMM blocking depends on the number of rows, so packing changes the
    # low bits; bitwise packing invariance is what batch-invariant mode adds.
    model, _ = load_hf_model(tiny_ckpt(arch))
    g = torch.Generator().manual_seed(0)
    lens = [3, 31, 1, 66]
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in lens]
    packed = model(torch.cat(seqs), SeqBatch.from_lengths(lens)).split(lens)
    for s, p in zip(seqs, packed):
        torch.testing.assert_close(p, model(s), atol=2e-5, rtol=0)
    # [B, S] input is B independent sequences
    batch = torch.stack([seqs[1][:20], seqs[3][:20]])
    out = model(batch)
    assert out.shape == (2, 20, model.config.vocab_size)
    torch.testing.assert_close(out[1], model(seqs[3][:20]), atol=2e-5, rtol=0)


def test_a_log_stays_fp32_under_bf16(tiny_ckpt) -> None:
    model, _ = load_hf_model(tiny_ckpt("qwen3_5"), dtype=torch.bfloat16)
    gdn = [layer.linear_attn for layer in model.layers if layer.layer_type == "linear_attention"]
    assert gdn and all(m.A_log.dtype == torch.float32 for m in gdn)
    assert all(m.in_proj.weight.dtype == torch.bfloat16 for m in gdn)
    ref, _ = load_hf_model(tiny_ckpt("qwen3_5"))
    assert torch.equal(gdn[0].A_log, ref.layers[0].linear_attn.A_log)  # not rounded through bf16
    states = model.init_states(2)
    ssm = [s.ssm for s in states if hasattr(s, "ssm")]
    assert ssm and all(t.dtype == torch.float32 for t in ssm)
    out = model(torch.tensor([[5, 6, 7]]))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_model_modules_import_with_torch_alone() -> None:
    """The model code must run where only torch exists (the lent GPU has no torchtitan)."""
    code = r"""
import sys, importlib.abc
BLOCKED = {"vllm", "torchtitan", "fla", "triton", "transformers", "tokenizers", "safetensors"}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked heavy import: {name}")
sys.meta_path.insert(0, Block())
import torch
from titan_rl_ext.models.qwen3_5.model import Qwen3_5Config
from titan_rl_ext.models.qwen3.model import Qwen3Config
from titan_rl_ext.models.flavors import FLAVORS
m = FLAVORS["qwen3_5-debug"].build()
m.init_weights()
print(m(torch.tensor([[1, 2, 3]])).shape)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "torch.Size([1, 3," in r.stdout


def test_real_flavors_have_published_dimensions() -> None:
    from titan_rl_ext.models.flavors import FLAVORS

    with torch.device("meta"):
        m9 = FLAVORS["qwen3_5-9b"].build()
        m35 = FLAVORS["qwen3_5-35b-a3b"].build()
    n9 = sum(p.numel() for p in m9.parameters())
    n35 = sum(p.numel() for p in m35.parameters())
    assert 8.5e9 < n9 < 10e9, n9  # text part of Qwen3.5-9B
    assert 33e9 < n35 < 36e9, n35  # text part of Qwen3.5-35B-A3B
    assert [m9.layers[i].layer_type for i in range(4)] == ["linear_attention"] * 3 + ["full_attention"]


def test_hf_init_checkpoint_has_no_singular_padding_row(tmp_path) -> None:
    """make_tiny(noise=0) keeps HF's initialisation but redraws the zeroed padding row: a zero embedding row is
    singular under the first RMSNorm (gradient ~ 1/sqrt(eps)), so one pad token in a batch multiplied the
    gradient norm by ~440 here (and gave the GPU recipe's first RL step a norm of ~2e7)."""
    from titan_rl_ext.models.common.batch import SeqBatch
    from titan_rl_ext.models.hf import load_hf_model
    from titan_rl_ext.rl.logprobs import token_logprobs
    from titan_rl_ext.tools.make_tiny import make_tiny

    model, _ = load_hf_model(make_tiny("qwen3_5", tmp_path, seed=0, layout="text", noise=0.0), dtype=torch.float32)
    assert bool((model.tok_embeddings.weight.norm(dim=1) > 0).all())

    def grad_norm(tokens_T: torch.Tensor) -> float:
        model.zero_grad(set_to_none=True)
        lp_T = token_logprobs(model, tokens_T, SeqBatch.from_lengths([tokens_T.numel()]))
        (-lp_T[~lp_T.isnan()].mean()).backward()
        return float(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]).norm())

    without_pad = grad_norm(torch.arange(1, 41))
    with_pad = grad_norm(torch.cat([torch.arange(1, 20), torch.tensor([0]), torch.arange(20, 40)]))
    # one token of 40 changed: the norms agree within 2x unless that token's row is singular (then ~440x)
    assert with_pad < 2 * without_pad, (with_pad, without_pad)


def test_rows_to_next_tokens_shifts_within_sequences() -> None:
    """Row t scores the token after it; each position takes its predecessor's row within its own sequence, and a
    sequence's first token (also after an empty sequence) gets NaN."""
    from titan_rl_ext.models.common.batch import SeqBatch

    rows = torch.arange(7, dtype=torch.float32) + 10
    got = SeqBatch.from_lengths([3, 0, 4]).rows_to_next_tokens(rows)
    want = torch.tensor([float("nan"), 10, 11, float("nan"), 13, 14, 15])
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])
    assert SeqBatch.from_lengths([]).rows_to_next_tokens(torch.zeros(0)).shape == (0,)
