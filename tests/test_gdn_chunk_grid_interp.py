"""The chunk-grid gated delta rule (``kernels.gdn_chunk_grid``: boundary states by the chunk formula, rows by the
recurrent kernel from them): its fold kernels and the recurrent kernel on CPU under the Triton interpreter
(``UPCAST``: float64 dots rounded once to fp32, so a row's bits do not depend on numpy's BLAS).

What holds to a tolerance: the kernels against the definition in float64 without bf16 rounding
(``reference_float64``), against the token-by-token rule in fp32 (``kernels.gdn.recurrent_gated_delta_rule_torch``)
and against the same definition in plain PyTorch (``prefill_torch``, which inverts ``I + A`` by a float64
triangular solve, not the kernels' 16-row blocks): ``TOL`` 5e-2 on outputs and states of order 1, because a
boundary state is folded from bf16 tensor-core operands (k, v, ``T``, ``W``, ``U``, ``S_b``, ``delta``: 2^-9
relative each; measured ~1e-2 over two or three chunks), and a last-bit difference before such a rounding can move
it by a whole bf16 step; rows carry that error from their boundary state. The float64 definition against the
float64 chunk form of ``kernels.gdn``: 1e-10 (the same mathematics).
What must hold exactly (``torch.equal``), because a trainer and a generator both compute this form: (a) a whole
prefill == (b) decode steps (continuing a prefill mid-chunk, across the fold at rows 63/64) == (c) a prefill cut
after 1, 63, 64, 65, 130 tokens (or twice mid-chunk) and continued, for outputs, running state, boundary state,
open-chunk buffer rows and the final state; a packed batch == each sequence alone (lengths 1, 63, 64, 65, 130); a
decode batch at mixed positions (folding and not) == each sequence alone; both through an engine-style cache
(sequences in arbitrary state rows, ``slots``) == without; and the same cut/step equalities for ``prefill_torch``
(the CPU form trainer and engine run). Value heads outnumber key heads (GQA); K < V and K = V appear.

Runs in a subprocess with ``TRITON_INTERPRET=1``. Skipped where triton is missing.
"""

from __future__ import annotations

import importlib.util

import pytest

from triton_interp import reversed_program_order, run_checks, run_checks_under_interpreter


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_gdn_chunk_grid_under_interpreter() -> None:
    run_checks_under_interpreter(__file__)


# ------------------------------------------------------------------------------------------------
# the checks, run in the subprocess

TOL = 5e-2
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


def _close(a, b) -> bool:  # type: ignore[no-untyped-def]
    return bool((a.double() - b.double()).abs().max() < TOL)


def _check_values() -> None:
    import torch

    from titan_rl_ext.kernels import gdn_chunk_grid as cg
    from titan_rl_ext.kernels.gdn import chunk_gated_delta_rule_torch, recurrent_gated_delta_rule_torch

    heads = (2, 4, 16, 32)  # GQA, K < V
    cu = [0, 70, 70, 134]  # a chunk + 6 tokens, an empty sequence, two chunks + 6
    x = _inputs(cu[-1], heads, seed=1)
    h0 = torch.randn(3, heads[1], heads[2], heads[3], generator=torch.Generator().manual_seed(2)) * 0.1
    st = cg.new_state(3, *heads[1:], initial_state=h0)
    o, fin = cg.prefill(*x, cu, SCALE, *st)
    o64, fin64 = cg.reference_float64(*x, cu, SCALE, h0)
    assert _close(o, o64) and _close(fin, fin64)
    # the definition is the gated delta rule's chunk form: float64 against float64, rounding only
    x64 = [t.double() for t in x]
    o_c, fin_c = chunk_gated_delta_rule_torch(*x64, torch.tensor(cu), SCALE, h0.double(), chunk_size=cg.CHUNK,
                                              compute_dtype=torch.float64)
    assert (o64 - o_c).abs().max() < 1e-10 and (fin64 - fin_c).abs().max() < 1e-10
    o_r, fin_r = recurrent_gated_delta_rule_torch(*x, torch.tensor(cu), SCALE, h0)
    assert _close(o, o_r) and _close(fin, fin_r)
    # the empty sequence keeps its state
    assert torch.equal(fin[1], h0[1]) and torch.equal(st[0][1], h0[1]) and torch.equal(st[1][1], h0[1])
    st_t = cg.new_state(3, *heads[1:], initial_state=h0)
    o_t, fin_t = cg.prefill_torch(*x, cu, SCALE, *st_t)
    assert _close(o_t, o) and _close(fin_t, fin) and _close(st_t[1], st[1])
    # sequence 0's open rows' g and beta (fp32 copies; k, v differ in rounding: the interpreter casts to bf16 by
    # truncation)
    L = cg.row_layout(*heads[2:])
    assert torch.equal(st_t[2][0, :, :6, L["G"]:].view(torch.int16), st[2][0, :, :6, L["G"]:].view(torch.int16))
    for bad in ((2, 4, 24, 32), (2, 3, 16, 32)):  # K not a power of two; HV not a multiple of H
        try:
            cg.prefill(*_inputs(4, bad, 0), [0, 4], SCALE, *cg.new_state(1, *bad[1:]))
        except ValueError:
            pass
        else:
            raise AssertionError(f"heads {bad} were not refused")


def _equal_states(a: tuple, b: tuple, n_open: int) -> bool:  # type: ignore[type-arg]
    """(S_run, S_b, buffer) triples: both states and the open chunk's rows bit for bit (rows beyond are stale;
    compared as integers: an fp32 g's low half may read as a bf16 NaN)."""
    import torch

    return (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            and torch.equal(a[2][:, :, :n_open].view(torch.int16), b[2][:, :, :n_open].view(torch.int16)))


def _rows(st: tuple, sl) -> tuple:  # type: ignore[no-untyped-def,type-arg]
    """State rows ``sl`` of each tensor of a state triple (cloned: ``_equal_states`` of a later step)."""
    return tuple(t[sl].clone() for t in st)


def _check_one_sequence(prefill, decode, heads: tuple[int, int, int, int], T: int,  # type: ignore[no-untyped-def]
                        cuts: list[list[int]], decoded: tuple[int, int] | None) -> None:
    """(a) == (b) == (c) on one sequence from a random state: every way of cutting it in ``cuts`` (prefill pieces),
    and a prefill interrupted by ``decode`` steps at ``decoded = (first, last)`` tokens."""
    import torch

    from titan_rl_ext.kernels import gdn_chunk_grid as cg

    C = cg.CHUNK
    x = _inputs(T, heads, seed=T)
    h0 = torch.randn(1, *heads[1:2], heads[2], heads[3], generator=torch.Generator().manual_seed(5)) * 0.1
    whole = cg.new_state(1, *heads[1:], initial_state=h0)
    o_w, fin_w = prefill(*x, [0, T], SCALE, *whole)
    for bounds in cuts:
        st = cg.new_state(1, *heads[1:], initial_state=h0)
        parts = []
        for lo, hi in zip([0, *bounds], [*bounds, T]):
            o_p, fin_p = prefill(*(t[lo:hi] for t in x), [0, hi - lo], SCALE, *st, pos=[lo])
            parts.append(o_p)
        assert torch.equal(torch.cat(parts), o_w) and torch.equal(fin_p, fin_w), bounds
        assert _equal_states(st, whole, T % C), bounds
    if decoded is None:
        return
    d0, d1 = decoded
    st = cg.new_state(1, *heads[1:], initial_state=h0)
    parts = [prefill(*(t[:d0] for t in x), [0, d0], SCALE, *st)[0]]
    for p in range(d0, d1):
        parts.append(decode(*(t[p:p + 1] for t in x), SCALE, *st, torch.tensor([p])))
    o_e, fin_e = prefill(*(t[d1:] for t in x), [0, T - d1], SCALE, *st, pos=[d1])
    assert torch.equal(torch.cat([*parts, o_e]), o_w) and torch.equal(fin_e, fin_w)
    assert _equal_states(st, whole, T % C)


def _check_cuts_and_decodes() -> None:
    from titan_rl_ext.kernels import gdn_chunk_grid as cg

    # 140 tokens = 2 chunks + 12: cut after 1, 63, 64, 65, 130 tokens, or twice mid-chunk; decode steps across the
    # fold at token 63
    _check_one_sequence(cg.prefill, cg.decode, (1, 2, 16, 16), 140, [[1, 63, 64, 65, 130], [30, 100]], (60, 66))


def _check_cuts_in_reversed_program_order() -> None:
    from titan_rl_ext.kernels import gdn_chunk_grid as cg

    # the launches' programs last to first: a call continuing one open chunk and ending in another must not read
    # rows that a later program of the same launch writes (a GPU runs them in no set order)
    with reversed_program_order() as launches:
        _check_one_sequence(cg.prefill, cg.decode, (1, 2, 16, 16), 140, [[65, 130]], (60, 66))
    assert launches, "no launch ran in reversed order"


def _check_cuts_torch() -> None:
    from titan_rl_ext.kernels import gdn_chunk_grid as cg

    # the plain-PyTorch form: cut anywhere, or one token at a time across the fold (its decode steps)
    _check_one_sequence(cg.prefill_torch, None, (2, 4, 16, 32), 140, [[1, 63, 64, 65, 130], list(range(58, 70))],
                        None)


def _check_packed_and_decode_batch() -> None:
    """Lengths 1, 63, 64, 65, 130 packed == each alone; then one decode batch at mixed positions == each alone."""
    import torch

    from titan_rl_ext.kernels import gdn_chunk_grid as cg

    heads, C = (1, 2, 16, 16), cg.CHUNK
    lens = [1, 63, 64, 65, 130]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    x = _inputs(cu[-1], heads, seed=7)
    st = cg.new_state(len(lens), *heads[1:])
    o, fin = cg.prefill(*x, cu, SCALE, *st)
    for n, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
        one = cg.new_state(1, *heads[1:])
        o_1, fin_1 = cg.prefill(*(t[lo:hi] for t in x), [0, hi - lo], SCALE, *one)
        assert torch.equal(o[lo:hi], o_1) and torch.equal(fin[n:n + 1], fin_1), n
        assert _equal_states(_rows(st, slice(n, n + 1)), one, lens[n] % C), n
    # one more token for every sequence, in one call (rows 1, 63 -> a fold, 0, 1, 2 of their open chunks)
    y = _inputs(len(lens), heads, seed=8)
    pos = torch.tensor(lens)
    batch = _rows(st, slice(None))
    o_b = cg.decode(*y, SCALE, *batch, pos)
    for n in range(len(lens)):
        one = _rows(st, slice(n, n + 1))
        o_1 = cg.decode(*(t[n:n + 1] for t in y), SCALE, *one, pos[n:n + 1])
        assert torch.equal(o_b[n:n + 1], o_1), n
        assert _equal_states(_rows(batch, slice(n, n + 1)), one, (lens[n] + 1) % C), n
    assert torch.equal(batch[0][1], batch[1][1])  # row 63 folded: the running state restarts at the boundary
    # the same through an engine-style cache: sequence n in row slots[n] of 7 (rows 2 and 4 another's)
    slots = [5, 0, 3, 6, 1]
    cache = cg.new_state(7, *heads[1:])
    o_s, fin_s = cg.prefill(*x, cu, SCALE, *cache, slots=slots)
    assert torch.equal(o_s, o) and torch.equal(fin_s, fin)
    o_bs = cg.decode(*y, SCALE, *cache, pos, torch.tensor(slots, dtype=torch.int32))
    assert torch.equal(o_bs, o_b)
    for n, sl in enumerate(slots):
        assert _equal_states(_rows(cache, slice(sl, sl + 1)), _rows(batch, slice(n, n + 1)), (lens[n] + 1) % C), n
    assert not any(t[[2, 4]].any() for t in cache)  # untouched


def _main() -> None:
    run_checks((_check_values, _check_cuts_and_decodes, _check_cuts_in_reversed_program_order, _check_cuts_torch,
                _check_packed_and_decode_batch))


if __name__ == "__main__":
    _main()
