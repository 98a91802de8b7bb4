"""LoRA in the titan model (issue 44, first slice): PEFT format in and out, batch invariance, refusals.

PEFT parity tolerance is the HF-parity one (``test_hf_parity``, 1e-4): both sides compute in fp32 but sum in
different orders (chunked gated delta rule and SDPA vs transformers' eager layers, merged vs split
projections); an adapter adds two small GEMMs per projection, not a new source of error.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from titan_rl_ext.kernels.batch_invariant import batch_invariant
from titan_rl_ext.models.common.batch import SeqBatch
from titan_rl_ext.models.common.lora import TARGETS, LoRAConfig, LoRAConfigError, lora_modules
from titan_rl_ext.models.hf import load_hf_model
from titan_rl_ext.models.peft_adapter import CONFIG_NAME, WEIGHTS_NAME, load_peft_adapter, save_peft_adapter

TOL = 1e-4
ALL = LoRAConfig(rank=4, alpha=8.0, targets=tuple(TARGETS))
ATTN_MLP = LoRAConfig(rank=2, alpha=3.0, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"))
CASES = {"qwen3_5-vlm": ("qwen3_5", "vlm", ALL), "qwen3-text": ("qwen3", "text", ATTN_MLP)}


@torch.no_grad()
def _randomise(model: torch.nn.Module, seed: int = 0) -> None:
    """Non-zero B (a fresh adapter is the identity), at a size that moves the logits well past the tolerance."""
    g = torch.Generator().manual_seed(seed)
    for m in lora_modules(model).values():
        m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=g) * 0.05)
        m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.05)


def _seqs(vocab: int, lengths: tuple[int, ...] = (7, 19, 33)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("case", list(CASES))
def test_exported_adapter_loads_in_peft_with_the_same_logits(tiny_ckpt, tmp_path: Path, case: str) -> None:
    pytest.importorskip("peft")
    from peft import PeftModel

    from titan_rl_ext.tools.check_hf import load_transformers_model

    arch, layout, cfg = CASES[case]
    ckpt = tiny_ckpt(arch, layout=layout)
    titan, hf_adapter = load_hf_model(ckpt, lora=cfg)
    _randomise(titan)
    out = save_peft_adapter(titan, hf_adapter, tmp_path / "adapter", base_model_name_or_path=str(ckpt))
    assert {p.name for p in out.iterdir()} == {CONFIG_NAME, WEIGHTS_NAME}

    hf = load_transformers_model(ckpt)
    seqs = _seqs(titan.config.vocab_size)
    with torch.no_grad():
        base = [hf(input_ids=s[None], use_cache=False).logits[0] for s in seqs]
        peft_model = PeftModel.from_pretrained(hf, str(out)).eval()
        # every titan adapter became a PEFT LoRA layer (a key PEFT did not match would be left at B = 0)
        n_lora = sum(1 for n, _ in peft_model.named_parameters() if ".lora_B." in n)
        assert n_lora == len(lora_modules(titan))
        ref = [peft_model(input_ids=s[None], use_cache=False).logits[0] for s in seqs]
        lens = [s.numel() for s in seqs]
        ours = titan(torch.cat(seqs), SeqBatch.from_lengths(lens)).split(lens)
    moved = max((r - b).abs().max().item() for r, b in zip(ref, base))
    diff = max((a - r).abs().max().item() for a, r in zip(ours, ref))
    assert moved > 100 * TOL, f"the adapter barely changes the logits ({moved:.2e}): the check would prove nothing"
    print(f"{case}: adapter moved the logits {moved:.2e}, titan vs PEFT {diff:.2e}")
    assert diff <= TOL, f"titan+LoRA vs PEFT: max |logit diff| {diff:.3e} > {TOL} (adapter moved the logits {moved:.2e})"

    # and back in: a fresh LoRA model given the file computes the same bits
    again, _ = load_hf_model(ckpt, lora=cfg)
    load_peft_adapter(again, hf_adapter, out)
    with torch.no_grad():
        assert torch.equal(again(torch.cat(seqs), SeqBatch.from_lengths(lens)), torch.cat(list(ours)))


def test_lora_logprobs_bit_identical_alone_or_packed_in_bi_mode(tiny_ckpt) -> None:
    model, _ = load_hf_model(tiny_ckpt("qwen3_5"), lora=ALL)
    _randomise(model, seed=3)
    seqs = _seqs(model.config.vocab_size, (23, 5, 40, 11))
    tokens = torch.cat(seqs)
    targets = torch.roll(tokens, -1)
    lens = [s.numel() for s in seqs]
    with batch_invariant(True), torch.no_grad():
        packed = model.packed_token_logprobs(tokens, SeqBatch.from_lengths(lens), targets).split(lens)
        start = 0
        for s, p in zip(seqs, packed):
            alone = model.packed_token_logprobs(s, SeqBatch.from_lengths([s.numel()]), targets[start : start + s.numel()])
            start += s.numel()
            assert torch.equal(alone, p)


def test_fresh_adapter_is_the_base_model_and_only_adapters_train(tiny_ckpt) -> None:
    ckpt = tiny_ckpt("qwen3_5")
    base, _ = load_hf_model(ckpt)
    model, _ = load_hf_model(ckpt, lora=ALL)
    seq = _seqs(base.config.vocab_size, (17,))[0]
    with torch.no_grad():
        assert torch.equal(model(seq), base(seq))  # B = 0: the adapter adds exact zeros
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora." in n for n in trainable)
    assert len(trainable) == 2 * len(lora_modules(model))
    model(seq).logsumexp(-1).sum().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
    # B starts at zero, so A's first gradient is zero too; B's is not
    assert any(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n.endswith("lora_B"))


@pytest.mark.parametrize(
    "make,arch,needle",
    [
        (lambda: LoRAConfig(rank=4, alpha=8, targets=("qkv",)), None, "unsupported LoRA target"),
        (lambda: LoRAConfig(rank=4, alpha=8, targets=("q_proj",), dropout=0.05), None, "dropout"),
        (lambda: LoRAConfig(rank=0, alpha=8, targets=("q_proj",)), None, "rank"),
        (lambda: LoRAConfig(rank=-2, alpha=8, targets=("q_proj",)), None, "rank"),
        (lambda: LoRAConfig(rank=4, alpha=8, targets=("q_proj", "in_proj_z")), "qwen3", "do not exist"),
        (lambda: LoRAConfig(rank=4, alpha=8, targets=("up_proj",)), "qwen3_5_moe", "MoE"),
    ],
    ids=["unknown-target", "dropout", "rank-0", "rank-negative", "gdn-on-qwen3", "mlp-on-moe"],
)
def test_refused_at_build_time(tiny_ckpt, make: Callable[[], LoRAConfig], arch: str | None, needle: str) -> None:
    with pytest.raises(LoRAConfigError, match=needle):
        cfg = make()
        assert arch is not None, "a config error must be raised by the config itself"
        load_hf_model(tiny_ckpt(arch, layout="text"), lora=cfg)


def test_refuses_an_adapter_config_it_would_compute_differently() -> None:
    import json

    from titan_rl_ext.models.peft_adapter import from_peft_config, to_peft_config

    good = to_peft_config(ALL)
    back = from_peft_config(json.loads(json.dumps(good)))
    assert (back.rank, back.alpha, set(back.targets)) == (ALL.rank, ALL.alpha, set(ALL.targets))
    for field, value in [("use_dora", True), ("use_rslora", True), ("bias", "all"), ("lora_dropout", 0.1)]:
        with pytest.raises(LoRAConfigError):
            from_peft_config({**good, field: value})


_FSDP_SCRIPT = r"""
import copy, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from titan_rl_ext.kernels.batch_invariant import set_batch_invariant
from titan_rl_ext.models.common.batch import SeqBatch
from titan_rl_ext.models.common.lora import TARGETS, LoRAConfig, is_lora_param, lora_modules, lora_state_dict
from titan_rl_ext.models.common.precision import compute_view, fp32_param_names
from titan_rl_ext.models.common.titan_protocol import apply_fsdp
from titan_rl_ext.models.hf import load_hf_model

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
cfg = LoRAConfig(rank=4, alpha=8.0, targets=tuple(TARGETS))
master, _ = load_hf_model(sys.argv[1], dtype=torch.float32, lora=cfg)
g = torch.Generator().manual_seed(0)
with torch.no_grad():
    for m in lora_modules(master).values():  # a trained adapter: B off zero
        m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.05)
# the generator: the base checkpoint in bf16 with identity adapters, then the trainer's adapter push
served, _ = load_hf_model(sys.argv[1], dtype=torch.bfloat16, lora=cfg)
apply_fsdp(master, init_device_mesh("cpu", (1,)), torch.bfloat16)  # fp32 master, bf16 compute
full = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in master.state_dict().items()}
push = lora_state_dict(compute_view(full, torch.bfloat16, fp32_param_names(master)))
assert push and all(is_lora_param(k) and v.dtype == torch.bfloat16 for k, v in push.items())
with torch.no_grad():
    for k, v in push.items():
        served.get_parameter(k).copy_(v)

lengths = [7, 12, 5]
tokens = torch.randint(3, 500, (sum(lengths),), generator=g)
targets = torch.randint(3, 500, (sum(lengths),), generator=g)
batch = SeqBatch.from_lengths(lengths)
set_batch_invariant(True)
with torch.no_grad():
    ours = master.packed_token_logprobs(tokens, batch, targets)
    theirs = served.packed_token_logprobs(tokens, batch, targets)
assert torch.equal(ours, theirs), (ours - theirs).abs().max()
set_batch_invariant(False)
# only the adapters train under FSDP: fp32 gradients on them, none on the frozen base
(-master.packed_token_logprobs(tokens, batch, targets).mean()).backward()
for n, p in master.named_parameters():
    assert (p.grad is not None) == is_lora_param(n), n
    assert p.grad is None or p.grad.dtype == torch.float32, n
print("LORA FSDP OK")
dist.destroy_process_group()
"""


def test_lora_under_fsdp_mixed_precision_matches_the_served_bf16_model_and_trains_adapters_only(tiny_ckpt) -> None:
    """The trainer's FSDP2 path (fp32 master, bf16 compute): the pushed adapter on a bf16 server's model gives the
    trainer's logprobs bit for bit under BI, and only the adapters get gradients."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _FSDP_SCRIPT, str(tiny_ckpt("qwen3_5", layout="text"))],
                       capture_output=True, text=True, timeout=300, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "LORA FSDP OK" in out, out[-4000:]
