"""The chunk-grid gated delta rule (``kernels.gdn_chunk_grid``): its prefill, decode and continued-prefill kernels
on CPU under the Triton interpreter.

What holds to a tolerance (values of order 1, a few chunks): the kernels against the definition in float64
(``reference_float64``), 2e-6 -- fp32 rounding over a few chunks measures ~2e-7, with room for the sequential
cumulative decay and the substitution rounding differently from the float64 triangular solves -- and against the
token-by-token rule in fp32 (``kernels.gdn.recurrent_gated_delta_rule_torch``), 2e-6 likewise (two fp32 forms of
one recurrence); the float64 definition against the float64 chunk form of ``kernels.gdn``, 1e-12 (the same
mathematics: float64 rounding only).
What must hold exactly (``torch.equal``), because a trainer and a generator both compute this form: (a) a whole
prefill == (b) decode steps (from the first token, and continuing a prefill mid-chunk, across folds) == (c) a
prefill cut anywhere (chunk boundaries, mid-chunk, after one token) and continued, for outputs, boundary state, open-chunk buffer rows and the
final state; a packed batch == each sequence alone; a decode batch at mixed positions == each sequence alone; both
through an engine-style cache (sequences in arbitrary state rows, ``slots``) == without; the
plain-PyTorch fixed-order form == the kernels given the interpreter's exp (numpy's, which rounds differently
from torch's). Both the shipped chunk (64) and a small one (16, more chunks per sequence) run; value heads
outnumber key heads (GQA); K < V, K > V and K = V all appear.

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

TOL = 2e-6
SCALE = 0.25


def _inputs(T: int, heads: tuple[int, int, int, int], seed: int):  # type: ignore[no-untyped-def]
    import torch
    import torch.nn.functional as F

    H, HV, K, V = heads
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(T, H, K, generator=g), dim=-1)
    k = F.normalize(torch.randn(T, H, K, generator=g), dim=-1)
    v = torch.randn(T, HV, V, generator=g)
    gate = -torch.rand(T, HV, generator=g) * 0.3
    beta = torch.rand(T, HV, generator=g)
    return q, k, v, gate, beta


def _np_exp(x):  # type: ignore[no-untyped-def]
    import numpy as np
    import torch

    return torch.from_numpy(np.exp(x.numpy()))


def _check_values() -> None:
    import torch

    from titan_rl_ext.kernels import gdn_chunk_grid as cg
    from titan_rl_ext.kernels.gdn import chunk_gated_delta_rule_torch, recurrent_gated_delta_rule_torch

    # K 16 < V 64: [w | u] is 128 columns, the substitution's two 64-column blocks
    heads, C = (2, 4, 16, 64), 16
    cu = [0, 37, 37, 69]  # 2 chunks + 5 tokens, an empty sequence, exactly 2 chunks
    x = _inputs(cu[-1], heads, seed=1)
    h0 = torch.randn(3, heads[1], heads[2], heads[3], generator=torch.Generator().manual_seed(2)) * 0.1
    S, buf = cg.new_state(3, *heads[1:], chunk=C, initial_state=h0)
    o, fin = cg.prefill(*x, cu, SCALE, S, buf)
    o64, fin64 = cg.reference_float64(*x, cu, SCALE, h0, chunk=C)
    assert (o.double() - o64).abs().max() < TOL and (fin.double() - fin64).abs().max() < TOL
    # the definition is the gated delta rule's chunk form: float64 against float64, rounding only
    x64 = [t.double() for t in x]
    o_c, fin_c = chunk_gated_delta_rule_torch(*x64, torch.tensor(cu), SCALE, h0.double(), chunk_size=C,
                                              compute_dtype=torch.float64)
    assert (o64 - o_c).abs().max() < 1e-12 and (fin64 - fin_c).abs().max() < 1e-12
    o_r, fin_r = recurrent_gated_delta_rule_torch(*x, torch.tensor(cu), SCALE, h0)
    assert (o - o_r).abs().max() < TOL and (fin - fin_r).abs().max() < TOL
    assert torch.equal(fin[1], h0[1]) and torch.equal(S[1], h0[1])  # the empty sequence keeps its state
    assert torch.equal(S[2], fin[2])  # ended on a chunk boundary: the boundary state is the final state
    # the plain-PyTorch fixed order: the kernels' bits with the interpreter's exp
    S_t, buf_t = cg.new_state(3, *heads[1:], chunk=C, initial_state=h0)
    o_t = cg.prefill_torch(*x, cu, SCALE, S_t, buf_t, exp=_np_exp)
    assert torch.equal(o_t, o) and torch.equal(S_t, S) and torch.equal(buf_t[0, :, :5, :-3], buf[0, :, :5, :-3])
    for bad in ((2, 4, 24, 32), (2, 3, 16, 32)):  # K not a power of two; HV not a multiple of H
        try:
            cg.prefill(*_inputs(4, bad, 0), [0, 4], SCALE, *cg.new_state(1, *bad[1:], chunk=C))
        except ValueError:
            pass
        else:
            raise AssertionError(f"heads {bad} were not refused")


def _equal_states(a: tuple, b: tuple, n_open: int) -> bool:  # type: ignore[type-arg]
    """(S, buffer) pairs: S and the open chunk's rows bit for bit (not the rows' 3 pad columns: never written)."""
    import torch

    return torch.equal(a[0], b[0]) and torch.equal(a[1][:, :, :n_open, :-3], b[1][:, :, :n_open, :-3])


def _check_one_sequence(C: int, heads: tuple[int, int, int, int], T: int, cuts: list[list[int]],
                        decoded: tuple[int, int]) -> None:
    """(a) == (b) == (c) on one sequence from a random state: every way of cutting it in ``cuts`` (prefill pieces),
    and a prefill interrupted by decode steps at ``decoded = (first, last)`` tokens."""
    import torch

    from titan_rl_ext.kernels import gdn_chunk_grid as cg

    x = _inputs(T, heads, seed=T + C)
    h0 = torch.randn(1, *heads[1:2], heads[2], heads[3], generator=torch.Generator().manual_seed(5)) * 0.1
    whole = cg.new_state(1, *heads[1:], chunk=C, initial_state=h0)
    o_w, fin_w = cg.prefill(*x, [0, T], SCALE, *whole)
    for bounds in cuts:
        st = cg.new_state(1, *heads[1:], chunk=C, initial_state=h0)
        parts = []
        for lo, hi in zip([0, *bounds], [*bounds, T]):
            o_p, fin_p = cg.prefill(*(t[lo:hi] for t in x), [0, hi - lo], SCALE, *st, pos=[lo])
            parts.append(o_p)
        assert torch.equal(torch.cat(parts), o_w) and torch.equal(fin_p, fin_w), bounds
        assert _equal_states(st, whole, T % C), bounds
    # prefill, decode steps, prefill again
    d0, d1 = decoded
    st = cg.new_state(1, *heads[1:], chunk=C, initial_state=h0)
    parts = [cg.prefill(*(t[:d0] for t in x), [0, d0], SCALE, *st)[0]]
    for p in range(d0, d1):
        parts.append(cg.decode(*(t[p:p + 1] for t in x), SCALE, *st, torch.tensor([p])))
    o_e, fin_e = cg.prefill(*(t[d1:] for t in x), [0, T - d1], SCALE, *st, pos=[d1])
    assert torch.equal(torch.cat([*parts, o_e]), o_w) and torch.equal(fin_e, fin_w)
    assert _equal_states(st, whole, T % C)
    # the plain-PyTorch fixed order, token by token (the interpreter's exp)
    st_t = cg.new_state(1, *heads[1:], chunk=C, initial_state=h0)
    assert torch.equal(cg.prefill_torch(*x, [0, T], SCALE, *st_t, exp=_np_exp), o_w)
    assert _equal_states(st_t, whole, T % C)


def _check_cuts_chunk16() -> None:
    # 70 tokens: 4 chunks + 6; cut after one token, at chunk boundaries, just before / after one, mid-chunk;
    # decode steps from the first token across a fold
    _check_one_sequence(16, (1, 2, 32, 16), 70, [[1, 16, 50], [15, 17, 32, 69]], (0, 19))  # K 32 > V 16


def _check_cuts_chunk64() -> None:
    # the shipped chunk: 130 tokens = 2 chunks + 2, cut after 1, 63, 64, 65 tokens, or twice mid-chunk; decode
    # steps across the fold at token 63
    _check_one_sequence(64, (1, 2, 16, 16), 130, [[1, 63, 64, 65], [30, 100]], (61, 66))


def _check_packed_and_decode_batch() -> None:
    """Lengths 1, 63, 64, 65, 130 packed == each alone; then one decode batch at mixed positions == each alone."""
    import torch

    from titan_rl_ext.kernels import gdn_chunk_grid as cg

    heads, C = (1, 2, 16, 16), 64
    lens = [1, 63, 64, 65, 130]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    x = _inputs(cu[-1], heads, seed=7)
    st = cg.new_state(len(lens), *heads[1:], chunk=C)
    o, fin = cg.prefill(*x, cu, SCALE, *st)
    for n, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
        one = cg.new_state(1, *heads[1:], chunk=C)
        o_1, fin_1 = cg.prefill(*(t[lo:hi] for t in x), [0, hi - lo], SCALE, *one)
        assert torch.equal(o[lo:hi], o_1) and torch.equal(fin[n:n + 1], fin_1), n
        assert _equal_states((st[0][n:n + 1], st[1][n:n + 1]), one, lens[n] % C), n
    # one more token for every sequence, in one call (rows 1, 63 -> a fold, 0, 1, 2 of their open chunks)
    y = _inputs(len(lens), heads, seed=8)
    pos = torch.tensor(lens)
    batch = (st[0].clone(), st[1].clone())
    o_b = cg.decode(*y, SCALE, *batch, pos)
    for n in (1, 2):  # alone: rows 63 (a fold) and 0
        one = (st[0][n:n + 1].clone(), st[1][n:n + 1].clone())
        o_1 = cg.decode(*(t[n:n + 1] for t in y), SCALE, *one, pos[n:n + 1])
        assert torch.equal(o_b[n:n + 1], o_1), n
        assert _equal_states((batch[0][n:n + 1], batch[1][n:n + 1]), one, (lens[n] + 1) % C), n
    # the same through an engine-style cache: sequence n in row slots[n] of 7 (rows 2 and 4 another's)
    slots = [5, 0, 3, 6, 1]
    cache = cg.new_state(7, *heads[1:], chunk=C)
    o_s, fin_s = cg.prefill(*x, cu, SCALE, *cache, slots=slots)
    assert torch.equal(o_s, o) and torch.equal(fin_s, fin)
    o_bs = cg.decode(*y, SCALE, *cache, pos, torch.tensor(slots, dtype=torch.int32))
    assert torch.equal(o_bs, o_b)
    for n, sl in enumerate(slots):
        assert _equal_states((cache[0][sl:sl + 1], cache[1][sl:sl + 1]), (batch[0][n:n + 1], batch[1][n:n + 1]),
                             (lens[n] + 1) % C), n
    assert not cache[0][[2, 4]].any()  # untouched


def _main() -> None:
    run_checks((_check_values, _check_cuts_chunk16, _check_cuts_chunk64, _check_packed_and_decode_batch))


if __name__ == "__main__":
    _main()
