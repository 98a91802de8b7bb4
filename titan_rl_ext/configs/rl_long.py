"""One GPU, long answers: the regime where generation dominates an RL step (issue 41). ``_gpu_recipe`` on a 1.13 B
hybrid (``long_shape``) warmed up on ``worked_sum``'s reference chains (``long_rl_checkpoint``), 1-4 K-token answers
(``rl_gpu_long``; its CPU toy ``rl_gpu_long_toy``). ``long_memory_split`` estimates what the trainer and the
generator hold on the GPU (docs/training.md has the table); the recipe sets the generator's memory share from it,
and ``rl_lora`` builds its own split on it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from titan_rl_ext.configs.rl_common import _built_and_warmed, _set_arg
from titan_rl_ext.configs.rl_gpu import _gpu_recipe
from titan_rl_ext.paths import cache_dir

LONG_TASK = "worked_sum"
LONG_WARMUP_TARGET = 0.2
# a step bound before the time bound: a lease builds its own checkpoint, and arms on other leases should start
# from the same procedure, not from however far eight minutes got
LONG_WARMUP_STEPS = 200
LONG_MAX_TOKENS = 4608  # the longest reference chain (~4.2 K tokens) and room to go wrong
LONG_MAX_MODEL_LEN = 6144  # the longest prompt (~0.8 K tokens) + LONG_MAX_TOKENS fits
LONG_OFFPOLICY = 4  # the other window: --rl.offpolicy 12 --rl.stale-gap-versions 13
GIB = 2**30


def long_shape() -> dict[str, Any]:
    """The long recipe's model: Qwen3.5-9B's head shapes (16 q / 4 kv heads of 256; GDN 16 key / 32 value heads
    of 128), hidden 2048, MLP 6144, 16 layers (12 GDN + 4 gated attention), the tiny tokenizer's vocabulary; the
    published configs' fp32 GDN state (what vLLM's native class reads for its state cache)."""
    from titan_rl_ext.tools.make_tiny import SHAPES, VOCAB

    return {**SHAPES["qwen3_5-rl-1b"], "num_hidden_layers": 16, "vocab_size": VOCAB, "linear_conv_kernel_dim": 4,
            "max_position_embeddings": LONG_MAX_MODEL_LEN, "mamba_ssm_dtype": "float32"}


def hybrid_param_count(shape: Mapping[str, Any]) -> int:
    """Parameters of the Qwen3.5 text model (untied LM head) of ``shape``, counted from its fields."""
    H, I, V, L = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], shape["num_hidden_layers"]
    n_attn = L // shape["full_attention_interval"]
    hd, nq, nkv = shape["head_dim"], shape["num_attention_heads"], shape["num_key_value_heads"]
    nv, vhd = shape["linear_num_value_heads"], shape["linear_value_head_dim"]
    kd, vd = shape["linear_num_key_heads"] * shape["linear_key_head_dim"], nv * vhd
    conv = (2 * kd + vd) * shape["linear_conv_kernel_dim"]
    # q k v and z projections, b and a, the causal conv, dt_bias and A_log, the gated norm, the output projection
    gdn = H * (2 * kd + vd) + H * vd + 2 * H * nv + conv + 2 * nv + vhd + vd * H
    attn = H * nq * hd * 2 + 2 * H * nkv * hd + nq * hd * H + 2 * hd  # q with its gate, k, v, o; q and k norms
    return (L - n_attn) * gdn + n_attn * attn + L * (3 * H * I + 2 * H) + 2 * V * H + H


def long_memory_split(shape: Mapping[str, Any], *, seqs: int, max_model_len: int, chunk_tokens: int,
                      overhead_gib: float = 3.0) -> dict[str, float]:
    """GiB each part of one GPU holds when the trainer (fp32 master weights, fp32 gradients, AdamW's two fp32
    moments; FSDP's bf16 compute copy, the push's bf16 copy and the stale-gap model's bf16 weights; the activations
    of one loss chunk of ``chunk_tokens``) and a vLLM generator (bf16 weights; the fp32 GDN state and bf16 conv
    state of ``seqs`` sequences; the attention KV of ``seqs`` sequences of ``max_model_len`` tokens, so nothing is
    preempted) share it, each with ``overhead_gib`` of CUDA context, allocator slack and (vLLM) CUDA graphs and
    prefill activations. The activations are an estimate: the bf16 tensors a layer keeps for its backward
    (residual, norms, projections, the GDN's conv and core outputs, SwiGLU) plus the GDN chunk states (fp32, one
    per 64 tokens)."""
    n = hybrid_param_count(shape)
    H, I, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    n_attn = L // shape["full_attention_interval"]
    hd, nq, nkv = shape["head_dim"], shape["num_attention_heads"], shape["num_key_value_heads"]
    nv, khd, vhd = shape["linear_num_value_heads"], shape["linear_key_head_dim"], shape["linear_value_head_dim"]
    kd, vd = shape["linear_num_key_heads"] * khd, nv * vhd
    gdn_act = 2 * (3 * H + 2 * (2 * kd + vd) + 2 * kd + 3 * vd + 3 * I) + nv * khd * vhd * 4 // 64
    attn_act = 2 * (3 * H + 2 * nq * hd + 2 * nkv * hd + 3 * nq * hd + 3 * I)
    state = nv * khd * vhd * 4 + (2 * kd + vd) * (shape["linear_conv_kernel_dim"] - 1) * 2
    split = {
        "trainer/params_fp32": 4 * n / GIB,
        "trainer/grads_fp32": 4 * n / GIB,
        "trainer/adam_fp32": 8 * n / GIB,
        "trainer/bf16_copies": 3 * 2 * n / GIB,
        "trainer/activations": chunk_tokens * ((L - n_attn) * gdn_act + n_attn * attn_act) / GIB,
        "trainer/overhead": overhead_gib,
        "generator/weights_bf16": 2 * n / GIB,
        "generator/gdn_state": seqs * (L - n_attn) * state / GIB,
        "generator/kv_cache": seqs * max_model_len * n_attn * 2 * nkv * hd * 2 / GIB,
        "generator/overhead": overhead_gib,
    }
    for side in ("trainer", "generator"):
        split[side] = sum(v for k, v in split.items() if k.startswith(side + "/"))
    split["total"] = split["trainer"] + split["generator"]
    split["params_b"] = n / 1e9
    return split


def long_rl_checkpoint(toy: bool = False, verbose: bool = True) -> str:
    """The long recipe's start (built once, cached): ``long_shape()`` (1.13 B parameters, HF's own
    initialisation, the VLM layout), after the supervised warm-up on ``worked_sum``'s reference chains
    (``rl.chain_warmup``) up to an expected reward of 0.2, 200 steps or eight minutes, on the GPU when there is one.
    ``toy``: the tiny shape on ``worked_sum_short``, for the CPU run of the same recipe."""
    from titan_rl_ext.rl.chain_warmup import chain_warmup

    name, task = ("rl_long_toy", "worked_sum_short") if toy else ("rl_long_qwen3_5_1b", LONG_TASK)
    return _built_and_warmed(
        name, {} if toy else long_shape(), toy, f"{name}_{task}_{int(LONG_WARMUP_TARGET * 100)}",
        lambda init, out, device: chain_warmup(init, out, task=task, target=LONG_WARMUP_TARGET,
                                               lr=1e-3 if toy else 3e-4, batch_size=32 if toy else 8,
                                               max_steps=LONG_WARMUP_STEPS, max_seconds=120 if toy else 480,
                                               device=device, verbose=verbose))



def _long_recipe(toy: bool) -> Any:
    """``_gpu_recipe`` on long answers: ``long_shape()`` warmed up on ``worked_sum`` (``worked_sum_short`` for the
    toy), 32 prompts x G=8 (4 x 8 for the toy) with every group of a step generating at once, up to
    ``LONG_MAX_TOKENS`` new tokens, off-policy window ``LONG_OFFPOLICY`` with every version's weights kept for the
    exact stale gap (kept on the CPU: whether they fit ``auto``'s quarter of the GPU's free memory depends on the
    card, and the memory split counts none on the GPU), DAPO, loss chunks of one longest sample, the generator's
    memory share from ``long_memory_split``, 30 steps. No per-request sampling seeds (vLLM samples seeded requests one by one), no
    rollouts file (~6 MB of token ids a step, written on the trainer's clock)."""
    import torch

    cfg = _gpu_recipe(toy, hf_dir=long_rl_checkpoint(toy))
    rl = cfg.rl
    seqs = rl.prompts_per_step * rl.group_size
    server = _set_arg(rl.server_args, "--max-model-len", str(512 if toy else LONG_MAX_MODEL_LEN))
    if torch.cuda.is_available() and not toy:
        split = long_memory_split(long_shape(), seqs=seqs, max_model_len=LONG_MAX_MODEL_LEN,
                                  chunk_tokens=LONG_MAX_MODEL_LEN)
        share = math.ceil(100 * split["generator"] * GIB / torch.cuda.get_device_properties(0).total_memory) / 100
        server = _set_arg(_set_arg(server, "--gpu-memory-utilization", f"{share:.2f}"), "--max-num-seqs", str(seqs))
    cfg.rl = dataclasses.replace(
        rl, task="worked_sum_short" if toy else LONG_TASK, max_tokens=192 if toy else LONG_MAX_TOKENS,
        server_args=server, num_producers=rl.prompts_per_step, offpolicy=LONG_OFFPOLICY, stale_gap_versions=LONG_OFFPOLICY + 1,
        stale_gap_device="cpu", loss_chunk_tokens=0 if toy else LONG_MAX_MODEL_LEN, seeded_sampling=False,
        log_rollouts=False)
    cfg.training.steps = 3 if toy else 30
    cfg.dump_folder = str(cache_dir() / "outputs" / ("rl_long_toy" if toy else "rl_long"))
    return cfg


def rl_gpu_long() -> Any:
    """One GPU (80 GB class), long answers: the 1.13 B Qwen3.5 hybrid writing 1-4 K-token worked sums, 32
    prompts x G=8, window 4 (``--rl.offpolicy 12 --rl.stale-gap-versions 13`` for 12), 30 steps
    (``tests/gpu/run_rl_e2e.sh long_*`` runs the three arms)."""
    return _long_recipe(toy=False)


def rl_gpu_long_toy() -> Any:
    """The same recipe at toy size on CPU: the tiny Qwen3.5 on ``worked_sum_short``, 4 prompts x G=8, 3 steps. It
    checks the path, not learning: on a CPU its two-minute warm-up leaves the chains wrong."""
    return _long_recipe(toy=True)
