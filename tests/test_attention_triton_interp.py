"""The batch-invariant split-KV attention kernel (``titan_rl_ext.kernels.attention_triton``) under the Triton
interpreter: the trainer's packed launch, a sequence alone, paged prefill chunks and paged decode steps with
any number of split programs give one row the same bits -- at split boundaries, at positions straddling
them, across cache block sizes -- and the result is close to float64 and to the plain-PyTorch reference of
the split definition (``split_attention_reference``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_interp import run_checks, run_checks_under_interpreter  # noqa: E402


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_attention_kernel_under_interpreter() -> None:
    run_checks_under_interpreter(__file__, timeout_s=600)


def _inputs(lens: list[int], N: int, Kh: int, H: int, dtype: object, seed: int) -> tuple:
    import torch

    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q, k, v = (torch.randn(T, n, H, generator=g).to(dtype) for n in (N, Kh, Kh))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def _paged(k: object, v: object, lens: list[int], bs: int, seed: int) -> tuple:
    """A cache of block size ``bs`` holding each sequence's keys in scattered blocks; never-written slots are
    NaN, so a kernel that reads one fails every check."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n_blk = [-(-n // bs) for n in lens]
    nb = sum(n_blk) + 3
    kc = torch.full((nb, bs, *k.shape[1:]), float("nan"), dtype=k.dtype)
    vc = torch.full((nb, bs, *v.shape[1:]), float("nan"), dtype=v.dtype)
    order = torch.randperm(nb, generator=g)
    bt = torch.zeros(len(lens), max(n_blk) + 2, dtype=torch.int32)
    used = s = 0
    for i, n in enumerate(lens):
        bt[i, : n_blk[i]] = order[used : used + n_blk[i]]
        used += n_blk[i]
        pos = torch.arange(n)
        kc[bt[i, pos // bs].long(), pos % bs] = k[s : s + n]
        vc[bt[i, pos // bs].long(), pos % bs] = v[s : s + n]
        s += n
    return kc, vc, bt


def _query(o: object, q: object, cu: object, take: list[int]) -> tuple:
    """The last ``take[i]`` queries of each sequence, their ``cu_q`` and the packed launch's rows for them."""
    import torch

    ends = cu[1:].tolist()
    qs = torch.cat([q[e - t : e] for e, t in zip(ends, take)])
    want = torch.cat([o[e - t : e] for e, t in zip(ends, take)])
    cuq = torch.tensor([0, *torch.tensor(take).cumsum(0).tolist()], dtype=torch.int32)
    return qs, cuq, want


def _check_small() -> None:
    """Short sequences (one split): packed = alone = paged chunk = decode, close to float64 and to the
    reference; bf16 and fp32, GQA 2."""
    import torch

    from titan_rl_ext.kernels import attention_triton as at
    from titan_rl_ext.kernels.attention import attention_bi, causal_attention_reference, split_attention_reference

    for dtype, H in ((torch.bfloat16, 32), (torch.float32, 24)):
        N, Kh, lens = 4, 2, [70, 5, 130, 1]
        q, k, v, cu = _inputs(lens, N, Kh, H, dtype, seed=4)
        scale, sl = H**-0.5, torch.tensor(lens, dtype=torch.int32)
        o = at.bi_attention_fwd(q, k, v, cu, sl, max(lens), scale, k_start=cu[:-1].clone())
        assert o.dtype == dtype and o.shape == q.shape
        ref = causal_attention_reference(q, k, v, lens, scale)
        # bf16: p is rounded to bf16 before p @ v and the output to bf16 (the interpreter truncates: one
        # ulp, 2^-7 relative); fp32: fp32 exp/sums over <= 130 keys
        tol = 2.0**-6 if dtype == torch.bfloat16 else 1e-5
        assert (o.double() - ref).abs().max() <= tol * ref.abs().max(), (dtype, (o.double() - ref).abs().max())
        bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
        two_pass = torch.cat([attention_bi(q[s:e], k[s:e], v[s:e], 0, scale) for s, e in bounds])
        assert (o.double() - two_pass.double()).abs().max() <= 2 * tol * ref.abs().max()
        bn = at.config_for(H)[2]
        split_ref = torch.cat([split_attention_reference(q[s:e], k[s:e], v[s:e], 0, scale, split=at.SPLIT, block_n=bn)
                               for s, e in bounds])
        # same arithmetic but for the order of the row sums (numpy's vs torch's): fp32 ulps before the
        # output's rounding, so at most one output ulp apart
        assert (o.double() - split_ref.double()).abs().max() <= tol * ref.abs().max()
        for i, (s, e) in enumerate(bounds):  # each sequence alone, at row 0 of its own launch
            alone = at.bi_attention_fwd(q[s:e], k[s:e], v[s:e], torch.tensor([0, e - s], dtype=torch.int32),
                                        sl[i : i + 1], e - s, scale, k_start=torch.zeros(1, dtype=torch.int32))
            assert torch.equal(alone, o[s:e]), (dtype, i)
        kc, vc, bt = _paged(k, v, lens, 16, seed=1)
        for take in ([20, 1, 64, 1], [1, 1, 1, 1]):  # chunks (one crossing tiles) and a decode step
            qs, cuq, want = _query(o, q, cu, take)
            for progs in (None, 1, 3):
                got = at.bi_attention_fwd(qs, kc, vc, cuq, sl, max(take), scale, block_table=bt,
                                          split_programs_override=progs)
                assert torch.equal(got, want), (dtype, take, progs)
    for kwargs, msg in (({}, "exactly one"), ({"k_start": cu[:-1], "block_table": bt}, "exactly one")):
        try:
            at.bi_attention_fwd(q, k, v, cu, sl, max(lens), scale, **kwargs)
        except ValueError as e:
            assert msg in str(e)
        else:
            raise AssertionError("accepted bad arguments")
    assert "at most 64 query heads" in (at.group_problem(128, 1, 32) or "")
    assert "multiple" in (at.group_problem(6, 4, 32) or "")


def _check_splits() -> None:
    """Sequences over several splits (a split of 128 keys here, two blocks of 64): a decode query at every
    position around the boundaries and prefill chunks straddling them, through caches of block size 16, 48
    (not a power of two) and 128, with 2, 3 and 64 split programs, equal the trainer's packed launch bit
    for bit; GQA 3 (a tile of 64 rows holds 21 queries), fp32."""
    import torch

    from titan_rl_ext.kernels import attention_triton as at
    from titan_rl_ext.kernels.attention import causal_attention_reference, split_attention_reference

    saved = at.SPLIT
    at.SPLIT = 128
    try:
        # fp32 (a bf16 output's rounding would hide most fp32 differences of the fold), GQA 3: a tile of 21 queries
        # and one idle row; bf16 and GQA 2 run in the other checks
        for N, Kh, seed, dtype in ((6, 2, 7, torch.float32),):
            H = 32
            lens = [300, 129, 128, 257, 1, 384]
            q, k, v, cu = _inputs(lens, N, Kh, H, dtype, seed=seed)
            scale, sl = H**-0.5, torch.tensor(lens, dtype=torch.int32)
            o = at.bi_attention_fwd(q, k, v, cu, sl, max(lens), scale, k_start=cu[:-1].clone())
            ref = causal_attention_reference(q, k, v, lens, scale)
            tol = 2.0**-6 if dtype == torch.bfloat16 else 1e-5
            assert (o.double() - ref).abs().max() <= tol * ref.abs().max()
            s0, e0 = cu[0].item(), cu[1].item()
            split_ref = split_attention_reference(q[s0:e0], k[s0:e0], v[s0:e0], 0, scale, split=128, block_n=64)
            # a taller query tile (42 queries of GQA 3 in 128 rows) walks the same splits and blocks per row
            tall = at.bi_attention_fwd(q, k, v, cu, sl, max(lens), scale, k_start=cu[:-1].clone(),
                                       launch=at.Launch(rows=128))
            assert torch.equal(tall, o)
            assert (o[s0:e0].double() - split_ref.double()).abs().max() <= tol * ref.abs().max()
            # (cache block size, split programs per sequence and KV head): 48 is not a power of two, 64
            # programs leave most of them without a split
            for bs, progs in ((16, 2), (48, 3), (128, 64)):
                kc, vc, bt = _paged(k, v, lens, bs, seed=bs)
                for pos in (127, 128, 129, 256, 299):  # one decode query at absolute position pos
                    d_lens = [min(pos + 1, n) for n in lens]
                    d_sl = torch.tensor(d_lens, dtype=torch.int32)
                    qs = torch.cat([q[s + n - 1 : s + n] for s, n in zip(cu[:-1].tolist(), d_lens)])
                    want = torch.cat([o[s + n - 1 : s + n] for s, n in zip(cu[:-1].tolist(), d_lens)])
                    cuq = torch.arange(len(lens) + 1, dtype=torch.int32)
                    got = at.bi_attention_fwd(qs, kc, vc, cuq, d_sl, 1, scale, block_table=bt,
                                              split_programs_override=progs)
                    assert torch.equal(got, want), (N, bs, pos, progs)
                # chunks ending at each sequence's end: 5 queries straddle 128 (positions 124..128) in the
                # 129-key sequence (split-parallel: they fit a tile), then tile-crossing chunks (per tile)
                for take in ([5, 5, 5, 5, 1, 5], [40, 5, 100, 131, 1, 200]):
                    qs, cuq, want = _query(o, q, cu, take)
                    got = at.bi_attention_fwd(qs, kc, vc, cuq, sl, max(take), scale, block_table=bt,
                                              split_programs_override=progs)
                    assert torch.equal(got, want), (N, bs, take, progs)
    finally:
        at.SPLIT = saved


def _check_default_split() -> None:
    """The shipped split size: decode queries at the first split boundary and past it, split-parallel over a
    paged cache, equal the packed launch."""
    import torch

    from titan_rl_ext.kernels import attention_triton as at

    N, Kh, H, dtype = 4, 2, 16, torch.bfloat16
    S = at.SPLIT
    lens = [S + 70, S]
    q, k, v, cu = _inputs(lens, N, Kh, H, dtype, seed=9)
    scale, sl = H**-0.5, torch.tensor(lens, dtype=torch.int32)
    o = at.bi_attention_fwd(q, k, v, cu, sl, max(lens), scale, k_start=cu[:-1].clone())
    kc, vc, bt = _paged(k, v, lens, 64, seed=3)
    for pos in (S - 1, S, S + 1, S + 69):
        d_lens = [min(pos + 1, n) for n in lens]
        qs = torch.cat([q[s + n - 1 : s + n] for s, n in zip(cu[:-1].tolist(), d_lens)])
        want = torch.cat([o[s + n - 1 : s + n] for s, n in zip(cu[:-1].tolist(), d_lens)])
        got = at.bi_attention_fwd(qs, kc, vc, torch.arange(3, dtype=torch.int32), torch.tensor(d_lens, dtype=torch.int32),
                                  1, scale, block_table=bt, split_programs_override=2)
        assert torch.equal(got, want), pos


def _main() -> None:
    run_checks((_check_small, _check_splits, _check_default_split))


if __name__ == "__main__":
    _main()
