"""The gated delta rule on a chunk grid anchored at each sequence's first token (``kernels.gdn_chunk_grid``), on
CPU under the Triton interpreter.

What holds to a tolerance: the boundary states against the plain-PyTorch chunk form in float64
(``boundary_states_torch``) and the outputs and final states against the token-by-token reference in float64 --
5e-6 absolute on values of order 1: fp32 arithmetic over a few chunks (measured ~2e-7), with room for the series
inverse and the cumulative decay rounding differently from the references.
What must hold exactly (``torch.equal``), because a trainer and a generator would both compute this form: a
sequence alone == the same sequence packed among others (the grid is anchored per sequence); a prefill cut at a
chunk boundary and continued from the first part's final state == one call; a chunk size the kernels cannot tile
is refused.

Runs in a subprocess with ``TRITON_INTERPRET=1``. Skipped where triton is missing.
"""

from __future__ import annotations

import importlib.util

import pytest

from triton_interp import run_checks, run_checks_under_interpreter


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_gdn_chunk_grid_under_interpreter() -> None:
    run_checks_under_interpreter(__file__)


# ------------------------------------------------------------------------------------------------
# the checks, run in the subprocess

H, HV, K, V, C = 2, 4, 16, 48, 16  # grouped value heads; V 48: two column blocks of the chain, the second masked
TOL = 5e-6


def _inputs(T: int, seed: int):  # type: ignore[no-untyped-def]
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(T, H, K, generator=g), dim=-1)
    k = F.normalize(torch.randn(T, H, K, generator=g), dim=-1)
    v = torch.randn(T, HV, V, generator=g)
    gate = -torch.rand(T, HV, generator=g) * 0.3
    beta = torch.rand(T, HV, generator=g)
    return q, k, v, gate, beta


def _check_values() -> None:
    import torch

    from titan_rl_ext.kernels import gdn_chunk_grid as cg
    from titan_rl_ext.kernels.gdn import recurrent_gated_delta_rule_torch

    cu = [0, 37, 37, 117]  # a sequence of 2 chunks + 5 tokens, an empty one, one of exactly 5 chunks
    q, k, v, g, beta = _inputs(cu[-1], seed=1)
    h0 = torch.randn(len(cu) - 1, HV, K, V, generator=torch.Generator().manual_seed(2)) * 0.1
    states_ref, final_ref = cg.boundary_states_torch(k, v, g, beta, cu, h0, chunk=C)
    states, final, cu_chunks = cg.boundary_states(k, v, g, beta, cu, h0, chunk=C)
    assert cu_chunks.tolist() == [0, 16, 32, 37, 53, 69, 85, 101, 117]
    assert (states.double() - states_ref).abs().max() < TOL
    assert (final.double() - final_ref).abs().max() < TOL
    o, fin = cg.gated_delta_rule_chunk_grid(q, k, v, g, beta, cu, 0.5, h0, chunk=C)
    o_ref, fin_ref = recurrent_gated_delta_rule_torch(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                                      torch.tensor(cu), 0.5, h0.double())
    assert (o.double() - o_ref.double()).abs().max() < TOL
    assert (fin.double() - fin_ref.double()).abs().max() < TOL
    assert torch.equal(fin[1], h0[1])  # the empty sequence keeps its state


def _check_invariance() -> None:
    import torch

    from titan_rl_ext.kernels import gdn_chunk_grid as cg

    q, k, v, g, beta = _inputs(100, seed=3)
    lens = [21, 50, 29]  # the middle sequence starts mid-chunk of the packing's own 16-token grid
    cu = [0, 21, 71, 100]
    o_all, fin_all = cg.gated_delta_rule_chunk_grid(q, k, v, g, beta, cu, 0.5, chunk=C)
    s, n = 21, lens[1]
    o_one, fin_one = cg.gated_delta_rule_chunk_grid(q[s : s + n], k[s : s + n], v[s : s + n], g[s : s + n],
                                                    beta[s : s + n], [0, n], 0.5, chunk=C)
    assert torch.equal(o_all[s : s + n], o_one) and torch.equal(fin_all[1:2], fin_one)
    # the generator's prefill cut at a chunk boundary, continued from the first part's final state
    cut = 2 * C
    o_a, fin_a = cg.gated_delta_rule_chunk_grid(q[s : s + cut], k[s : s + cut], v[s : s + cut], g[s : s + cut],
                                                beta[s : s + cut], [0, cut], 0.5, chunk=C)
    e = s + n
    o_b, fin_b = cg.gated_delta_rule_chunk_grid(q[s + cut : e], k[s + cut : e], v[s + cut : e], g[s + cut : e],
                                                beta[s + cut : e], [0, n - cut], 0.5, fin_a, chunk=C)
    assert torch.equal(torch.cat([o_a, o_b]), o_one) and torch.equal(fin_b, fin_one)
    for bad in (8, 24):
        try:
            cg.boundary_states(k, v, g, beta, cu, chunk=bad)
        except ValueError as err:
            assert "power of two" in str(err)
        else:
            raise AssertionError(f"chunk {bad} was not refused")


def _main() -> None:
    run_checks((_check_values, _check_invariance))


if __name__ == "__main__":
    _main()
