"""LoRA RL (issue 44): adapters trained, the base frozen, adapter-only pushes, batch invariant on both sides.
``rl_lora_toy`` on CPU starts from the demo's warmed-up tiny model; ``rl_lora_9b`` on one GPU is ``_gpu_recipe`` on
Qwen3.5-9B's full-depth shape (``lora_9b_checkpoint``: LoRA warm-up merged into a random base), with its memory
split (``lora_memory_split``, built on ``rl_long``'s) and the warm-up's (``lora_warmup_memory``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from titan_rl_ext.configs.rl_common import _rl_trainer, _set_arg, _tiny_rl_config, model_spec_from_hf
from titan_rl_ext.configs.rl_demo import DEMO_TASK, demo_rl_checkpoint
from titan_rl_ext.configs.rl_gpu import _gpu_recipe
from titan_rl_ext.configs.rl_long import GIB, hybrid_param_count, long_memory_split
from titan_rl_ext.models.common.lora import HYBRID_TARGETS
from titan_rl_ext.paths import cache_dir


def rl_lora_toy() -> Any:
    """LoRA RL on CPU: the demo's warmed-up tiny Qwen3.5 (``demo_rl_checkpoint``: its copy-task answers are right
    often enough that groups differ in reward, so the adapters get gradients), rank-8 adapters (alpha 16) on every
    projection, base frozen, adapter-only pushes, ``synthetic_copy``, 4 prompts x G=8, off-policy window 2 with every
    version kept for the exact stale gap, DAPO, batch invariant on both sides, 6 steps, the adapter exported in PEFT's
    format. The CPU twin of ``rl_lora_9b`` (``tests/test_rl_lora.py`` runs it)."""
    hf_dir = demo_rl_checkpoint(verbose=False)
    dump = cache_dir() / "outputs" / "rl_lora_toy"
    rl = _tiny_rl_config(hf_dir, task=f"synthetic_{DEMO_TASK}", stale_gap_versions=3, lora_rank=8, lora_alpha=16.0,
                         lora_targets=list(HYBRID_TARGETS), export_adapter_dir=str(dump / "adapter"))
    return _rl_trainer(model_spec_from_hf(hf_dir), hf_dir, rl, steps=6, lr=1e-2, warmup=1, batch_invariant=True,
                       dump=str(dump), checkpoint_interval=10)


LORA_9B_RANK = 16
LORA_9B_MAX_MODEL_LEN = 1024


def lora_9b_shape() -> dict[str, Any]:
    """Qwen3.5-9B's text model at full depth (hidden 4096, MLP 12288, 32 layers: 24 GDN + 8 gated attention, its
    head shapes) with the tiny tokenizer's vocabulary (a random model's samples must decode)."""
    from titan_rl_ext.tools.make_tiny import SHAPES, VOCAB

    return {**SHAPES["qwen3_5-9b"], "num_hidden_layers": 32, "vocab_size": VOCAB, "linear_conv_kernel_dim": 4}


def lora_param_count(shape: Mapping[str, Any], rank: int, targets: tuple[str, ...]) -> int:
    """Adapter parameters (``r * (in + out)`` per adapted projection and layer) of a Qwen3.5 hybrid of ``shape``."""
    H, I, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    n_attn = L // shape["full_attention_interval"]
    hd, nq, nkv = shape["head_dim"], shape["num_attention_heads"], shape["num_key_value_heads"]
    nv = shape["linear_num_value_heads"]
    kd, vd = shape["linear_num_key_heads"] * shape["linear_key_head_dim"], nv * shape["linear_value_head_dim"]
    attn = {"q_proj": (H, 2 * nq * hd), "k_proj": (H, nkv * hd), "v_proj": (H, nkv * hd), "o_proj": (nq * hd, H)}
    gdn = {"in_proj_qkv": (H, 2 * kd + vd), "in_proj_z": (H, vd), "in_proj_b": (H, nv), "in_proj_a": (H, nv),
           "out_proj": (vd, H)}
    mlp = {"gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}
    per = lambda table: sum(rank * (i + o) for t, (i, o) in table.items() if t in targets)  # noqa: E731
    return n_attn * per(attn) + (L - n_attn) * per(gdn) + L * per(mlp)


def lora_memory_split(shape: Mapping[str, Any], *, rank: int, targets: tuple[str, ...], seqs: int, max_model_len: int,
                      chunk_tokens: int, stale_versions: int, overhead_gib: float = 3.0) -> dict[str, float]:
    """GiB each part of one GPU holds in ``rl_lora_9b``: ``long_memory_split``'s generator, and a trainer whose base is
    frozen bf16 (no master copy, gradients or optimizer state), whose adapters are bf16 with AdamW's two moments and
    gradients, which keeps the stale-gap model (bf16, built on the GPU; the kept versions themselves on the host) and
    the activations of one loss chunk (the backward still runs through every frozen layer)."""
    split = long_memory_split(shape, seqs=seqs, max_model_len=max_model_len, chunk_tokens=chunk_tokens,
                              overhead_gib=overhead_gib)
    n, a = hybrid_param_count(shape), lora_param_count(shape, rank, targets)
    for k in ("trainer/params_fp32", "trainer/grads_fp32", "trainer/adam_fp32", "trainer/bf16_copies"):
        del split[k]
    split.update({"trainer/base_bf16": 2 * n / GIB, "trainer/adapters_bf16_grads_adam": 4 * 2 * a / GIB,
                  "trainer/stale_gap_model_bf16": (2 * (n + a) / GIB) if stale_versions else 0.0,
                  # the base kept once, each version's adapters on their own (``StaleGap`` with ``lora``)
                  "host/stale_gap_versions_bf16": (2 * n + stale_versions * 2 * a) / GIB if stale_versions else 0.0})
    split["trainer"] = sum(v for k, v in split.items() if k.startswith("trainer/"))
    split["total"] = split["trainer"] + split["generator"]
    split["adapter_params_m"] = a / 1e6
    return split


LORA_9B_WARMUP_TARGET = 0.2
# Adam moves a LoRA model's output by roughly lr x hidden size a step: on CPU (docs/training.md, "LoRA RL") hidden 512
# at 1e-3 and hidden 1024 at 3e-4 reached the target in 10-15 steps; 1e-4 at hidden 4096 is the same regime
LORA_9B_WARMUP_LR = 1e-4
# steps before seconds, as LONG_WARMUP_STEPS: a lease builds its own checkpoint, and runs on other leases should start
# from the same procedure; the seconds bound the GPU time if the steps were ever far slower than expected
LORA_9B_WARMUP_STEPS = 200
LORA_9B_WARMUP_SECONDS = 300.0


def lora_warmup_memory(shape: Mapping[str, Any], *, rank: int, targets: tuple[str, ...], tokens: int,
                       overhead_gib: float = 3.0) -> dict[str, float]:
    """GiB the LoRA warm-up (``rl.lora_warmup``) holds on the GPU for a model of ``shape``: the frozen base in bf16, the
    adapters in fp32 with their gradients and AdamW's two moments, the activations of ``tokens`` tokens (a batch's;
    ``long_memory_split``'s per-token estimate for titan's model, doubled: transformers' eager path keeps fp32 norm
    inputs, and each adapter keeps its fp32 input) and ``overhead_gib``."""
    n, a = hybrid_param_count(shape), lora_param_count(shape, rank, targets)
    acts = 2 * long_memory_split(shape, seqs=1, max_model_len=1, chunk_tokens=tokens)["trainer/activations"]
    split = {"base_bf16": 2 * n / GIB, "adapters_fp32_grads_adam": 16 * a / GIB, "activations": acts,
             "overhead": overhead_gib}
    split["total"] = sum(split.values())
    return split


def lora_warmed_checkpoint(init: str | Path, name: str, **warm: Any) -> str:
    """``cache_dir()/<name>``: the checkpoint ``init`` after ``rl.lora_warmup.lora_warmup(init, out, **warm)`` (LoRA
    warm-up, adapters merged into the base), built once: a directory holding ``warmup.json`` (written last) is
    reused as it is."""
    out = cache_dir() / name
    if not (out / "warmup.json").exists():
        from titan_rl_ext.rl.lora_warmup import lora_warmup

        lora_warmup(init, out, **warm)
    return str(out)


def lora_9b_checkpoint(warm: bool = True, verbose: bool = True) -> str:
    """``QWEN3_5_9B_DIR`` when it names a checkpoint (the published model), else ``lora_9b_shape()`` with HF's own
    initialisation, bf16, built once on the GPU into ``cache_dir()/rl_lora_9b_init`` (~14 GB), and (``warm``) its LoRA
    warm-up on ``synthetic_copy`` (``lora_warmed_checkpoint``: rank-16 adapters on every projection, the base frozen
    in bf16, up to a 20 % answer rate, ``LORA_9B_WARMUP_STEPS`` steps or ``LORA_9B_WARMUP_SECONDS``, the adapters
    merged into the base) into ``cache_dir()/rl_lora_9b_copy_20_lora`` (~14 GB, built once). A random base never
    answers, so RL would have nothing to reinforce; a full-weight warm-up (AdamW: ~110 GiB) does not fit one GPU."""
    import torch

    from titan_rl_ext.tools.make_tiny import make_tiny

    given = os.environ.get("QWEN3_5_9B_DIR", "")
    if given and (Path(given) / "config.json").exists():
        return given
    device = "cuda" if torch.cuda.is_available() else "cpu"
    d = cache_dir() / "rl_lora_9b_init"
    if not (d / "config.json").exists():
        make_tiny("qwen3_5", d, seed=0, layout="vlm", dtype=torch.bfloat16, device=device, noise=0.0, **lora_9b_shape())
    if not warm:
        return str(d)
    return lora_warmed_checkpoint(
        d, f"rl_lora_9b_{DEMO_TASK}_{int(LORA_9B_WARMUP_TARGET * 100)}_lora", targets=HYBRID_TARGETS,
        kind=DEMO_TASK, target=LORA_9B_WARMUP_TARGET, rank=LORA_9B_RANK, alpha=2.0 * LORA_9B_RANK,
        lr=LORA_9B_WARMUP_LR,
        # one step between checks: at this width a step can move the answer rate by ~0.1-0.4 (the CPU curves)
        eval_every=1, max_steps=LORA_9B_WARMUP_STEPS, max_seconds=LORA_9B_WARMUP_SECONDS, dtype=torch.bfloat16,
        device=device, verbose=verbose)


def rl_lora_9b() -> Any:
    """One GPU (80 GB class): LoRA RL on Qwen3.5-9B's full-depth shape (``lora_9b_checkpoint``: warmed up through
    merged LoRA adapters to a ~20 % answer rate, so the reward has room and signal to rise), fresh rank-16 adapters
    (alpha 32) on every projection, base frozen in bf16, adapter-only pushes over CUDA IPC, trainer and one spawned
    vLLM generator side by side, batch invariant on both sides, ``synthetic_copy``, 16 prompts x G=8, off-policy
    window 2 with every version kept (on the host) for the exact stale gap, DAPO, 30 steps, lr 2e-4; with
    ``QWEN3_5_9B_DIR`` the published model instead (no warm-up).

    Expected memory (``lora_memory_split``; the 9B shape with the tiny vocabulary: 6.92 B base + 43.3 M adapter
    parameters), 60.8 GiB of an 80 GB card: trainer 34.8 GiB = base bf16 12.9 + stale-gap model 13.0 + adapters with
    gradients and AdamW 0.3 + activations of one 1 K-token loss chunk ~5.6 + overhead 3; generator 26.0 GiB = weights
    12.9 + GDN state of 128 sequences 6.1 + KV 4.0 + overhead 3 (its ``--gpu-memory-utilization`` is set from this);
    host: the stale gap's base once and 3 versions' adapters, 13.1 GiB. With the published checkpoint (248 K vocabulary) add ~3.8 GiB per copy of
    the weights (trainer, stale-gap model, generator). The warm-up (first use only) runs while the recipe is built,
    before the trainer's model and the generator exist, and frees the GPU when done: ~21 GiB
    (``lora_warmup_memory``: base bf16 12.9 + fp32 adapters with gradients and AdamW 0.6 + activations of a
    32 x ~12-token batch ~4.2 + overhead 3; ~28 GiB with 1 K-token batches)."""
    import torch

    from titan_rl_ext.rl.losses import loss_config

    hf_dir = lora_9b_checkpoint()
    cfg = _gpu_recipe(toy=False, hf_dir=hf_dir)
    rl = cfg.rl
    prompts, group = 16, 8
    server = _set_arg(rl.server_args, "--max-model-len", str(LORA_9B_MAX_MODEL_LEN))
    if torch.cuda.is_available():
        split = lora_memory_split(lora_9b_shape(), rank=LORA_9B_RANK, targets=HYBRID_TARGETS, seqs=prompts * group,
                                  max_model_len=LORA_9B_MAX_MODEL_LEN, chunk_tokens=LORA_9B_MAX_MODEL_LEN,
                                  stale_versions=3)
        share = math.ceil(100 * split["generator"] * GIB / torch.cuda.get_device_properties(0).total_memory) / 100
        server = _set_arg(_set_arg(server, "--gpu-memory-utilization", f"{share:.2f}"), "--max-num-seqs",
                          str(prompts * group))
    cfg.rl = dataclasses.replace(
        rl, server_args=server, prompts_per_step=prompts, group_size=group, num_producers=prompts, max_tokens=8,
        offpolicy=2, stale_gap_versions=3, stale_gap_device="cpu", loss=loss_config("dapo"),
        batch_invariant_steps=1_000_000, loss_chunk_tokens=LORA_9B_MAX_MODEL_LEN, seeded_sampling=False,
        lora_rank=LORA_9B_RANK, lora_alpha=2.0 * LORA_9B_RANK, lora_targets=list(HYBRID_TARGETS),
        export_adapter_dir=str(cache_dir() / "outputs" / "rl_lora_9b" / "adapter"))
    cfg.model_spec.model.batch_invariant = True
    if torch.cuda.is_available():  # (on a CPU the recipe keeps _gpu_recipe's fp32 server and trainer)
        # bf16 weights, no fp32 master copy: the frozen base never updates, and the adapters' AdamW runs in bf16
        cfg.training.dtype = cfg.training.mixed_precision_param = "bfloat16"
    cfg.training.steps = 30
    # twice LoRA's usual 1e-4: 30 steps must show the reward rise. Adam moves the output by ~lr x hidden a step, so
    # 2e-4 at hidden 4096 (0.8) is the regime of rl_lora_toy's 1e-2 at hidden 64 (0.6) and of the warm-up's 1e-4
    # (0.4, a few steps to the answer rate's 20 %), while it stays above half a bf16 step of the adapters' A entries
    # (|A| <= 1/64: 6e-5), so the bf16 AdamW updates are not rounded away
    for group in cfg.optimizer.param_groups:
        group.optimizer_kwargs["lr"] = 2e-4
    cfg.dump_folder = str(cache_dir() / "outputs" / "rl_lora_9b")
    return cfg
