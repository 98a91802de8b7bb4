"""A titan Gated DeltaNet layer as a vLLM Mamba-type layer: vLLM owns the state, titan does the math.

vLLM allocates one (conv, ssm) state slot per request (per block in align-mode prefix caching) and
hands each step the slot of every request plus whether it already holds state. The wrapper runs the
unchanged titan layer on the step's tokens (decodes first, then prefills -- any mix, prefills possibly split
across steps) with both caches handed over whole and the step's slots bound to the layer's two sequence
kernels (``CachedStateConvKernel``, ``CachedStateRuleKernel``): each reads and writes its state by slot, in
place where its kernel can (else it gathers the slots, zeroing those without prior state, and scatters back).
Its state layout is the titan one: conv ``(W-1, conv_dim)``, ssm ``(HV, K, V)`` key-first; with
``TITAN_GDN_BI_FORM=grid`` (batch invariant) two more: the chunk grid's open-chunk buffer ``(HV, C, R)`` bf16 and its
boundary state ``(HV, K, V)`` fp32 (the ssm tensor is then the grid's running state).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn as nn

from titan_rl_ext.kernels.gdn_chunk_grid import CHUNK, row_layout
from titan_rl_ext.models.common.batch import SeqBatch
from titan_rl_ext.models.qwen3_5.gdn import GatedDeltaNet, GDNConfig, GDNState
from vllm_titan_plugin import compat
from vllm_titan_plugin.gdn_slots import CachedStateConvKernel, CachedStateRuleKernel, grid_state

# attribute under which the wrapper holds the titan layer (parameter names gain this segment)
INNER = "layer"


def gdn_state_shapes(cfg: GDNConfig) -> tuple[tuple[int, ...], ...]:
    """conv ``(W-1, conv_dim)``, ssm ``(HV, K, V)``; under ``grid_state()`` also the open chunk ``(HV, C, R)`` and
    the boundary state ``(HV, K, V)``."""
    shapes: tuple[tuple[int, ...], ...] = (cfg.conv_state_shape(), cfg.ssm_state_shape())
    if grid_state():
        shapes += ((cfg.n_v_heads, CHUNK, row_layout(cfg.k_head_dim, cfg.v_head_dim)["R"]), cfg.ssm_state_shape())
    return shapes


def gdn_state_dtypes(vllm_config: Any) -> tuple[torch.dtype, ...]:
    """conv state in the activation dtype, ssm state fp32 -- the titan layer's own contract -- unless
    ``--mamba-cache-dtype`` / ``--mamba-ssm-cache-dtype`` ask for something else explicitly; the grid's buffer
    always bf16 (its raw rows) and its boundary state fp32 (``checks.gdn_bi_form_problem`` refuses an ssm dtype
    other than fp32 with it)."""
    cache = vllm_config.cache_config
    model_dtype = compat.torch_dtype(vllm_config.model_config.dtype)
    conv = model_dtype if cache.mamba_cache_dtype == "auto" else compat.torch_dtype(cache.mamba_cache_dtype)
    ssm = torch.float32 if cache.mamba_ssm_cache_dtype == "auto" else compat.torch_dtype(cache.mamba_ssm_cache_dtype)
    return (conv, ssm, torch.bfloat16, torch.float32) if grid_state() else (conv, ssm)


class VllmGatedDeltaNet(nn.Module, compat.MambaBase):
    """Holds a titan ``GatedDeltaNet`` (as ``self.layer``) and its vLLM state slots.

    Same call as the titan layer, ``forward(x_TD, batch, state) -> (y_TD, state)``, so it drops into a
    titan ``TransformerBlock``; ``batch`` and ``state`` from the block are ignored in favour of vLLM's
    per-layer metadata and caches.
    """

    def __init__(self, layer: GatedDeltaNet, *, prefix: str, state_dtypes: tuple[torch.dtype, torch.dtype]) -> None:
        super().__init__()
        if not isinstance(layer.conv_kernel, CachedStateConvKernel):
            layer.conv_kernel = CachedStateConvKernel(layer.conv_kernel)
        if not isinstance(layer.rule_kernel, CachedStateRuleKernel):
            layer.rule_kernel = CachedStateRuleKernel(layer.rule_kernel)
        setattr(self, INNER, layer)
        self.prefix = prefix
        self._state_dtypes = state_dtypes
        self.kv_cache: Any = ()
        compat.register_forward_layer(prefix, self)

    # -- MambaBase ---------------------------------------------------------------------------------
    @property
    def mamba_type(self) -> Any:
        # GDN metadata (query_start_loc, state indices, has_initial_state) is all this layer needs.
        return compat.GDN_MAMBA_TYPE

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return gdn_state_shapes(self.layer.cfg)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return self._state_dtypes

    # -- compute -----------------------------------------------------------------------------------
    def forward(self, x_TD: torch.Tensor, batch: SeqBatch, state: Any = None) -> tuple[torch.Tensor, Any]:
        md = compat.layer_metadata(self.prefix)
        if md is None:
            # Profiling / warm-up run: no cache bound yet. Run the layer stateless so memory profiling
            # sees its real activations.
            y, _ = self.layer(x_TD, batch, None)
            return y, state
        if getattr(md, "spec_sequence_masks", None) is not None:
            raise NotImplementedError("--model-impl titan does not support speculative decoding")

        T = md.num_actual_tokens  # x_TD may carry padding after the real tokens
        bounds = _step_bounds(md, batch, T, x_TD.device)
        seq, slots, keep = bounds.seq, bounds.slots, bounds.keep
        conv_cache, ssm_cache, *grid = compat.mamba_state_tensors(self)

        # both caches go in whole: the sequence kernels read and write this step's slots (in place where their
        # kernels can); the rule kernel may instead return the N new ssm states, scattered here
        kernels = (self.layer.conv_kernel, self.layer.rule_kernel)
        self.layer.conv_kernel.bind(slots, keep)
        self.layer.rule_kernel.bind(slots, keep, n_decodes=bounds.n_decodes, chunk_indices=bounds.chunk_indices,
                                    grid=(grid[0], grid[1]) if grid else None, step_cache=bounds.cache)
        try:
            y_TD, new = self.layer(x_TD[:T], seq, GDNState(conv_cache, ssm_cache))
        finally:
            for kernel in kernels:
                kernel.unbind()
        if new.conv is not conv_cache:
            raise RuntimeError(f"{type(self.layer.conv_kernel).__name__} did not update the conv cache by slot")
        if new.ssm is not ssm_cache:
            ssm_cache.index_copy_(0, slots, new.ssm.to(ssm_cache.dtype))

        if T < x_TD.shape[0]:
            y_TD = torch.cat([y_TD, y_TD.new_zeros(x_TD.shape[0] - T, y_TD.shape[1])])
        return y_TD, state


class _StepBounds(NamedTuple):
    step: SeqBatch  # the forward's whole-step batch these bounds were made in (a fresh object per forward)
    seq: SeqBatch
    slots: torch.Tensor
    keep: torch.Tensor | None
    n_decodes: int = 0  # a mixed step's leading one-token decodes (0: decode-only, prefill-only or unknown)
    chunk_indices: torch.Tensor | None = None  # vLLM's FLA chunk layout of the step's prefills
    # what the step's first GDN layer derives for the rest (the grid's host layout and chunk plan): a fresh dict
    # per forward
    cache: dict[str, Any] | None = None


_BOUNDS_ATTR = "_titan_gdn_bounds"


def _step_bounds(md: Any, batch: SeqBatch, T: int, device: torch.device) -> _StepBounds:
    """The step's sequence bounds, state slots and which slots hold prior state, from the GDN metadata.

    Every GDN layer of a step reads the same metadata object, so the first layer's result is kept on it and the
    others reuse it: at decode that spares each further layer its launches (the arange, the slot cast). Kept only
    for the forward that made it (``step``): a metadata object reused by a later forward, its tensors refilled
    in place, gets fresh bounds."""
    cached = getattr(md, _BOUNDS_ATTR, None)
    if cached is not None and cached.step is batch:
        return cached
    if md.num_prefills == 0 and md.non_spec_state_indices_tensor.shape[0] == T:
        # Decode-only step (what a full CUDA graph captures): one token per request, bounds by arange,
        # not from the metadata. Under graph padding vLLM gives the padded requests zero tokens and
        # state slot 0 (its null block); here each padded request takes one padded token instead, so
        # every token belongs to a sequence (nothing reads uninitialised rows) and the garbage lands in
        # slot 0, which no request owns. Real requests compute exactly what the metadata bounds give.
        cu_seqlens = torch.arange(T + 1, dtype=torch.int32, device=device)
    else:
        cu_seqlens = md.non_spec_query_start_loc
    n_seqs = cu_seqlens.numel() - 1
    has_initial = md.has_initial_state  # None: every request continues (decode-only step)
    n_decodes, chunk_indices = _prefill_layout(md)
    bounds = _StepBounds(
        step=batch,
        seq=SeqBatch(
            cu_seqlens=cu_seqlens.to(torch.int32),
            positions=batch.positions[:T],
            max_seqlen=T,  # an upper bound: the exact value would cost a host sync every layer
        ),
        slots=md.non_spec_state_indices_tensor[:n_seqs].long(),
        # a recycled slot holds another request's (or uninitialised) state: the kernels start it from zeros
        keep=None if has_initial is None else has_initial[:n_seqs].to(torch.bool),
        n_decodes=n_decodes,
        chunk_indices=chunk_indices,
        cache={},
    )
    try:
        setattr(md, _BOUNDS_ATTR, bounds)
    except (AttributeError, TypeError):  # a metadata class with __slots__ or frozen: compute per layer
        pass
    return bounds


def _prefill_layout(md: Any) -> tuple[int, torch.Tensor | None]:
    """A step with prefills: how many one-token decodes lead it (vLLM's GDN backend orders decodes first) and
    the FLA chunk indices vLLM's metadata builder made on the host for its prefills -- for the prefills after
    the decodes where there are decodes, as vLLM's own layer peels them (``CachedStateRuleKernel``). Host
    values of the metadata: no sync. ``(0, None)`` at decode-only steps and where the metadata lacks them."""
    if not getattr(md, "num_prefills", 0):
        return 0, None
    nd = int(getattr(md, "num_decodes", 0) or 0)
    if nd and int(getattr(md, "num_decode_tokens", -1)) != nd:
        return 0, None  # decodes of several tokens: not this layout
    ci = getattr(md, "chunk_indices", None)
    if not (isinstance(ci, torch.Tensor) and ci.dim() == 2 and ci.shape[1] == 2):
        ci = None  # another backend's layout (or none): FLA derives its own
    return nd, ci
