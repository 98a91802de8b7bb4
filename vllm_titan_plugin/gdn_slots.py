"""The sequence kernels a vLLM engine puts in a titan ``GatedDeltaNet``'s slots: vLLM keeps every sequence's conv
and recurrent state in one cache indexed by slot, and these kernels read and write those slots (in place where
the project's kernels can, else gathering and scattering them), around the layer's own kernels (``base``).

Torch and the project's kernels only (no vLLM import): the kernel tests run them without an engine.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from titan_rl_ext.kernels import batch_invariant as bi
from titan_rl_ext.kernels.conv import causal_conv1d
from titan_rl_ext.kernels.gdn import GDNMode, bi_form, grid_steps_torch, mixed_steps, runs_titan_recurrent
from titan_rl_ext.models.common.batch import SeqBatch
from titan_rl_ext.models.qwen3_5.gdn import GatedDeltaRuleKernel


def grid_state() -> bool:
    """Whether the engine runs ``TITAN_GDN_BI_FORM=grid``: batch-invariant mode with that form. Its GDN layers then
    carry the chunk grid's open-chunk buffer and boundary state as third and fourth state tensors (read by the
    model class's classmethods, before any layer exists) and their rule kernels step the grid."""
    return bi.is_batch_invariant() and bi_form() == "grid"


def _first_positions(batch: SeqBatch, T: int) -> torch.Tensor:
    """Each sequence's first token's position in the step: its place on the grid (tokens seen). An empty sequence,
    a padded request, has no first token: any position serves it."""
    return batch.positions[batch.cu_seqlens[:-1].long().clamp(max=T - 1)]


def grid_runs_kernels(q_THK: torch.Tensor) -> bool:
    """Whether an engine's grid step runs the Triton kernels (CUDA) or the plain-PyTorch fixed order (elsewhere, as
    the trainer's forward does there); a function so that interpreter checks can take the kernels' branch on CPU."""
    return q_THK.is_cuda


class _SlotBound(nn.Module):
    """A sequence kernel of an engine that keeps every sequence's state in one cache indexed by slot: ``base``
    (the layer's own kernel) plus this step's slots, which the engine ``bind`` s before the layer runs and
    ``unbind`` s after."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self._slots: torch.Tensor | None = None
        self._keep: torch.Tensor | None = None

    def bind(self, slots: torch.Tensor, keep: torch.Tensor | None) -> None:
        """This step's slot of each sequence ``[N]`` and whether it holds prior state ``[N]`` (None: all do)."""
        self._slots, self._keep = slots, keep

    def unbind(self) -> None:
        self._slots = self._keep = None


class CachedStateConvKernel(_SlotBound):
    """The conv of an engine that keeps every sequence's conv state in one cache ``[S, W-1, C]`` indexed by slot.
    Per step the engine ``bind`` s the slots (and which of them hold prior state) and hands the layer the cache
    itself as ``state.conv``; the conv reads and writes the slots (in place where its kernel can) and returns
    the cache as the new state. Unbound (a profiling run), ``base`` runs on the state given."""

    def forward(
        self, x_TC: torch.Tensor, weight_CW: torch.Tensor, batch: SeqBatch, state: torch.Tensor | None,
        split: int | None = None,
    ) -> tuple[Any, torch.Tensor]:
        if self._slots is None or state is None:
            return self.base(x_TC, weight_CW, batch, state, split)
        return causal_conv1d(x_TC, weight_CW, batch.cu_seqlens, None, state, activation="silu",
                             state_slots=self._slots, state_keep=self._keep, split=split)


class CachedStateRuleKernel(_SlotBound):
    """The rule kernel of an engine that keeps every sequence's state in one cache ``[S, HV, K, V]`` indexed by
    slot. Per step the engine ``bind`` s the slots (and which of them hold prior state) and hands the layer
    the cache itself as ``state.ssm``. Where the project's recurrent kernel runs the call (``kernels.gdn``'s
    ``runs_titan_recurrent``) it reads and writes the slots in place and returns the cache as the new state;
    otherwise the slots are gathered (zeros where there is no prior state), ``base`` runs, and the engine
    scatters the ``[N, ...]`` states it returns. Same per-token arithmetic either way, so BI bits do not
    depend on where the state lives."""

    base: GatedDeltaRuleKernel

    def __init__(self, base: nn.Module) -> None:
        super().__init__(base)
        self._n_decodes = 0
        self._chunk_indices: torch.Tensor | None = None
        self._grid: tuple[torch.Tensor, torch.Tensor] | None = None
        self._step_cache: dict[str, Any] = {}

    def bind(
        self, slots: torch.Tensor, keep: torch.Tensor | None, *, n_decodes: int = 0,
        chunk_indices: torch.Tensor | None = None, grid: tuple[torch.Tensor, torch.Tensor] | None = None,
        step_cache: dict[str, Any] | None = None,
    ) -> None:
        """As ``_SlotBound.bind``, plus what an engine knows of the step's layout on the host: ``n_decodes``, how
        many leading sequences are one-token decodes followed by prefills (0: no such split), and the FLA chunk
        indices of the prefill sequences (of all of them where ``n_decodes`` is 0). ``grid``: the open-chunk buffer
        ``[S, HV, C, R]`` and boundary state ``[S, HV, K, V]`` caches of ``TITAN_GDN_BI_FORM=grid`` (its third and
        fourth state tensors), slots as ``state``'s. ``step_cache``: a dict that lives as long as the step and is
        shared by its GDN layers (the grid keeps its host layout and chunk plan there: one host round trip a step,
        not one a layer); none: this call's own."""
        super().bind(slots, keep)
        self._n_decodes, self._chunk_indices, self._grid = n_decodes, chunk_indices, grid
        self._step_cache = {} if step_cache is None else step_cache

    def unbind(self) -> None:
        super().unbind()
        self._n_decodes, self._chunk_indices, self._grid = 0, None, None
        self._step_cache = {}

    def _peels_decodes(self, q_THK: torch.Tensor, v_THV: torch.Tensor, state: torch.Tensor | None) -> bool:
        """Whether a mixed step (decodes first, then prefills) runs as two calls, as vLLM's own GDN layer does:
        the decodes on the project's recurrent kernel in place on the cache, the prefills on the chunk kernel
        with only their own states gathered and scattered. One chunk call over the whole step would gather and
        scatter every running sequence's state (2 MB each at the 9B's heads) and pad each decode token to a
        64-token chunk. Non-BI only: BI runs the recurrent kernel on the whole step anyway."""
        if not self._mixed() or bi.is_batch_invariant() or self.base.mode != "chunk":
            return False
        if mixed_steps() == "recurrent" and self._in_place(q_THK, v_THV, state, "chunk"):
            return False  # the whole call runs in place (``kernels.gdn.mixed_steps``)
        nd = self._n_decodes
        return self._in_place(q_THK[:nd], v_THV[:nd], state, "chunk", n_seqs=nd)

    def _mixed(self) -> bool:
        """Whether the bound step is decodes followed by prefills."""
        return self._slots is not None and 0 < self._n_decodes < self._slots.shape[0]

    def prep_in_kernel(self, q_THK: torch.Tensor, v_THV: torch.Tensor, state: torch.Tensor | None) -> bool:
        """Whether this call should take raw q/k/a/b (``forward_raw``) and leave the l2norms and gates to the
        project's kernel, three launches fewer per layer: non-BI decode-sized calls that the kernel runs on a bound
        cache it updates in place. Never under BI: the kernel sums the l2norm in another order than the layer's
        own kernel does, and a BI step must give the trainer's bits. Not where the engine bound a mixed step
        (decodes, then prefills) either: a prefill's tokens run one after another in the kernel, and the fused
        l2norms and gates lengthen that serial chain -- at prefill lengths the separate kernels are faster
        (``benchmarks/gdn_recurrent.py``, ``titan_prep`` against ``titan_unfused``; the timings: docs/gpu_runs.md
        §18, "Issue 21 closed out"); such a
        step runs as BI's does, or peeled (``_peels_decodes``), its rule given normed q/k either way."""
        if self._mixed():
            return False
        return (self._slots is not None and not bi.is_batch_invariant() and q_THK.shape[0] <= 2 * self._slots.shape[0]
                and self._in_place(q_THK, v_THV, state, self.base.mode))

    def _in_place(
        self, q_THK: torch.Tensor, v_THV: torch.Tensor, state: torch.Tensor | None, mode: GDNMode,
        n_seqs: int | None = None,
    ) -> bool:
        """Whether the project's kernel runs this call (of ``n_seqs`` sequences; default all bound) on the bound
        cache, reading and writing the slots in place (else the slots are gathered for ``base`` and the engine
        scatters the result)."""
        slots = self._slots
        if slots is None or state is None or self.base.backend != "auto":
            return False
        if not runs_titan_recurrent(q_THK, slots.shape[0] if n_seqs is None else n_seqs, mode, False):
            return False
        from titan_rl_ext.kernels.gdn_triton import slotted_state_ok

        return slotted_state_ok(state, v_THV.shape[1], q_THK.shape[2], v_THV.shape[2])

    def qk_dtype(self, q_THK: torch.Tensor, v_THV: torch.Tensor, n_seqs: int, state: torch.Tensor | None) -> torch.dtype:
        """fp32 where the project's kernel runs the call on the cache in place, else ``base``'s choice."""
        if grid_state():
            return torch.float32  # as the trainer's grid forward reads them (``GatedDeltaRuleKernel.qk_dtype``)
        mode: GDNMode = "recurrent" if bi.is_batch_invariant() else self.base.mode
        if self._slots is not None and state is not None and self._in_place(q_THK, v_THV, state, mode):
            return torch.float32
        if self._peels_decodes(q_THK, v_THV, state):
            return torch.float32  # the decodes' kernel reads fp32 as in a decode-only step; FLA casts its part
        return self.base.qk_dtype(q_THK, v_THV, n_seqs, state)

    def forward_raw(
        self,
        q_raw_THK: torch.Tensor,
        k_raw_THK: torch.Tensor,
        v_THV: torch.Tensor,
        a_TH: torch.Tensor,
        b_TH: torch.Tensor,
        A_log_H: torch.Tensor,
        dt_bias_H: torch.Tensor,
        batch: SeqBatch,
        scale: float,
        state: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step where ``prep_in_kernel`` said so: q/k before their l2norm, the projection's ``a``/``b``."""
        from titan_rl_ext.kernels.gdn_triton import gated_delta_rule_recurrent

        if self._slots is None:
            raise RuntimeError("forward_raw needs the step's slots bound (prep_in_kernel says when)")
        return gated_delta_rule_recurrent(q_raw_THK, k_raw_THK, v_THV, a_TH, b_TH, batch.cu_seqlens, scale, state,
                                          state_slots=self._slots, state_keep=self._keep, A_log=A_log_H,
                                          dt_bias=dt_bias_H, norm_qk=True)

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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        slots, keep = self._slots, self._keep
        if slots is None or state is None:  # no cache bound (a profiling run): the plain kernel
            return self.base(q_THK, k_THK, v_THV, g_TH, beta_TH, batch, scale, state)
        if grid_state():
            return self._grid_step(q_THK, k_THK, v_THV, g_TH, beta_TH, batch, scale, state)
        mode: GDNMode = "recurrent" if bi.is_batch_invariant() else self.base.mode
        if self._in_place(q_THK, v_THV, state, mode):
            from titan_rl_ext.kernels.gdn_triton import gated_delta_rule_recurrent

            return gated_delta_rule_recurrent(q_THK, k_THK, v_THV, g_TH, beta_TH, batch.cu_seqlens, scale, state,
                                              state_slots=slots, state_keep=keep)
        if self._peels_decodes(q_THK, v_THV, state):
            return self._decodes_then_prefills(q_THK, k_THK, v_THV, g_TH, beta_TH, batch, scale, state)
        # the bound chunk indices cover the prefills alone where decodes lead the step: not this whole call then
        return self.base(q_THK, k_THK, v_THV, g_TH, beta_TH, batch, scale, self._gather(state, slots, keep),
                         chunk_indices=self._chunk_indices if self._n_decodes == 0 else None)

    def _grid_step(
        self, q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
        beta_TH: torch.Tensor, batch: SeqBatch, scale: float, S: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``TITAN_GDN_BI_FORM=grid``: every sequence of the step continued on the chunk grid from its slot's running
        state ``S`` (the ssm cache), boundary state and open-chunk rows. Returns the ``S`` cache itself (all three
        caches advanced in place).

        A sequence's position on the grid (tokens seen) is its first token's position in this step: text
        positions count the tokens before, vLLM's align-mode cache hits included (the hit's block state, buffer
        and boundary state, is copied by the model's copy functions). So nothing else need be kept, and prefix-cache
        copies carry all the grid needs."""
        from titan_rl_ext.kernels import gdn_chunk_grid as grid

        slots, keep = self._slots, self._keep
        assert slots is not None
        if self._grid is None:
            raise RuntimeError("TITAN_GDN_BI_FORM=grid needs the open-chunk buffer and boundary state bound (the "
                               "layer's third and fourth state tensors): was the engine started with this setting?")
        buf, S_b = self._grid
        T, N = q_THK.shape[0], slots.shape[0]
        if T == 0 or N == 0:
            return torch.empty(v_THV.shape, dtype=v_THV.dtype, device=v_THV.device), S
        if not grid_runs_kernels(q_THK):
            cu, pos, slot_list, fresh = self._host_layout(batch, slots, keep, T)
            if fresh:  # a recycled slot holds another request's (or uninitialised) state: zero states
                for cache in (S, S_b):
                    cache[fresh] = 0.0
            o, _ = grid_steps_torch(q_THK, k_THK, v_THV, g_TH, beta_TH, cu, scale, S, S_b, buf, pos, slot_list)
            return o.to(v_THV.dtype), S
        # the kernels address each slot of the caches in place (vLLM's mamba pages interleave the state tensors,
        # each slot contiguous); a layout they cannot address has the step's rows gathered and scattered
        in_place = grid.state_layout_ok(S, S_b, buf)
        if T == N and keep is None:  # decode-only: one token a sequence, positions and slots stay on the device
            rows = (S, S_b, buf) if in_place else tuple(t.index_select(0, slots) for t in (S, S_b, buf))
            key = f"grid_decode_{int(in_place)}"
            if key not in self._step_cache:  # the step's first GDN layer: positions and rows into a plan for all
                idx = slots if in_place else torch.arange(N, device=slots.device)
                self._step_cache[key] = grid.make_decode_plan(_first_positions(batch, T), idx, buf.shape[2])
            o = grid.decode(q_THK, k_THK, v_THV, g_TH, beta_TH, scale, *rows, plan=self._step_cache[key])
        else:  # a prefill: its chunk plan made on the host once for the step's layers
            fresh_t, plan = self._grid_plan(batch, slots, keep, T, buf.shape[2], in_place)
            if fresh_t is not None:  # recycled slots: the grid starts them from zero states
                for cache in (S, S_b):
                    cache.index_fill_(0, fresh_t, 0.0)
            rows = (S, S_b, buf) if in_place else tuple(t.index_select(0, slots) for t in (S, S_b, buf))
            cu = self._host_layout(batch, slots, keep, T)[0]
            o, _ = grid.prefill(q_THK, k_THK, v_THV, g_TH, beta_TH, cu, scale, *rows, plan=plan, want_final=False)
        if not in_place:
            for cache, r in zip((S, S_b, buf), rows):
                cache.index_copy_(0, slots, r)
        return o, S

    def _host_layout(
        self, batch: SeqBatch, slots: torch.Tensor, keep: torch.Tensor | None, T: int,
    ) -> tuple[list[int], list[int], list[int], list[int]]:
        """The step's ``(cu_seqlens, first positions, slots, slots to start from zero)`` on the host, read in one
        copy and kept for the step's other layers."""
        cached = self._step_cache.get("grid_host")
        if cached is not None:
            return cached
        cu = batch.cu_seqlens.long()
        N = slots.shape[0]
        kept = torch.ones(N, dtype=torch.long, device=cu.device) if keep is None else keep.long()
        flat = torch.cat([cu, _first_positions(batch, T).long(), slots.long(), kept]).tolist()
        cu_l, pos_l, slot_l, keep_l = flat[:N + 1], flat[N + 1:2 * N + 1], flat[2 * N + 1:3 * N + 1], flat[3 * N + 1:]
        layout = (cu_l, pos_l, slot_l, [s for s, k in zip(slot_l, keep_l) if not k])
        self._step_cache["grid_host"] = layout
        return layout

    def _grid_plan(
        self, batch: SeqBatch, slots: torch.Tensor, keep: torch.Tensor | None, T: int, chunk: int, in_place: bool,
    ) -> tuple[torch.Tensor | None, Any]:
        """The step's prefill plan (``gdn_chunk_grid.PrefillPlan``; state rows by slot, or by position in the
        gathered rows where the caches are not addressed in place) and the slots to zero as a device index, made
        by the step's first GDN layer and shared by the rest."""
        from titan_rl_ext.kernels import gdn_chunk_grid as grid

        key = f"grid_plan_{int(in_place)}"
        if key not in self._step_cache:
            cu, pos, slot_l, fresh = self._host_layout(batch, slots, keep, T)
            rows = slot_l if in_place else list(range(len(slot_l)))
            fresh_t = torch.tensor(fresh, dtype=torch.long, device=slots.device) if fresh else None
            self._step_cache[key] = (fresh_t, grid.make_prefill_plan(cu, pos, rows, chunk, slots.device))
        return self._step_cache[key]

    @staticmethod
    def _gather(state: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        ssm0 = state.index_select(0, slots.long()).float()
        if keep is not None:
            # a recycled slot holds another request's (or uninitialised) state: where, not multiply
            ssm0 = torch.where(keep[:, None, None, None], ssm0, torch.zeros_like(ssm0))
        return ssm0

    def _decodes_then_prefills(
        self, q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
        beta_TH: torch.Tensor, batch: SeqBatch, scale: float, state: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``_peels_decodes``. The decodes are sequences ``[0, nd)``, one token each, so tokens ``[0, nd)``;
        returns the cache, every sequence's final state written to its slot."""
        from titan_rl_ext.kernels.gdn_triton import gated_delta_rule_recurrent

        nd, slots, keep = self._n_decodes, self._slots, self._keep
        assert slots is not None
        cu = batch.cu_seqlens
        o_dec, _ = gated_delta_rule_recurrent(
            q_THK[:nd], k_THK[:nd], v_THV[:nd], g_TH[:nd], beta_TH[:nd], cu[: nd + 1], scale, state,
            state_slots=slots[:nd], state_keep=None if keep is None else keep[:nd])
        p_slots, p_keep = slots[nd:], None if keep is None else keep[nd:]
        prefills = SeqBatch(cu_seqlens=cu[nd:] - nd, positions=batch.positions[nd:], max_seqlen=batch.max_seqlen)
        o_pre, final = self.base(q_THK[nd:], k_THK[nd:], v_THV[nd:], g_TH[nd:], beta_TH[nd:], prefills, scale,
                                 self._gather(state, p_slots, p_keep), chunk_indices=self._chunk_indices)
        state.index_copy_(0, p_slots.long(), final.to(state.dtype))
        return torch.cat([o_dec, o_pre.to(o_dec.dtype)]), state
