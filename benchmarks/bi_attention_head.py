"""Issue 13: the two largest BI terms of the trainer step, kernel by kernel, BI vs the best non-BI path.

    python benchmarks/bi_attention_head.py [--out attn_head.json]
    python benchmarks/bi_attention_head.py --smoke     # toy sizes, CPU (torch paths), seconds

1. Attention at Qwen3.5-9B shapes (16 q / 4 kv heads x 256), T = 8192 packed from 1000/3000/2500/1692:
   forward and forward+backward of ``packed_causal_attention`` with BI on (Triton BI forward + flash
   backward) and off (FlashAttention varlen forward + backward, one launch each), plus the BI kernel over
   a paged cache (block size 16) at decode (B = 32 sequences of 512 keys, one query each).
2. The fp32 head (hidden 4096, vocab 248 320), T = 8192: ``token_logprobs_fused`` forward and
   forward+backward, BI on (Triton BI GEMM with fp32 output) and off (cuBLAS, fp32 output).

FLOPs and bytes of each are printed with the time, so the distance to the floor is visible. Each
variant is timed in two interleaved rounds (median of reps each).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Timer, base_parser, environment, fmt_table, json_saver, print_header, resolve_device  # noqa: E402

from titan_rl_ext.kernels.batch_invariant import batch_invariant  # noqa: E402
from titan_rl_ext.kernels.lm_head import token_logprobs_fused  # noqa: E402
from titan_rl_ext.kernels.varlen_attention import packed_causal_attention  # noqa: E402


def main() -> int:
    ap = base_parser(__doc__, "toy sizes on CPU")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    t0 = time.perf_counter()
    dev = resolve_device(ap, args)
    env = environment(dev)
    if args.smoke:
        lens, N, Kh, H, D, V, B, ctx = [24, 60, 40], 4, 2, 32, 64, 512, 4, 40
    else:
        lens, N, Kh, H, D, V, B, ctx = [1000, 3000, 2500, 1692], 16, 4, 256, 4096, 248320, 32, 512
    T = sum(lens)
    print_header(f"bi_attention_head: attention {N}/{Kh} heads x {H} and fp32 head {D} x {V}, T={T} packed {lens}", env)
    results: dict[str, Any] = {"env": env, "args": vars(args), "rows": []}
    save = json_saver(args.out, results, t0)
    timer = Timer(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    dt = torch.bfloat16
    q, k, v = (torch.randn(T, n, H, device=dev, generator=g).to(dt).requires_grad_(True) for n in (N, Kh, Kh))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    gy = torch.randn(T, N, H, device=dev, generator=g).to(dt)
    scale = H**-0.5
    attn_flops = sum(2 * L * L * N * H for L in lens)  # causal QK^T + PV, forward

    def attn_fwd() -> None:
        with torch.no_grad():
            packed_causal_attention(q, k, v, cu, max(lens), scale)

    def attn_fwd_bwd() -> None:
        packed_causal_attention(q, k, v, cu, max(lens), scale).backward(gy)
        q.grad = k.grad = v.grad = None

    # paged decode: B sequences of ctx keys in a block-size-16 cache, one query each
    from titan_rl_ext.kernels import batch_invariant as bi

    paged_fn: Callable[[], None] | None = None
    if dev.type == "cuda" and bi._triton() is not None:
        from titan_rl_ext.kernels.attention_triton import bi_attention_fwd

        bs = 16
        nblk = B * ctx // bs
        kc, vc = (torch.randn(nblk, bs, Kh, H, device=dev, generator=g).to(dt) for _ in range(2))
        bt = torch.randperm(nblk, device=dev, generator=g).to(torch.int32).view(B, ctx // bs)
        qd = torch.randn(B, N, H, device=dev, generator=g).to(dt)
        cuq = torch.arange(B + 1, dtype=torch.int32, device=dev)
        sl = torch.full((B,), ctx, dtype=torch.int32, device=dev)

        def paged_fn() -> None:
            bi_attention_fwd(qd, kc, vc, cuq, sl, 1, scale, block_table=bt)

    hd = torch.randn(T, D, device=dev, generator=g).to(dt).requires_grad_(True)
    w = (torch.randn(V, D, device=dev, generator=g) * 0.02).to(dt).requires_grad_(True)
    tgt = torch.randint(0, V, (T,), device=dev, generator=g)
    head_flops = 2 * T * D * V

    def head_fwd() -> None:
        with torch.no_grad():
            token_logprobs_fused(hd, w, tgt)

    def head_fwd_bwd() -> None:
        token_logprobs_fused(hd, w, tgt).sum().backward()
        hd.grad = w.grad = None

    cases: list[tuple[str, Callable[[], None], float, float]] = [
        ("attention fwd", attn_fwd, attn_flops, 0.0),
        ("attention fwd+bwd", attn_fwd_bwd, 3.5 * attn_flops, 0.0),  # bwd ~2.5x fwd (recomputes P)
        ("head fwd", head_fwd, head_flops, 0.0),
        ("head fwd+bwd", head_fwd_bwd, 4 * head_flops, 0.0),  # fwd + recompute + dgrad + wgrad
    ]
    if paged_fn is not None:
        cases.insert(2, (f"paged decode B={B} ctx={ctx} (BI only)", paged_fn, 4 * B * ctx * N * H,
                         2 * B * ctx * Kh * H * 2 * (N // Kh)))  # K/V read once per query head
    for name, fn, flops, nbytes in cases:
        ms: dict[str, list[float]] = {"bi": [], "nonbi": []}
        for rnd in range(2):
            for mode, on in (("bi", True), ("nonbi", False)):
                if name.endswith("(BI only)") and not on:
                    continue
                with batch_invariant(on):
                    t = timer.run(fn, warmup=2 if rnd == 0 else 0, reps=args.reps, max_s=20)
                ms[mode].append(statistics.median(t))
        row: dict[str, Any] = {"case": name}
        for mode in ms:
            if ms[mode]:
                m = statistics.mean(ms[mode])
                row[f"{mode}_ms"], row[f"{mode}_rounds"] = m, ms[mode]
                row[f"{mode}_tflops"] = flops / m / 1e9
                if nbytes:
                    row[f"{mode}_gb_s"] = nbytes / m / 1e6
        if ms["nonbi"]:
            row["bi_over_nonbi"] = row["bi_ms"] / row["nonbi_ms"]
        results["rows"].append(row)
        print(f"  {name:<40} BI {row['bi_ms']:8.3f} ms ({ms['bi'][0]:.3f}/{ms['bi'][1]:.3f})"
              + (f"  non-BI {row['nonbi_ms']:8.3f} ms ({ms['nonbi'][0]:.3f}/{ms['nonbi'][1]:.3f})  BI/non-BI "
                 f"{row['bi_over_nonbi']:.2f}" if ms["nonbi"] else ""), flush=True)
        save()
    print("\nSUMMARY bi_attention_head")
    print(fmt_table(results["rows"], [("case", "case", ""), ("bi_ms", "BI ms", ".3f"), ("nonbi_ms", "non-BI ms", ".3f"),
                                      ("bi_over_nonbi", "BI/non-BI", ".2f"), ("bi_tflops", "BI TF/s", ".1f"),
                                      ("nonbi_tflops", "non-BI TF/s", ".1f"), ("bi_gb_s", "BI GB/s", ".0f")]))
    save()
    print(f"wall {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
