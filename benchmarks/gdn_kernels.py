"""Issue 8, benchmark 2: gated-delta-rule kernels on Qwen3.5-9B GDN shapes (16 qk heads, 32 v heads, dim 128).

    python benchmarks/gdn_kernels.py [--lengths 1000,3000,2500,1692] [--out gdn.json]
    python benchmarks/gdn_kernels.py --smoke          # tiny heads and lengths, CPU, torch kernels only

One GDN layer's token mixing over T packed tokens (default 8192 = 1000+3000+2500+1692), inputs as
``GatedDeltaNet`` hands them to its rule kernel (q/k fp32 L2-normalised, v/beta bf16, g fp32, no initial
state: the trainer's case). Variants, each timed in two interleaved rounds (median of reps each):

forward (no grad)
  rec_fla      FLA fused recurrent              -- BI forward (trainer, prefill and decode)
  chunk_fla    FLA chunk                        -- non-BI forward
  chunk_torch  torch chunked (WY) form          -- BI's backward recompute where FLA's is kept off
  rec_torch    torch token-by-token reference   -- only when FLA is absent (CPU smoke)
backward only (graph built once, ``autograd.grad(..., retain_graph=True)`` timed)
  bwd_bi       ``gated_delta_rule_bi``'s backward (FLA chunk recompute + backward on CUDA, the torch chunked form with
               ``TITAN_FLA_CHUNK_BWD=0``) -- what the BI trainer runs
  bwd_fla      FLA chunk backward               -- what the non-BI trainer runs
fwd + bwd pairs (one training step of the mixer)
  pair_bi        ``gated_delta_rule_bi``: recurrent FLA fwd + its backward above  (BI trainer)
  pair_chunk     FLA chunk fwd + FLA chunk bwd                                    (non-BI trainer)
  pair_rec_flabwd  recurrent FLA fwd + FLA chunk bwd, without the recompute's autograd graph

FLA issue #640: fla-core 0.6.0 refuses its gated chunk backward (``chunk_bwd_dqkwg``) on Hopper with
Triton >= 3.4 and < 3.7.1 (wrong results reported upstream). The project overrides that guard
(``kernels.gdn.allow_fla_chunk_backward``; float64 gradient checks in ``tests/gpu/test_bi_kernels_cuda.py``);
``--no-guard-override`` keeps it for this process. This script also checks the gradients against the torch
chunked form (fp32) at the benchmark shape.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common (it also puts the repo root on sys.path)
from bench_common import Timer, add_timing_args, base_parser, env_summary, environment  # noqa: E402
from bench_common import fla_chunk_bwd_guard, fmt_table, print_header, resolve_device, two_rounds, write_json  # noqa: E402

from titan_rl_ext.kernels.gdn import (  # noqa: E402
    chunk_gated_delta_rule_torch,
    fla_available,
    gated_delta_rule,
    gated_delta_rule_bi,
)

GUARD_OVERRIDDEN = "OVERRIDDEN (FLA #640: Hopper + Triton < 3.7.1; gradients checked against the torch chunked form below)"


class RecurrentFwdFlaChunkBwd(torch.autograd.Function):
    """Not in the repo: BI's recurrent forward with FLA's chunk backward (recompute chunk forward, then
    FLA's backward kernels) -- measures what ``_RecurrentForwardChunkBackward`` would cost on FLA.
    Output only (the trainer never uses the final state)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, cu_seqlens, scale):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            o, _ = gated_delta_rule(q, k, v, g, beta, cu_seqlens, scale, None, "recurrent", "fla")
        ctx.save_for_backward(q, k, v, g, beta, cu_seqlens)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, d_o):  # type: ignore[no-untyped-def]
        q, k, v, g, beta, cu = ctx.saved_tensors
        ins = [t.detach().requires_grad_(True) for t in (q, k, v, g, beta)]
        with torch.enable_grad():
            o, _ = gated_delta_rule(*ins, cu, ctx.scale, None, "chunk", "fla")
            grads = torch.autograd.grad(o, ins, d_o)
        return (*grads, None, None)


def make_inputs(lengths: list[int], H: int, HV: int, K: int, V: int, dev: torch.device, seed: int = 0) -> dict[str, Any]:
    """Dtypes as ``GatedDeltaNet.forward`` produces them: q/k fp32 after l2norm, v bf16 from the conv,
    beta bf16 (sigmoid of a bf16 projection), g fp32 (decay in log space; the tests' range)."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    T = sum(lengths)
    q = F.normalize(torch.randn(T, H, K, device=dev, generator=gen), dim=-1)
    k = F.normalize(torch.randn(T, H, K, device=dev, generator=gen), dim=-1)
    v = torch.randn(T, HV, V, device=dev, generator=gen).bfloat16()
    g = -torch.rand(T, HV, device=dev, generator=gen) * 0.5
    beta = torch.rand(T, HV, device=dev, generator=gen).bfloat16()
    d_o = torch.randn(T, HV, V, device=dev, generator=gen).bfloat16()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    return dict(q=q, k=k, v=v, g=g, beta=beta, d_o=d_o, cu=cu, scale=K**-0.5)


def leaves(x: dict[str, Any]) -> list[torch.Tensor]:
    return [x[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main() -> int:
    ap = base_parser(__doc__, "H=2, HV=4, K=V=32, 256 tokens: CPU check (torch kernels)")
    ap.add_argument("--lengths", default="1000,3000,2500,1692", help="packed sequence lengths")
    ap.add_argument("--heads", default="16,32,128,128", help="qk heads, v heads, k dim, v dim (9B)")
    ap.add_argument("--no-guard-override", action="store_true", help="leave FLA's #640 guard in place")
    add_timing_args(ap, warmup=3, reps=15, max_s=2.0)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = resolve_device(ap, args)
    if args.smoke:
        lengths, (H, HV, K, V) = [40, 100, 70, 46], (2, 4, 32, 32)
        args.reps, args.warmup = 3, 1
    else:
        lengths = [int(n) for n in args.lengths.split(",")]
        H, HV, K, V = (int(n) for n in args.heads.split(","))
    T, N = sum(lengths), len(lengths)
    use_fla = dev.type == "cuda" and fla_available()
    guard = fla_chunk_bwd_guard(not args.no_guard_override, GUARD_OVERRIDDEN) if use_fla else "n/a (FLA not used)"
    env = environment(dev)
    env.update(fla_used=use_fla, fla_chunk_bwd_guard=guard)
    print_header(f"gdn_kernels: T={T} packed from {lengths}, H={H} HV={HV} K={K} V={V}", env)
    fla_bwd_ok = use_fla and not guard.startswith("ACTIVE")
    be = "fla" if use_fla else "torch"
    x = make_inputs(lengths, H, HV, K, V, dev)
    cu, scale, d_o = x["cu"], x["scale"], x["d_o"]
    ins = [x[n] for n in ("q", "k", "v", "g", "beta")]

    # ---- variants ---------------------------------------------------------------------------------
    fwd: dict[str, Callable[[], Any]] = {}
    if use_fla:
        fwd["rec_fla"] = lambda: gated_delta_rule(*ins, cu, scale, None, "recurrent", "fla")
        fwd["chunk_fla"] = lambda: gated_delta_rule(*ins, cu, scale, None, "chunk", "fla")
    else:
        fwd["rec_torch"] = lambda: gated_delta_rule(*ins, cu, scale, None, "recurrent", "torch")
    fwd["chunk_torch"] = lambda: chunk_gated_delta_rule_torch(*ins, cu, scale)

    def bwd_only(forward: Callable[[list[torch.Tensor]], torch.Tensor]) -> Callable[[], Any]:
        lv = leaves(x)
        o = forward(lv)  # graph kept (retain_graph) so each call times the backward alone

        def run() -> Any:
            return torch.autograd.grad(o, lv, d_o, retain_graph=True)
        return run

    def pair(forward: Callable[[list[torch.Tensor]], torch.Tensor]) -> Callable[[], Any]:
        lv = leaves(x)

        def run() -> Any:
            return torch.autograd.grad(forward(lv), lv, d_o)
        return run

    f_bi = lambda lv: gated_delta_rule_bi(*lv, cu, scale, None, backend=be)[0]  # noqa: E731
    f_chunk = lambda lv: gated_delta_rule(*lv, cu, scale, None, "chunk", be)[0]  # noqa: E731
    f_rec_flabwd = lambda lv: RecurrentFwdFlaChunkBwd.apply(*lv, cu, scale)  # noqa: E731
    with torch.no_grad():
        for fn in fwd.values():  # compile / autotune before building graphs
            fn()
    bwd: dict[str, Callable[[], Any]] = {"bwd_bi": bwd_only(f_bi)}
    pairs: dict[str, Callable[[], Any]] = {"pair_bi": pair(f_bi)}
    if fla_bwd_ok:
        bwd["bwd_fla"] = bwd_only(f_chunk)
        pairs["pair_chunk"] = pair(f_chunk)
        pairs["pair_rec_flabwd"] = pair(f_rec_flabwd)
    elif not use_fla:
        pairs["pair_chunk_torch"] = pair(f_chunk)  # torch chunked fwd + autograd bwd

    # ---- checks -----------------------------------------------------------------------------------
    checks: dict[str, Any] = {}
    with torch.no_grad():
        o_rec, s_rec = gated_delta_rule(*ins, cu, scale, None, "recurrent", be)
        o_chk, s_chk = gated_delta_rule(*ins, cu, scale, None, "chunk", be)
        checks["fwd_rec_vs_chunk_rel"] = rel(o_rec, o_chk)
        checks["state_rec_vs_chunk_rel"] = rel(s_rec, s_chk)
        # BI sanity: the recurrent (BI) forward of one sequence alone equals its rows in the packed call
        a, b = int(cu[1]), int(cu[2])
        one = torch.tensor([0, b - a], dtype=torch.int32, device=dev)
        o_one, _ = gated_delta_rule_bi(*(t[a:b] for t in ins), one, scale, None, backend=be)
        o_bi, _ = gated_delta_rule_bi(*ins, cu, scale, None, backend=be)
        checks["bi_seq1_alone_equals_packed"] = bool(torch.equal(o_one, o_bi[a:b]))
    lv = leaves(x)
    g_bi = torch.autograd.grad(f_bi(lv), lv, d_o)
    checks["grads_finite"] = bool(all(torch.isfinite(t).all() for t in g_bi))
    del g_bi, lv
    if fla_bwd_ok:
        # FLA runs q/k in bf16 (the wrapper casts them) with bf16 intermediates; the reference is the fp32 torch
        # chunked form at the same bf16-rounded q/k, so the differences left are FLA's own rounding (~1e-2)
        # -- the #640 miscompile, where it bites, gives O(1) errors.
        lv_ref = [t.detach().clone().requires_grad_(True) for t in
                  (x["q"].bfloat16().float(), x["k"].bfloat16().float(), x["v"], x["g"], x["beta"])]
        o_ref = chunk_gated_delta_rule_torch(*lv_ref, cu, scale)[0]
        g_ref = torch.autograd.grad(o_ref, lv_ref, d_o)
        lv2 = leaves(x)
        o_fla = f_chunk(lv2)
        g_fla = torch.autograd.grad(o_fla, lv2, d_o)
        checks["fwd_fla_chunk_vs_torch_fp32_rel"] = rel(o_fla.detach(), o_ref.detach())
        checks["grad_fla_chunk_vs_torch_fp32_rel"] = {n: rel(a_, b_) for n, a_, b_ in zip("q k v g beta".split(), g_fla, g_ref)}
        del g_fla, g_ref, lv2, lv_ref, o_ref, o_fla
    print("checks: " + json.dumps(checks), flush=True)

    # ---- timing: two interleaved rounds ------------------------------------------------------------
    timer = Timer(dev)
    groups = {"fwd": fwd, "bwd": bwd, "pair": pairs}
    med: dict[str, list[float]] = {n: [] for g in groups.values() for n in g}
    t0 = time.perf_counter()
    for rnd in range(2):
        for g in groups.values():
            for name, fn in g.items():
                ctx = torch.no_grad() if name in fwd else torch.enable_grad()
                with ctx:
                    t = timer.run(fn, warmup=args.warmup if rnd == 0 else 1, reps=args.reps, max_s=args.max_s)
                med[name].append(statistics.median(t))
                print(f"  round {rnd + 1} {name:<16} {med[name][-1]:9.3f} ms  ({len(t)} reps)", flush=True)
    wall = time.perf_counter() - t0

    # ---- FLOP / byte floors (approximate: counts of the chunked form's matmuls, minimal tensor traffic) --
    C = 64
    chunk_fwd_flops = T * HV * (4 * C * K + C * (V + K) + 2 * C * V + 6 * K * V)  # per token: kk,qk,solve,qk@u,w@S,q@S,kTu
    rec_fwd_flops = T * HV * 7 * K * V  # decay, k^T S, rank-1 update, S^T q
    io_bytes = T * (2 * H * K * 2 + HV * V * 2 * 2 + HV * (4 + 2)) + N * HV * K * V * 4  # q,k,v,o,g,beta (+ final state)
    desc = {
        "rec_fla": ("fwd", "FLA fused recurrent [BI fwd]", rec_fwd_flops),
        "rec_torch": ("fwd", "torch recurrent reference", rec_fwd_flops),
        "chunk_fla": ("fwd", "FLA chunk [non-BI fwd]", chunk_fwd_flops),
        "chunk_torch": ("fwd", "torch chunked (BI bwd recompute without FLA)", chunk_fwd_flops),
        "bwd_bi": ("bwd", "BI bwd: torch chunked recompute+autograd [BI trainer]", 2 * chunk_fwd_flops),
        "bwd_fla": ("bwd", "FLA chunk bwd [non-BI trainer]", 2 * chunk_fwd_flops),
        "pair_bi": ("fwd+bwd", f"recurrent {be} fwd + torch chunked bwd [BI trainer]", 3 * chunk_fwd_flops),
        "pair_chunk": ("fwd+bwd", "FLA chunk fwd + FLA chunk bwd [non-BI trainer]", 3 * chunk_fwd_flops),
        "pair_chunk_torch": ("fwd+bwd", "torch chunked fwd + autograd bwd", 3 * chunk_fwd_flops),
        "pair_rec_flabwd": ("fwd+bwd", "recurrent FLA + FLA chunk bwd [candidate, not in repo]", 3 * chunk_fwd_flops),
    }
    rows = []
    for name, m in med.items():
        kind, what, flops = desc[name]
        r = two_rounds(m)
        ms = r["ms"]
        rows.append({"variant": name, "kind": kind, "what": what, **r, "tokens_per_s": T / ms * 1e3,
                     "gflops_est": flops / 1e9, "tflops_est": flops / ms / 1e9, "gbs_min_io": io_bytes / ms / 1e6,
                     "us_per_seq_step": (ms * 1e3 / max(lengths)) if name.startswith("rec") else None})

    def ratio(a: str, b: str) -> float | None:
        return statistics.mean(med[a]) / statistics.mean(med[b]) if a in med and b in med else None

    ratios = {
        "fwd recurrent / chunk (FLA)": ratio("rec_fla", "chunk_fla"),
        "fwd recurrent / chunk (torch)": ratio("rec_torch", "chunk_torch"),
        "bwd BI (torch chunked) / FLA chunk": ratio("bwd_bi", "bwd_fla"),
        "pair BI / pair chunk (FLA)": ratio("pair_bi", "pair_chunk"),
        "pair BI / pair chunk (torch)": ratio("pair_bi", "pair_chunk_torch"),
        "pair candidate (rec fwd + FLA bwd) / pair chunk": ratio("pair_rec_flabwd", "pair_chunk"),
        "pair BI / pair candidate": ratio("pair_bi", "pair_rec_flabwd"),
    }
    ratios = {k: v for k, v in ratios.items() if v is not None}

    print(f"\nSUMMARY gdn_kernels  T={T} {lengths} H={H} HV={HV} K={K} V={V}  "
          f"{env_summary(env)}")
    print(f"    FLA #640 guard: {guard}")
    print(f"    BI trainer = recurrent {be} forward + torch chunked backward (titan_rl_ext.kernels.gdn."
          "_RecurrentForwardChunkBackward); FLA's backward is never used by the repo.")
    print(fmt_table(rows, [
        ("variant", "variant", ""), ("kind", "kind", ""), ("ms_r1", "r1 ms", ".3f"), ("ms_r2", "r2 ms", ".3f"),
        ("spread_pct", "spread%", ".1f"), ("tokens_per_s", "tok/s", ".3g"), ("tflops_est", "~TF/s", ".2f"),
        ("gbs_min_io", "minIO GB/s", ".0f"), ("us_per_seq_step", "us/step", ".2f"), ("what", "what", ""),
    ]))
    print("ratios (time, >1 = first slower): " + "; ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    print("checks: " + json.dumps(checks))
    print("    (~TF/s from the chunked form's matmul count; us/step = recurrent time / longest sequence: the "
          "sequential-latency floor of a token-by-token kernel)")
    bad = []
    if not checks["bi_seq1_alone_equals_packed"]:
        bad.append("BI recurrent forward: a sequence alone != packed")
    if not checks["grads_finite"]:
        bad.append("BI gradients not finite")
    worst = max(checks.get("grad_fla_chunk_vs_torch_fp32_rel", {"-": 0.0}).values())
    if worst > 5e-2:
        bad.append(f"FLA chunk bwd (guard overridden) differs from the fp32 torch chunked gradient by {worst:.1e} "
                   "(>5e-2; bf16 rounding gives ~1e-2): it may compute wrong values here (FLA #640)")
    for b_ in bad:
        print("WARNING: " + b_)
    print(f"wall {wall:.1f} s")
    if args.out:
        write_json(args.out, {"env": env, "args": vars(args), "lengths": lengths, "heads": [H, HV, K, V], "rows": rows,
                              "ratios": ratios, "checks": checks, "warnings": bad, "wall_s": wall})
        print(f"wrote {args.out}")
    return 1 if any(not b_.startswith("FLA chunk bwd") for b_ in bad) else 0


if __name__ == "__main__":
    sys.exit(main())
