"""The decoder stack shared by Qwen3 and Qwen3.5: embedding, blocks, final norm, LM head.

Two entry points run the same blocks:
- ``forward(tokens)`` -- the trainer's (and torchtitan's) call: ``[B, S]`` or packed ``[T]`` tokens with
  a ``SeqBatch``; no state, returns logits.
- ``step(tokens, batch, states)`` -- inference: per-layer states (``KVState`` / ``GDNState``) go in and
  the updated states come out, so prefill, split prefill and decode are all the same call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from titan_rl_ext.kernels import batch_invariant as bi
from titan_rl_ext.kernels import ops
from titan_rl_ext.kernels.lm_head import head_logits_fp32, token_logprobs_fused
from titan_rl_ext.models.common.attention import Attention, KVState
from titan_rl_ext.models.common.batch import SeqBatch
from titan_rl_ext.models.common.lora import LoRAConfig, apply_lora
from titan_rl_ext.models.common.mlp import FeedForward
from titan_rl_ext.models.common.moe import MoE, MoEConfig
from titan_rl_ext.models.common.norms import RMSNorm
from titan_rl_ext.models.common.rope import RotaryEmbedding

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

LayerState = Any  # KVState for attention layers, GDNState for linear-attention layers


@dataclass
class DecoderConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    partial_rotary_factor: float = 1.0
    tie_embeddings: bool = False
    attention_bias: bool = False
    # Qwen3.5: sigmoid output gate on attention, zero-centred (1 + w) RMSNorms
    attn_output_gate: bool = False
    zero_centered_norm: bool = False
    layer_types: list[str] = field(default_factory=list)  # empty: all full attention
    moe: MoEConfig | None = None
    init_std: float = 0.02
    # adapters on named projections, base weights frozen (``common.lora``); not part of HF checkpoints
    lora: LoRAConfig | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = [FULL_ATTENTION] * self.n_layers
        if len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.n_layers} layers")
        unknown = sorted(set(self.layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION})
        if unknown:
            raise ValueError(f"unknown layer types {unknown}; expected {FULL_ATTENTION!r} or {LINEAR_ATTENTION!r}")

    def build_mixer(self, layer_idx: int) -> nn.Module:
        if self.layer_types[layer_idx] != FULL_ATTENTION:
            raise ValueError(f"{type(self).__name__} has no {self.layer_types[layer_idx]!r} layers")
        return Attention(
            self.dim, self.n_heads, self.n_kv_heads, self.head_dim, self.norm_eps,
            output_gate=self.attn_output_gate, zero_centered_norm=self.zero_centered_norm, bias=self.attention_bias,
        )

    def build(self) -> Decoder:
        return Decoder(self)


class TransformerBlock(nn.Module):
    def __init__(self, layer_idx: int, cfg: DecoderConfig) -> None:
        super().__init__()
        self.layer_type = cfg.layer_types[layer_idx]
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.zero_centered_norm)
        mixer = cfg.build_mixer(layer_idx)
        if self.layer_type == FULL_ATTENTION:
            self.attention = mixer
        else:
            self.linear_attn = mixer
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.zero_centered_norm)
        if cfg.moe is not None and cfg.moe.is_moe_layer(layer_idx):
            self.moe = MoE(cfg.dim, cfg.moe)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    @property
    def mixer(self) -> nn.Module:
        return self.attention if self.layer_type == FULL_ATTENTION else self.linear_attn

    def forward(
        self,
        x_TD: torch.Tensor,
        batch: SeqBatch,
        rope: tuple[torch.Tensor, torch.Tensor],
        state: LayerState | None,
        h_TD: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, LayerState | None]:
        """``x_TD + h_TD`` is the residual stream entering the block (``h_TD`` None: ``x_TD`` alone); returns the
        stream after the mixer's add and the feed-forward's output still to be added, ``(x, h, state)``. Each
        residual add is done by the norm that reads its sum (``RMSNorm.add_norm``, one kernel on CUDA), the last
        one by the next block's or the final norm."""
        if h_TD is None:
            h = self.attention_norm(x_TD)
        else:
            x_TD, h = self.attention_norm.add_norm(x_TD, h_TD)
        if self.layer_type == FULL_ATTENTION:
            h, state = self.attention(h, batch, rope, state)
        else:
            h, state = self.linear_attn(h, batch, state)
        x_TD, h = self.ffn_norm.add_norm(x_TD, h)
        h = self.moe(h) if hasattr(self, "moe") else self.feed_forward(h)
        return x_TD, h, state


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.partial_rotary_factor)
        self.layers = nn.ModuleList([TransformerBlock(i, cfg) for i in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.zero_centered_norm)
        # Tied: no separate parameter, the head reads tok_embeddings.weight (one tensor to shard/sync).
        self.output = None if cfg.tie_embeddings else ops.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.lora is not None:
            apply_lora(self, cfg.lora)

    # -- weights -------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """From-scratch initialisation (checkpoints overwrite it). Works after ``to_empty``."""
        std = self.config.init_std
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.trunc_normal_(m.weight, std=std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()
        if buffer_device is not None:
            self.rope.to(buffer_device)
        self.rope.reset_parameters()

    def lm_head_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    # -- compute -------------------------------------------------------------------------------
    def hidden(
        self, tokens_T: torch.Tensor, batch: SeqBatch, states: list[LayerState] | None = None
    ) -> tuple[torch.Tensor, list[LayerState] | None]:
        """Final-norm hidden states ``[T, D]`` of packed tokens (and new per-layer states)."""
        if tokens_T.dim() != 1 or tokens_T.shape[0] != batch.num_tokens:
            raise ValueError(f"expected packed tokens [T={batch.num_tokens}], got {tuple(tokens_T.shape)}")
        if states is not None and len(states) != len(self.layers):
            raise ValueError(f"got {len(states)} layer states for {len(self.layers)} layers")
        x_TD = self.tok_embeddings(tokens_T)
        rope = self.rope(batch.positions, x_TD.dtype)
        new_states: list[LayerState] | None = [] if states is not None else None
        h_TD = None  # each block's output, added to the stream by the next norm
        for i, layer in enumerate(self.layers):
            x_TD, h_TD, s = layer(x_TD, batch, rope, None if states is None else states[i], h_TD)
            if new_states is not None:
                new_states.append(s)
        return (self.norm(x_TD) if h_TD is None else self.norm.add_norm(x_TD, h_TD)[1]), new_states

    def logits(self, h_TD: torch.Tensor, fp32: bool = False) -> torch.Tensor:
        """LM head. ``fp32``: fp32 logits through ``head_logits_fp32``, the function the trainer's fused
        logprob also calls (the generator's logits and the trainer's logprobs share their bits)."""
        w = self.lm_head_weight()
        if fp32:
            return head_logits_fp32(h_TD, w)
        return ops.linear(h_TD, w)

    def packed_token_logprobs(self, tokens_T: torch.Tensor, batch: SeqBatch, targets_T: torch.Tensor) -> torch.Tensor:
        """``log_softmax(fp32 logits[t])[targets[t]]`` for every packed row, without materialising the
        ``[T, V]`` logits (``token_logprobs_fused``). Registered as an FSDP forward method, like
        ``packed_logits``."""
        h_TD, _ = self.hidden(tokens_T, batch)
        return token_logprobs_fused(h_TD, self.lm_head_weight(), targets_T)

    def packed_logits(self, tokens_T: torch.Tensor, batch: SeqBatch, fp32: bool = False) -> torch.Tensor:
        """Logits ``[T, V]`` of packed tokens. One method for embedding through LM head so that FSDP can
        gather the root's weights around it (``parallelize_titan`` registers it as a forward method)."""
        h_TD, _ = self.hidden(tokens_T, batch)
        return self.logits(h_TD, fp32=fp32)

    def forward(self, tokens: torch.Tensor, batch: SeqBatch | None = None) -> torch.Tensor:
        """``tokens`` ``[B, S]`` -> logits ``[B, S, V]`` (B independent sequences), or packed ``[T]`` with
        a ``SeqBatch`` (default: one sequence) -> ``[T, V]``."""
        if tokens.dim() == 2:
            B, S = tokens.shape
            if batch is None:
                batch = SeqBatch.uniform(B, S, device=tokens.device)
            h, _ = self.hidden(tokens.reshape(-1), batch)
            return self.logits(h).view(B, S, -1)
        if batch is None:
            batch = SeqBatch.from_lengths([tokens.shape[0]], device=tokens.device)
        h, _ = self.hidden(tokens, batch)
        return self.logits(h)

    def step(
        self, tokens_T: torch.Tensor, batch: SeqBatch, states: list[LayerState]
    ) -> tuple[torch.Tensor, list[LayerState]]:
        h, new_states = self.hidden(tokens_T, batch, states)
        assert new_states is not None
        return self.logits(h), new_states

    def init_states(self, num_seqs: int, device: torch.device | None = None) -> list[LayerState]:
        """Empty inference state for ``num_seqs`` new sequences."""
        from titan_rl_ext.models.qwen3_5.gdn import GDNState

        device = device or self.tok_embeddings.weight.device
        dtype = self.tok_embeddings.weight.dtype
        states: list[LayerState] = []
        for layer in self.layers:
            if layer.layer_type == FULL_ATTENTION:
                a = layer.attention
                states.append(KVState.empty(num_seqs, a.n_kv_heads, a.head_dim, dtype, device))
            else:
                states.append(GDNState.zeros(num_seqs, layer.linear_attn.cfg, dtype, device))
        return states
