"""The plugin's chunk-grid step (``vllm_titan_plugin.gdn_slots.CachedStateRuleKernel`` with
``TITAN_GDN_BI_FORM=grid``) on the kernels' branch, as a GPU engine runs it, on CPU under the Triton interpreter:
state caches strided as vLLM's mamba pages lay them out (the running state, the open-chunk buffer and the boundary
state interleaved in one page per slot, which the kernels address in place), sequences in arbitrary slots, a
recycled slot holding garbage (``has_initial_state`` False: its state rows zeroed), a continued prefill mid-chunk
and decode-only steps across a fold, two layers sharing the step's chunk plan (made once a prefill step) -- against ``gdn_chunk_grid.prefill`` / ``decode`` on contiguous state:
outputs, both states and open-chunk rows equal bit for bit.

Runs in a subprocess with ``TRITON_INTERPRET=1``. Skipped where triton is missing.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable

import pytest

from triton_interp import run_checks, run_checks_under_interpreter


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_grid_engine_step_under_interpreter() -> None:
    run_checks_under_interpreter(__file__)


# ------------------------------------------------------------------------------------------------
# the checks, run in the subprocess


def _check_strided_slots_and_decodes() -> None:
    import torch

    from titan_rl_ext.kernels import gdn_chunk_grid as cg
    from titan_rl_ext.kernels.batch_invariant import batch_invariant
    from titan_rl_ext.models.common.batch import SeqBatch
    from titan_rl_ext.models.qwen3_5.gdn import GatedDeltaRuleKernel
    from vllm_titan_plugin import gdn_slots

    os.environ["TITAN_GDN_BI_FORM"] = "grid"  # a subprocess of its own: nothing leaks
    gdn_slots.grid_runs_kernels = lambda q: True  # the kernels' branch on CPU tensors (the interpreter runs them)
    torch.manual_seed(0)
    H, HV, K, V, C = 1, 2, 16, 16, cg.CHUNK
    L = cg.row_layout(K, V)
    n_slots, s_bytes, b_bytes = 5, HV * K * V * 4, HV * C * L["R"] * 2
    def layer_caches() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer's caches: a page of bytes a slot (S_run fp32, the buffer bf16, S_b fp32), padded as vLLM
        pads mamba pages."""
        pages = torch.zeros(n_slots, 2 * s_bytes + b_bytes + 148, dtype=torch.uint8)
        S = pages[:, :s_bytes].view(torch.float32).view(n_slots, HV, K, V)
        buf = pages[:, s_bytes:s_bytes + b_bytes].view(torch.bfloat16).view(n_slots, HV, C, L["R"])
        S_b = pages[:, s_bytes + b_bytes:2 * s_bytes + b_bytes].view(torch.float32).view(n_slots, HV, K, V)
        return S, buf, S_b

    # two GDN layers of one engine: the second reuses the step's chunk plan the first made (``step_cache``)
    layers = [layer_caches() for _ in range(2)]
    S_NHKV, buf_NHCR, Sb_NHKV = layers[0]
    assert not any(t.is_contiguous() for t in (S_NHKV, buf_NHCR, Sb_NHKV))
    assert cg.state_layout_ok(S_NHKV, Sb_NHKV, buf_NHCR)  # addressed in place, slot by slot
    ref = cg.new_state(n_slots, HV, K, V)
    kernels = [gdn_slots.CachedStateRuleKernel(GatedDeltaRuleKernel()) for _ in layers]
    scale = K**-0.5
    done = {3: 0, 1: 0}  # slot -> tokens seen
    plans_made: dict[str, int] = {"prefill": 0, "decode": 0}

    def counted(kind: str, make: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **kw: Any) -> Any:
            plans_made[kind] += 1
            return make(*a, **kw)
        return wrapper

    cg.make_prefill_plan = counted("prefill", cg.make_prefill_plan)
    cg.make_decode_plan = counted("decode", cg.make_decode_plan)

    def step(plan: dict[int, int], decode_only: bool = False) -> None:
        slots, lengths = list(plan), list(plan.values())
        T = sum(lengths)
        unit = [torch.nn.functional.normalize(torch.randn(T, H, K), dim=-1) for _ in range(2)]
        x = (*unit, torch.randn(T, HV, V), -torch.rand(T, HV) * 0.2, torch.rand(T, HV))
        slots_t = torch.tensor(slots)
        pos = [done[s] for s in slots]
        keep = None if decode_only else torch.tensor([p > 0 for p in pos])
        batch, step_cache, outs = SeqBatch.from_lengths(lengths, start_positions=pos), {}, []
        n_plans = dict(plans_made)
        for kernel, (S, buf, S_b) in zip(kernels, layers):
            kernel.bind(slots_t, keep, grid=(buf, S_b), step_cache=step_cache)
            with batch_invariant():
                outs.append(kernel(*x, batch, scale, S)[0])
            kernel.unbind()
        # a step's plan (a prefill's on the host, a decode's on the device) is made once, for both layers
        made = {kind: plans_made[kind] - n_plans[kind] for kind in plans_made}
        assert made == {"prefill": int(not decode_only), "decode": int(decode_only)}, (plan, made)
        if decode_only:
            o_ref = cg.decode(*x, scale, *ref, torch.tensor(pos, dtype=torch.int32), slots_t.to(torch.int32))
        else:
            cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
            o_ref, _ = cg.prefill(*x, cu, scale, *ref, pos, slots)
        assert all(torch.equal(o, o_ref) for o in outs), plan
        for s, n in plan.items():
            done[s] += n

    for S, _, S_b in layers:  # recycled slots hold garbage: has_initial_state False must start them from zeros
        S.fill_(3.0)
        S_b.fill_(-2.0)
    step({3: 40, 1: 2})
    step({3: 22, 1: 1})  # slot 3 at 62: its next decode steps fill row 63 (a fold) and row 0
    for _ in range(3):
        step({3: 1, 1: 1}, decode_only=True)
    step({3: 30, 1: 61})  # slot 1 continued across its first boundary mid-step
    for S, buf, S_b in layers:
        assert torch.equal(S[[1, 3]], ref[0][[1, 3]]) and torch.equal(S_b[[1, 3]], ref[1][[1, 3]])
        for s in (1, 3):  # the open chunk's rows, as integers (an fp32 g's low half may read as a bf16 NaN)
            rows = done[s] % C
            assert torch.equal(buf[s, :, :rows].view(torch.int16), ref[2][s, :, :rows].view(torch.int16))


if __name__ == "__main__":
    run_checks((_check_strided_slots_and_decodes,))
