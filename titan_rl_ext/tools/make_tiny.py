"""Write a tiny random HF checkpoint (config.json + safetensors) and an offline-built tokenizer.

    python -m titan_rl_ext.tools.make_tiny --arch {qwen3,qwen3_moe,qwen3_5,qwen3_5_moe} --out DIR [--seed S]
        [--layout {vlm,text}] [--tie] [--shape {tiny,qwen3_5-9b,qwen3_5-rl-1b,qwen3_5-35b-a3b} --layers N
         --experts E --dtype bfloat16 --device cuda --noise 0]

Qwen3.5 checkpoints default to the multimodal layout (``*ForConditionalGeneration``, keys under
``model.language_model.``) because that is how Qwen publishes them; ``--layout text`` writes the
``*ForCausalLM`` layout. Every parameter, norms and GDN decay parameters included, gets random noise
on top of HF's initialisation, so a checkpoint exercises every weight (an all-zero norm weight would
hide a wrong ``1 + w`` convention).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from titan_rl_ext.tools.tiny_tokenizer import save_tokenizer

ARCHS = ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe")
VOCAB = 512
# head dims are 32: the smallest vLLM's CPU attention backend supports, so every tiny checkpoint serves

_QWEN3_5_TEXT: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    full_attention_interval=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    eos_token_id=2,
    pad_token_id=0,
)
_MOE: dict[str, Any] = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
_VISION: dict[str, Any] = dict(
    depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
    patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
)


# Real layer shapes (few layers) for GPU parity and throughput runs: ``--shape qwen3_5-9b --layers 4``.
_ROPE_REAL: dict[str, Any] = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                              "mrope_section": [11, 11, 10], "mrope_interleaved": True}
# What the published Qwen3.5 configs carry beyond the layer shapes: their context (the tiny default, 4096, stops
# vLLM there) and the GDN state's dtype, which vLLM's native class reads into its state cache (without it the
# native engine keeps a bf16 state: half the state traffic of the published model, and another model's numbers).
_PUBLISHED = dict(max_position_embeddings=262_144, mamba_ssm_dtype="float32")
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},
    # Qwen/Qwen3.5-9B text: hidden 4096, MLP 12288, 16 q / 4 kv heads of 256, GDN 16 key / 32 value heads of 128
    "qwen3_5-9b": dict(
        vocab_size=248_320, hidden_size=4096, intermediate_size=12288, num_attention_heads=16, num_key_value_heads=4,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, full_attention_interval=4, rope_parameters=_ROPE_REAL,
        **_PUBLISHED,
    ),
    # The one-GPU RL recipe's model (``rl_gpu_hybrid``): Qwen3.5-9B's head shapes (16 q / 4 kv heads of 256, GDN
    # 16 key / 32 value heads of 128), hidden 2048, 12 layers (9 GDN + 3 attention), the tiny tokenizer's
    # vocabulary: ~0.84 B parameters, small enough for fp32 master weights, AdamW and a vLLM generator on one GPU
    "qwen3_5-rl-1b": dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=12, num_attention_heads=16,
        num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, full_attention_interval=4, rope_parameters=_ROPE_REAL,
    ),
    # Qwen/Qwen3.5-35B-A3B text: hidden 2048, 16 q / 2 kv heads, 256 experts top-8 (expert and shared MLP 512)
    "qwen3_5-35b-a3b": dict(
        vocab_size=248_320, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        full_attention_interval=4, rope_parameters=_ROPE_REAL, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, **_PUBLISHED,
    ),
}


def build_hf_model(arch: str, layout: str = "vlm", tie: bool = False, **text_overrides: Any) -> torch.nn.Module:
    """A random HF model of the given tiny architecture (fp32). ``text_overrides`` change text-config fields."""
    import transformers as tf

    if arch in ("qwen3", "qwen3_moe"):
        kw: dict[str, Any] = dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
            max_position_embeddings=4096, tie_word_embeddings=tie, eos_token_id=2, pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        )
        if arch == "qwen3_moe":
            kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
        kw.update(text_overrides)
        cls_cfg, cls_model = (
            (tf.Qwen3Config, tf.Qwen3ForCausalLM) if arch == "qwen3" else (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM)
        )
        return cls_model(cls_cfg(**kw))

    moe = arch == "qwen3_5_moe"
    text = dict(_QWEN3_5_TEXT)
    if moe:
        text.update(_MOE, shared_expert_intermediate_size=48)
        text.pop("intermediate_size")
    text.update(text_overrides)
    if layout == "text":
        text["tie_word_embeddings"] = tie
        cfg = (tf.Qwen3_5MoeTextConfig if moe else tf.Qwen3_5TextConfig)(**text)
        return (tf.Qwen3_5MoeForCausalLM if moe else tf.Qwen3_5ForCausalLM)(cfg)
    if layout != "vlm":
        raise ValueError(f"layout must be 'vlm' or 'text', got {layout!r}")
    vision = dict(_VISION, out_hidden_size=text["hidden_size"])
    cfg = (tf.Qwen3_5MoeConfig if moe else tf.Qwen3_5Config)(
        text_config=text, vision_config=vision, tie_word_embeddings=tie,
    )
    return (tf.Qwen3_5MoeForConditionalGeneration if moe else tf.Qwen3_5ForConditionalGeneration)(cfg)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int, scale: float = 0.1) -> None:
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype, device=device) * scale)


@torch.no_grad()
def redraw_padding_rows_(model: torch.nn.Module, seed: int) -> None:
    """HF's initialisation zeroes an embedding's padding row. Packed batches never need it zero, and a zero row
    is singular under the first RMSNorm (its gradient scales as 1/sqrt(eps)): one sampled pad token gave the
    GPU recipe's first RL step a gradient norm orders of magnitude above the later steps' (docs/gpu_runs.md
    §9, the step-1 gradient norm explained). Drawn as
    the other rows are, N(0, initializer_range)."""
    std = float(getattr(model.config.get_text_config(), "initializer_range", 0.02))
    g = torch.Generator(device="cpu").manual_seed(seed)
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
            row = torch.randn(module.embedding_dim, generator=g) * std
            module.weight[module.padding_idx].copy_(row.to(module.weight))


def make_tiny(arch: str, out: str | Path, seed: int = 0, layout: str = "vlm", tie: bool = False,
              dtype: torch.dtype = torch.float32, device: str = "cpu", noise: float = 0.1, **text_overrides: Any) -> Path:
    """``dtype``/``device``: build (and save) in bf16 on a GPU for the real-shape checkpoints, which take
    minutes to initialise on CPU. ``noise``: the std of the noise added to every parameter (0: HF's own
    initialisation, for a model that is to be trained rather than compared)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")
    torch.manual_seed(seed)
    with torch.device(device):
        model = build_hf_model(arch, layout=layout, tie=tie, **text_overrides)
    if noise:
        randomize_(model, seed, noise)
    else:
        redraw_padding_rows_(model, seed)
    model.to(dtype)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    save_tokenizer(out, VOCAB)
    gen = {"eos_token_id": 2, "pad_token_id": 0, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", required=True, choices=ARCHS)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layout", choices=("vlm", "text"), default="vlm", help="Qwen3.5 only")
    ap.add_argument("--tie", action="store_true", help="tie input and output embeddings")
    ap.add_argument("--shape", choices=list(SHAPES), default="tiny", help="Qwen3.5 only: real layer shapes")
    ap.add_argument("--layers", type=int, default=None, help="number of layers (default: 4, or 3 for Qwen3)")
    ap.add_argument("--experts", type=int, default=None, help="MoE: number of experts (fewer to save memory)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--device", default="cpu", help="where to initialise (cuda is much faster for real shapes)")
    ap.add_argument("--noise", type=float, default=0.1, help="std of the noise added to every parameter (0: HF init)")
    ap.add_argument("--max-position-embeddings", type=int, default=None,
                    help="the longest context vLLM will serve (default: the published config's for --shape, else 4096)")
    args = ap.parse_args(argv)
    over = dict(SHAPES[args.shape])
    if args.shape != "tiny" and not args.arch.startswith("qwen3_5"):
        ap.error("--shape is for the qwen3_5 archs")
    if args.shape != "tiny" and (args.arch == "qwen3_5_moe") != (args.shape == "qwen3_5-35b-a3b"):
        ap.error(f"--shape {args.shape} does not match --arch {args.arch}")
    if args.layers is not None:
        over["num_hidden_layers"] = args.layers
    if args.experts is not None:
        over["num_experts"] = args.experts
    if args.max_position_embeddings is not None:
        over["max_position_embeddings"] = args.max_position_embeddings
    path = make_tiny(args.arch, args.out, args.seed, args.layout, args.tie, dtype=getattr(torch, args.dtype),
                     device=args.device, noise=args.noise, **over)
    print(f"wrote {args.arch} checkpoint to {path}")


if __name__ == "__main__":
    main()
