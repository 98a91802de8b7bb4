"""Issue 8, benchmark 1: the project's batch-invariant (BI) GEMM vs cuBLAS on Qwen3.5-9B projection shapes.

    python benchmarks/bi_gemm.py [--lm-head] [--fp32-head-m 1,1024,8192] [--out gemm.json]
    python benchmarks/bi_gemm.py --smoke            # tiny shapes, runs on CPU in seconds

What is timed, for every projection ``y = x @ W^T`` (W ``[N, K]``, bf16) of the 9B flavor and every
row count M in {1, 16, 128, 1024, 4096, 16384}:

- ``BI``     ``titan_rl_ext.kernels.batch_invariant.linear`` -- the call every ``ops.Linear`` makes in BI
             mode: the persistent Triton GEMM on CUDA (one 128x128x64 tile config, no split-K),
             the row-tiled torch GEMM on CPU.
- ``cuBLAS`` ``F.linear`` -- what the model runs with BI off.

Each variant is timed twice (two interleaved rounds, median of reps each) so the spread shows the noise;
the ratio uses the mean of the two medians. TFLOP/s counts 2*M*N*K; GB/s counts the fewest bytes
(x, W and y once each), the useful figure at small M where the GEMM is a weight read.
Sanity checks printed per shape: BI row 0 bit-identical at every M (BI really on), how often cuBLAS
row 0 changes bits with M (informational), and ||BI - cuBLAS|| / ||cuBLAS|| (bf16: ~1e-3 expected).

``--lm-head`` adds the 248320-wide LM head in bf16; ``--fp32-head-m`` times the head in fp32 at the
given M -- the precision the trainer's ``token_logprobs`` and the BI generator actually use
(BI: Triton fp32 dot with input_precision="ieee", no tensor cores; cuBLAS: SGEMM, TF32 off) -- and, for
the BI GEMM, the model's own form of it: fp32 activations over the bf16 weight, widened inside the
kernel, against the former cast of the whole head to an fp32 copy before the GEMM.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common (it also puts the repo root on sys.path)
from bench_common import Timer, add_timing_args, base_parser, env_summary, environment  # noqa: E402
from bench_common import fmt_table, print_header, resolve_device, write_json  # noqa: E402

from titan_rl_ext.kernels import batch_invariant as bi  # noqa: E402
from titan_rl_ext.models.qwen3_5.flavors import qwen3_5_flavors  # noqa: E402


@dataclasses.dataclass
class Shape:
    names: list[str]  # every projection of the model with this (K, N)
    K: int
    N: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def label(self) -> str:
        return "/".join(self.names) + ("" if self.dtype == torch.bfloat16 else f" [{str(self.dtype).split('.')[-1]}]")


def projection_shapes(flavor: str, lm_head: bool) -> list[Shape]:
    """(K, N) of every Linear in one GDN block, one attention block and the head, computed from the flavor;
    identical shapes merged so each is timed once."""
    cfg = qwen3_5_flavors()[flavor]
    g, D = cfg.gdn, cfg.dim
    q_out = cfg.n_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1)
    kv = cfg.n_kv_heads * cfg.head_dim
    named = [  # the model's merged projections (ops.MergedLinear): one GEMM each
        ("gdn.in_proj(qkv+z+b+a)", D, g.conv_dim + g.value_dim + 2 * g.n_v_heads),
        ("gdn.out_proj", g.value_dim, D),
        ("attn.wqkv(q+gate, k, v)", D, q_out + 2 * kv),
        ("attn.wo", cfg.n_heads * cfg.head_dim, D),
        ("mlp.w13(gate+up)", D, 2 * cfg.ffn_dim),
        ("mlp.w2", cfg.ffn_dim, D),
    ]
    if lm_head:
        named.append(("lm_head", D, cfg.vocab_size))
    shapes: dict[tuple[int, int], Shape] = {}
    for name, K, N in named:
        shapes.setdefault((K, N), Shape([], K, N)).names.append(name)
    return list(shapes.values())


def rel_err(a: torch.Tensor, b: torch.Tensor, rows: int = 1024) -> float:
    """||a - b|| / ||b|| in fp32, a block of rows at a time (the 16384-row LM head output is 8 GB in bf16:
    whole-tensor fp32 temporaries would not fit)."""
    num = den = 0.0
    for i in range(0, a.shape[0], rows):
        af, bf = a[i : i + rows].float(), b[i : i + rows].float()
        num += (af - bf).pow(2).sum().item()
        den += bf.pow(2).sum().item()
    return (num / max(den, 1e-30)) ** 0.5


def bench_shape(shape: Shape, ms: list[int], dev: torch.device, timer: Timer, args: argparse.Namespace) -> list[dict[str, Any]]:
    K, N, dtype = shape.K, shape.N, shape.dtype
    gen = torch.Generator(device=dev).manual_seed(K * 7 + N)
    # random data, never zeros: a GEMM on zeros can run faster than on real values
    w = (torch.randn(N, K, device=dev, generator=gen) * K**-0.5).to(dtype)
    x_all = torch.randn(max(ms), K, device=dev, generator=gen).to(dtype)
    big = shape.names == ["lm_head"] or dtype == torch.float32
    reps, max_s, warmup = (args.reps_big, args.max_s_big, 1) if big else (args.reps, args.max_s, args.warmup)
    ref_bi = ref_cb = None
    rows = []
    for M in ms:
        x = x_all[:M]  # a contiguous prefix: row 0 is the same vector at every M

        def run_bi() -> torch.Tensor:
            return bi.linear(x, w)

        def run_cb() -> torch.Tensor:
            return F.linear(x, w)

        with torch.no_grad():
            y_bi, y_cb = run_bi(), run_cb()  # also the compile / handle-creation warm-up
            err = rel_err(y_bi, y_cb)
            if ref_bi is None:
                ref_bi, ref_cb = y_bi[0].clone(), y_cb[0].clone()
            bi_same = bool(torch.equal(y_bi[0], ref_bi))
            cb_same = bool(torch.equal(y_cb[0], ref_cb))
            del y_bi, y_cb
            med: dict[str, list[float]] = {"bi": [], "cb": []}
            for rnd in range(2):  # interleaved rounds: drift between them shows up as spread
                for key, fn in (("bi", run_bi), ("cb", run_cb)):
                    t = timer.run(fn, warmup=warmup if rnd == 0 else int(not big), reps=reps, max_s=max_s)
                    med[key].append(statistics.median(t))
        t_bi, t_cb = statistics.mean(med["bi"]), statistics.mean(med["cb"])
        flops = 2.0 * M * N * K
        nbytes = (M * K + K * N + M * N) * x.element_size()
        tiles = -(-M // 128) * -(-N // 128)
        rows.append({
            "shape": shape.label, "K": K, "N": N, "M": M, "dtype": str(dtype).split(".")[-1],
            "bi_ms": t_bi, "bi_ms_r1": med["bi"][0], "bi_ms_r2": med["bi"][1],
            "cublas_ms": t_cb, "cublas_ms_r1": med["cb"][0], "cublas_ms_r2": med["cb"][1],
            "bi_tflops": flops / t_bi / 1e9, "cublas_tflops": flops / t_cb / 1e9,
            "bi_gbs": nbytes / t_bi / 1e6, "cublas_gbs": nbytes / t_cb / 1e6,
            "ratio_bi_over_cublas": t_bi / t_cb,
            "bi_tiles_128x128": tiles if dev.type == "cuda" else None,
            "rel_err_bi_vs_cublas": err, "bi_row0_bit_identical_to_M1": bi_same, "cublas_row0_bit_identical_to_M1": cb_same,
        })
        if dtype == torch.float32 and shape.names == ["lm_head"]:
            # the model's fp32 head over its bf16 weight (Decoder.logits(fp32=True) in BI mode): the
            # kernel widens the weight per tile; before, the head was cast to an fp32 copy on every call
            w16 = w.to(torch.bfloat16)
            with torch.no_grad():
                mixed = [statistics.median(timer.run(lambda: bi.linear(x, w16), warmup=1, reps=reps, max_s=max_s)),
                         statistics.median(timer.run(lambda: bi.linear(x, w16.float()), warmup=1, reps=reps, max_s=max_s))]
            rows[-1].update(bi_bf16w_widened_ms=mixed[0], bi_bf16w_cast_copy_ms=mixed[1])
            print(f"  {shape.label:<34} M={M:<6} fp32 x bf16 weight: widened in-kernel {mixed[0]:.4f} ms, "
                  f"cast copy + fp32 GEMM {mixed[1]:.4f} ms ({mixed[1] / mixed[0]:.2f}x)", flush=True)
        r = rows[-1]
        print(f"  {shape.label:<34} M={M:<6} BI {r['bi_ms_r1']:.4f}/{r['bi_ms_r2']:.4f} ms  cuBLAS "
              f"{r['cublas_ms_r1']:.4f}/{r['cublas_ms_r2']:.4f} ms  ratio {r['ratio_bi_over_cublas']:.2f}  "
              f"err {err:.1e}  BI row0 same={bi_same} cuBLAS row0 same={cb_same}", flush=True)
    return rows


def main() -> int:
    ap = base_parser(__doc__, "tiny shapes (debug flavor), M in {1,16,128}: CPU check")
    ap.add_argument("--flavor", default="qwen3_5-9b")
    ap.add_argument("--m", default="1,16,128,1024,4096,16384", help="row counts (tokens)")
    ap.add_argument("--lm-head", action="store_true", help="also the bf16 LM head (N = vocab)")
    ap.add_argument("--fp32-head-m", default="", help="row counts for the fp32 LM head ('' = skip), e.g. 1,1024,8192")
    add_timing_args(ap, warmup=3, reps=30, max_s=1.0)
    ap.add_argument("--reps-big", type=int, default=5, help="reps for the LM head")
    ap.add_argument("--max-s-big", type=float, default=4.0)
    ap.add_argument("--out", default="", help="write results as JSON")
    args = ap.parse_args()
    dev = resolve_device(ap, args)
    flavor = "qwen3_5-debug" if args.smoke else args.flavor
    ms = [1, 16, 128] if args.smoke else [int(m) for m in args.m.split(",") if m]
    fp32_ms = ([1, 16] if args.smoke and args.fp32_head_m else [int(m) for m in args.fp32_head_m.split(",") if m])
    if args.smoke:
        args.reps, args.reps_big, args.warmup = 5, 3, 1

    env = environment(dev)
    env["bi_gemm_path"] = ("triton persistent GEMM" if dev.type == "cuda" and bi._triton() is not None
                           else "torch row-tiled GEMM (no triton on this device)")
    print_header(f"bi_gemm: BI GEMM vs cuBLAS (F.linear), flavor {flavor}", env)
    shapes = projection_shapes(flavor, args.lm_head)
    if fp32_ms:
        head = projection_shapes(flavor, True)[-1]
        shapes.append(Shape(["lm_head"], head.K, head.N, torch.float32))
    timer = Timer(dev)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for s in shapes:
        rows += bench_shape(s, fp32_ms if s.dtype == torch.float32 else ms, dev, timer, args)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        if args.out:  # partial results survive a timeout
            write_json(args.out, {"env": env, "args": vars(args), "rows": rows, "partial": True})
    wall = time.perf_counter() - t0

    print("\nSUMMARY bi_gemm  (ms = mean of the two round medians; r1/r2 = the two medians; ratio = t_BI / t_cuBLAS, >1 = BI slower)")
    print(f"    {env_summary(env, fla=False)}  {env['bi_gemm_path']}")
    print(fmt_table(rows, [
        ("shape", "shape", ""), ("K", "K", "d"), ("N", "N", "d"), ("M", "M", "d"),
        ("bi_ms_r1", "BI r1", ".4f"), ("bi_ms_r2", "BI r2", ".4f"),
        ("cublas_ms_r1", "cuBLAS r1", ".4f"), ("cublas_ms_r2", "cuBLAS r2", ".4f"),
        ("bi_tflops", "BI TF/s", ".1f"), ("cublas_tflops", "cuB TF/s", ".1f"),
        ("bi_gbs", "BI GB/s", ".0f"), ("cublas_gbs", "cuB GB/s", ".0f"),
        ("ratio_bi_over_cublas", "BI/cuB", ".2f"),
    ]))
    bad_inv = [f"{r['shape']} M={r['M']}" for r in rows if not r["bi_row0_bit_identical_to_M1"]]
    bad_err = [f"{r['shape']} M={r['M']} ({r['rel_err_bi_vs_cublas']:.1e})" for r in rows
               if r["rel_err_bi_vs_cublas"] > (1e-4 if r["dtype"] == "float32" else 1e-2)]
    cb_var = sum(not r["cublas_row0_bit_identical_to_M1"] for r in rows)
    print(f"BI row 0 bit-identical across M: {'yes' if not bad_inv else 'NO at ' + ', '.join(bad_inv)}; "
          f"cuBLAS row 0 changed bits at {cb_var}/{len(rows)} (shape, M) points; "
          f"BI vs cuBLAS rel err max {max(r['rel_err_bi_vs_cublas'] for r in rows):.1e}"
          + (f"; TOO LARGE at {', '.join(bad_err)}" if bad_err else ""))
    # aggregate over the model's shapes at each M, weighted as one GDN+attention+MLP pass would be (bf16 only)
    for M in ms:
        sel = [r for r in rows if r["M"] == M and r["dtype"] == "bfloat16" and r["shape"] != "lm_head"]
        if sel:
            print(f"  M={M:<6} sum over distinct projection shapes: BI {sum(r['bi_ms'] for r in sel):.3f} ms vs "
                  f"cuBLAS {sum(r['cublas_ms'] for r in sel):.3f} ms -> {sum(r['bi_ms'] for r in sel) / sum(r['cublas_ms'] for r in sel):.2f}x")
    print(f"wall {wall:.1f} s")
    if args.out:
        write_json(args.out, {"env": env, "args": vars(args), "rows": rows, "wall_s": wall})
        print(f"wrote {args.out}")
    return 1 if bad_inv or bad_err else 0


if __name__ == "__main__":
    sys.exit(main())
