"""GPU: LoRA adapters on the CUDA kernels at Qwen3.5-9B's layer shapes (``rl_lora_9b``'s model at 4 layers: 3 GDN + 1
gated attention, hidden 4096, MLP 12288), bf16.

The adapters add GEMMs with a dimension of the rank (``A``: N = r; ``B``: K = r), far below the tiles the BI GEMM was
tuned for. Checked: in batch-invariant mode a sequence's logprobs alone equal its logprobs packed with others, bit
for bit (what the generator/trainer parity rests on), at ranks 8 and 16 on all 12 projections with a non-zero B;
the adapters move the logprobs; a backward gives finite gradients on the adapters alone.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_lora_cuda.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from titan_rl_ext.configs.rl_lora import lora_9b_shape
    from titan_rl_ext.tools.make_tiny import make_tiny

    shape = {**lora_9b_shape(), "num_hidden_layers": 4}
    return str(make_tiny("qwen3_5", tmp_path_factory.mktemp("lora9b4"), seed=0, device="cuda", dtype=torch.bfloat16,
                         noise=0.0, **shape))


@pytest.mark.parametrize("rank", [8, 16])
def test_lora_bi_alone_equals_packed_and_trains_adapters_only(model_dir: str, rank: int) -> None:
    from titan_rl_ext.kernels.batch_invariant import batch_invariant
    from titan_rl_ext.models.common.batch import SeqBatch
    from titan_rl_ext.models.common.lora import HYBRID_TARGETS, LoRAConfig, is_lora_param, lora_modules
    from titan_rl_ext.models.hf import load_hf_model

    cfg = LoRAConfig(rank=rank, alpha=2.0 * rank, targets=HYBRID_TARGETS)
    model, _ = load_hf_model(model_dir, dtype=torch.bfloat16, device="cuda", lora=cfg)
    base, _ = load_hf_model(model_dir, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g, device="cuda") * 0.02)
    lengths = [37, 5, 130, 64, 1]
    tokens = torch.randint(3, model.config.vocab_size, (sum(lengths),), generator=g, device="cuda")
    targets = torch.roll(tokens, -1)
    with batch_invariant(True), torch.no_grad():
        packed = model.packed_token_logprobs(tokens, SeqBatch.from_lengths(lengths, device="cuda"), targets)
        without = base.packed_token_logprobs(tokens, SeqBatch.from_lengths(lengths, device="cuda"), targets)
        start = 0
        for n, p in zip(lengths, packed.split(lengths)):
            alone = model.packed_token_logprobs(tokens[start:start + n], SeqBatch.from_lengths([n], device="cuda"),
                                                targets[start:start + n])
            start += n
            assert torch.equal(alone, p), (rank, n, (alone - p).abs().max())
    ok = ~packed.isnan()
    assert (packed[ok] - without[ok]).abs().max() > 1e-3, "the adapters do not move the logprobs"
    with batch_invariant(True):
        lp = model.packed_token_logprobs(tokens, SeqBatch.from_lengths(lengths, device="cuda"), targets)
        (-lp[~lp.isnan()].mean()).backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == is_lora_param(name), name
        assert p.grad is None or bool(torch.isfinite(p.grad).all()), name
    assert any(p.grad.abs().max() > 0 for n, p in model.named_parameters() if n.endswith("lora_A"))
