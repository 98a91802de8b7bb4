"""Gated DeltaNet layer of Qwen3.5 (``linear_attention`` layers).

Math lives here; the two sequence kernels sit in slots (``conv_kernel``, ``rule_kernel``) so the
trainer (packed sequences, no state) and an inference engine (conv/recurrent state carried across
steps) run this same code. State in and out is a ``GDNState``: the engine decides where it lives (vLLM's
state-cache kernels that fill the slots are the plugin's: ``vllm_titan_plugin.gdn_slots``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal

import torch
import torch.nn as nn

from titan_rl_ext.kernels.conv import causal_conv1d
from titan_rl_ext.kernels import batch_invariant as bi
from titan_rl_ext.kernels.gdn import GDNMode, bi_form, gated_delta_rule, gated_delta_rule_bi, resolve_backend
from titan_rl_ext.kernels import ops, rows
from titan_rl_ext.models.common.batch import SeqBatch
from titan_rl_ext.models.common.norms import GatedRMSNorm


@dataclass
class GDNConfig:
    n_k_heads: int
    n_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int = 4

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_kernel - 1, self.conv_dim)

    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.n_v_heads, self.k_head_dim, self.v_head_dim)


@dataclass(frozen=True)
class GDNState:
    """``conv`` ``[N, W-1, conv_dim]`` (activation dtype), ``ssm`` ``[N, HV, K, V]`` (always fp32)."""

    conv: torch.Tensor
    ssm: torch.Tensor

    @classmethod
    def zeros(cls, num_seqs: int, cfg: GDNConfig, dtype: torch.dtype, device: torch.device) -> GDNState:
        return cls(
            torch.zeros(num_seqs, *cfg.conv_state_shape(), dtype=dtype, device=device),
            torch.zeros(num_seqs, *cfg.ssm_state_shape(), dtype=torch.float32, device=device),
        )


class CausalConvKernel(nn.Module):
    """``(y, state)``; with ``split`` ``y`` comes as its two column ranges (``kernels.conv.causal_conv1d``)."""

    def forward(
        self, x_TC: torch.Tensor, weight_CW: torch.Tensor, batch: SeqBatch, state: torch.Tensor | None,
        split: int | None = None,
    ) -> tuple[Any, torch.Tensor]:
        return causal_conv1d(x_TC, weight_CW, batch.cu_seqlens, None, state, activation="silu", split=split)


class GatedDeltaRuleKernel(nn.Module):
    """``mode``: ``chunk`` (fast prefill/training) or ``recurrent`` (token by token, the reference).
    Batch-invariant mode overrides it: recurrent forward everywhere (or the chunk grid, ``TITAN_GDN_BI_FORM``),
    chunked backward."""

    def __init__(self, mode: GDNMode = "chunk", backend: Literal["auto", "torch", "fla"] = "auto") -> None:
        super().__init__()
        self.mode, self.backend = mode, backend

    def forward(
        self,
        q_THK: torch.Tensor,
        k_THK: torch.Tensor,
        v_THV: torch.Tensor,
        g_TH: torch.Tensor,
        beta_TH: torch.Tensor,
        batch: SeqBatch,
        scale: float,
        state: torch.Tensor | None,
        chunk_indices: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``chunk_indices``: see ``kernels.gdn.gated_delta_rule`` (an engine's precomputed chunk layout)."""
        if bi.is_batch_invariant():
            return gated_delta_rule_bi(
                q_THK, k_THK, v_THV, g_TH, beta_TH, batch.cu_seqlens, scale, initial_state=state, backend=self.backend
            )
        return gated_delta_rule(
            q_THK, k_THK, v_THV, g_TH, beta_TH, batch.cu_seqlens, scale,
            initial_state=state, mode=self.mode, backend=self.backend, chunk_indices=chunk_indices,
        )

    def qk_dtype(self, q_THK: torch.Tensor, v_THV: torch.Tensor, n_seqs: int, state: torch.Tensor | None) -> torch.dtype:
        """The dtype to hand q/k over in (after their l2norm): v's where FLA's kernels will run the call without a
        gradient -- they cast q/k to it, so the l2norm writes that rounding of the same fp32 values itself, one
        copy less per tensor -- else fp32."""
        if self.backend not in ("auto", "fla") or torch.is_grad_enabled():
            return torch.float32
        if bi.is_batch_invariant() and bi_form() == "grid":
            return torch.float32  # the grid reads fp32 q/k on every path: the trainer's and an engine's alike
        mode: GDNMode = "recurrent" if bi.is_batch_invariant() else self.mode
        resolved = "fla" if self.backend == "fla" else resolve_backend(q_THK, n_seqs, mode, False)
        return v_THV.dtype if resolved == "fla" else torch.float32

    def extra_repr(self) -> str:
        return f"mode={self.mode}, backend={self.backend}"


class GatedDeltaNet(nn.Module):
    def __init__(self, dim: int, cfg: GDNConfig, norm_eps: float, mode: GDNMode = "chunk") -> None:
        super().__init__()
        self.cfg = cfg
        # HF's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a as one GEMM
        self.in_proj = ops.MergedLinear(dim, [cfg.conv_dim, cfg.value_dim, cfg.n_v_heads, cfg.n_v_heads], bias=False)
        # depthwise conv weight in nn.Conv1d's layout [C, 1, W] (the checkpoint's layout)
        self.conv_weight = nn.Parameter(torch.empty(cfg.conv_dim, 1, cfg.conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(cfg.n_v_heads))
        self.A_log = nn.Parameter(torch.zeros(cfg.n_v_heads, dtype=torch.float32))
        self.norm = GatedRMSNorm(cfg.v_head_dim, norm_eps)
        self.out_proj = ops.Linear(cfg.value_dim, dim, bias=False)
        self.conv_kernel: nn.Module = CausalConvKernel()
        self.rule_kernel: nn.Module = GatedDeltaRuleKernel(mode)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.conv_weight, a=math.sqrt(5))
        nn.init.ones_(self.dt_bias)
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log, dtype=torch.float32).uniform_(1, 16).log())

    # A_log stays fp32 whatever the model dtype: exp(A_log) in bf16 would change every decay rate. The trainer's
    # mixed precision (``titan_protocol.apply_fsdp``) keeps this module's own parameters out of the bf16 cast
    # for it; the forward casts the others (conv_weight, dt_bias) to the activations' dtype itself, which is
    # what the served bf16 model holds (a no-op there and in fp32).
    FP32_PARAMS: ClassVar[tuple[str, ...]] = ("A_log",)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        a_log = self.A_log.data
        out = super()._apply(fn, recurse)
        if self.A_log.dtype != torch.float32:
            self.A_log.data = a_log.to(device=self.A_log.device, dtype=torch.float32)
        return out

    def forward(
        self, x_TD: torch.Tensor, batch: SeqBatch, state: GDNState | None = None
    ) -> tuple[torch.Tensor, GDNState | None]:
        cfg = self.cfg
        T = x_TD.shape[0]
        mixed_TC, z_TF, b_TH, a_TH = self.in_proj.split(self.in_proj(x_TD))
        # mixed_TC is a column slice of the merged projection: the conv reads it in place (rows strided), and
        # writes q/k and v apart, so that v is contiguous where FLA's kernels would otherwise copy it
        (qk_TC, v), conv_state = self.conv_kernel(
            mixed_TC, self.conv_weight.to(x_TD.dtype).squeeze(1), batch, None if state is None else state.conv,
            split=2 * cfg.key_dim,
        )
        q, k = torch.split(qk_TC, [cfg.key_dim, cfg.key_dim], dim=-1)
        # head views of the conv's output, read in place
        q_raw = q.reshape(T, cfg.n_k_heads, cfg.k_head_dim)
        k_raw = k.reshape(T, cfg.n_k_heads, cfg.k_head_dim)
        v_THV = v.reshape(T, cfg.n_v_heads, cfg.v_head_dim)
        scale = cfg.k_head_dim**-0.5
        ssm = None if state is None else state.ssm
        rule = self.rule_kernel
        # an engine's rule kernel may take q/k before their l2norm and the raw gates (``prep_in_kernel`` says when:
        # ``vllm_titan_plugin.gdn_slots``): the layer asks, it does not know the engine's classes
        prep_in_kernel = getattr(rule, "prep_in_kernel", None)
        if prep_in_kernel is not None and prep_in_kernel(q_raw, v_THV, ssm):
            o_THV, ssm_state = rule.forward_raw(q_raw, k_raw, v_THV, a_TH, b_TH, self.A_log,
                                                self.dt_bias.to(x_TD.dtype), batch, scale, ssm)
        else:
            g_TH, beta_TH = rows.gdn_gates(a_TH, b_TH, self.A_log, self.dt_bias.to(x_TD.dtype))
            n_seqs = batch.cu_seqlens.numel() - 1
            qk = rule.qk_dtype(q_raw, v_THV, n_seqs, ssm) if hasattr(rule, "qk_dtype") else torch.float32
            o_THV, ssm_state = rule(rows.l2norm(q_raw, out_dtype=qk), rows.l2norm(k_raw, out_dtype=qk), v_THV, g_TH,
                                    beta_TH, batch, scale, ssm)
        z_THV = z_TF.reshape(T, cfg.n_v_heads, cfg.v_head_dim)
        o_TF = self.norm(o_THV.to(x_TD.dtype), z_THV).reshape(T, cfg.value_dim)
        new_state = None if state is None else GDNState(conv_state, ssm_state)
        return self.out_proj(o_TF), new_state
