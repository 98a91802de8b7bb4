"""What the chunk-grid gated delta rule (``kernels.gdn_chunk_grid``) costs on one long prompt, against the shipped
recurrent kernel (BI's prefill today) and FLA's chunk kernel (titan's non-BI prefill): issue 40 item 3's
"measure what each costs before choosing".

    python benchmarks/gdn_chunk_grid.py [--lengths 32768,65536] [--out gdn_chunk_grid.json]
    TRITON_INTERPRET=1 python benchmarks/gdn_chunk_grid.py --smoke --device cpu   # toy sizes

Per prompt length, the 9B's GDN heads (16 key / 32 value heads of 128), bf16 inputs, fp32 state, one sequence:

- ``recurrent``   ``gdn_triton.gated_delta_rule_recurrent``: the token-by-token kernel (one chain of T steps);
- ``chunk_grid``  the chunk-grid form, whole: ``T`` per chunk, the boundary-state chain, then every chunk's
                  tokens by the recurrent kernel from its boundary state; and its parts (``t``, ``chain``,
                  ``outputs``) timed alone;
- ``fla_chunk``   FLA's ``chunk_gated_delta_rule`` where fla is importable.

Checked before timing: the chunk grid's outputs and final state against the recurrent kernel's (max abs
difference: both are fp32 forms of one recurrence; expected ~1e-5 on values of order 1), and a prompt cut at a
chunk boundary and continued from the first part's state gives the whole prompt's bits (``torch.equal``).
Each variant is timed in two interleaved rounds. Memory: the boundary states and the chunk buffers the form needs
(reported, fp32).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Timer, add_timing_args, base_parser, environment, fmt_table, json_saver  # noqa: E402
from bench_common import print_header, resolve_device  # noqa: E402

from titan_rl_ext.kernels import gdn_chunk_grid as cg  # noqa: E402
from titan_rl_ext.kernels.gdn_triton import gated_delta_rule_recurrent  # noqa: E402

H, HV, K, V = 16, 32, 128, 128


def _inputs(T: int, dev: torch.device, heads: tuple[int, int, int, int]) -> dict[str, Any]:
    h, hv, k, v = heads
    gen = torch.Generator(device=dev).manual_seed(T)
    return dict(
        q=F.normalize(torch.randn(T, h, k, device=dev, generator=gen), dim=-1).bfloat16(),
        k=F.normalize(torch.randn(T, h, k, device=dev, generator=gen), dim=-1).bfloat16(),
        v=torch.randn(T, hv, v, device=dev, generator=gen).bfloat16(),
        g=-torch.rand(T, hv, device=dev, generator=gen) * 0.1,
        beta=torch.rand(T, hv, device=dev, generator=gen).bfloat16(),
        s0=torch.randn(1, hv, k, v, device=dev, generator=gen) * 0.1,
    )


def _fla() -> Callable[..., Any] | None:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:
        return None
    return chunk_gated_delta_rule


def main() -> int:
    ap = base_parser(__doc__, "toy heads and lengths (CPU, interpreter)")
    ap.add_argument("--lengths", default="32768,65536")
    ap.add_argument("--out", default="")
    add_timing_args(ap, warmup=1, reps=5, max_s=10.0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    dev = resolve_device(ap, args)
    heads = (2, 4, 16, 32) if args.smoke else (H, HV, K, V)
    lengths = [150] if args.smoke else [int(x) for x in args.lengths.split(",") if x]
    chunk = 16 if args.smoke else cg.CHUNK
    env = environment(dev)
    print_header(f"gdn_chunk_grid: {heads[0]}/{heads[1]} heads x {heads[2]}x{heads[3]}, chunk {chunk}", env)
    results: dict[str, Any] = {"env": env, "args": vars(args), "chunk": chunk, "rows": []}
    save = json_saver(args.out, results, t0)
    timer = Timer(dev)
    fla = _fla() if dev.type == "cuda" else None
    for T in lengths:
        x = _inputs(T, dev, heads)
        cu = [0, T]
        cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)
        scale = heads[2] ** -0.5
        qkvgb = (x["q"], x["k"], x["v"], x["g"], x["beta"])

        def recurrent() -> Any:
            return gated_delta_rule_recurrent(*qkvgb, cu_t, scale, x["s0"])

        def grid() -> Any:
            return cg.gated_delta_rule_chunk_grid(*qkvgb, cu, scale, x["s0"], chunk=chunk)

        states, _, cu_chunks = cg.boundary_states(x["k"], x["v"], x["g"], x["beta"], cu, x["s0"], chunk=chunk)

        def chain() -> Any:
            return cg.boundary_states(x["k"], x["v"], x["g"], x["beta"], cu, x["s0"], chunk=chunk)

        def outputs() -> Any:
            return gated_delta_rule_recurrent(*qkvgb, cu_chunks, scale, states)

        o_r, f_r = recurrent()
        o_c, f_c = grid()
        cut = (T // 2) // chunk * chunk
        o_a, f_a = cg.gated_delta_rule_chunk_grid(*(t[:cut] for t in qkvgb), [0, cut], scale, x["s0"], chunk=chunk)
        o_b, f_b = cg.gated_delta_rule_chunk_grid(*(t[cut:] for t in qkvgb), [0, T - cut], scale, f_a, chunk=chunk)
        row: dict[str, Any] = {
            "case": f"prefill 1x{T}", "T": T,
            "max_abs_o_vs_recurrent": (o_c.float() - o_r.float()).abs().max().item(),
            "max_abs_state_vs_recurrent": (f_c - f_r).abs().max().item(),
            "cut_at_chunk_equals_whole": bool(torch.equal(torch.cat([o_a, o_b]), o_c) and torch.equal(f_b, f_c)),
            "boundary_state_mib": states.numel() * 4 / 2**20,
        }
        variants: dict[str, Callable[[], Any]] = {"recurrent": recurrent, "chunk_grid": grid, "chain": chain,
                                                  "outputs": outputs}
        if fla is not None:
            def fla_chunk() -> Any:
                return fla(x["q"][None], x["k"][None], x["v"][None], x["g"][None], x["beta"][None], scale=scale,
                           initial_state=x["s0"], output_final_state=True, cu_seqlens=cu_t.long())
            variants["fla_chunk"] = fla_chunk
        med: dict[str, list[float]] = {n: [] for n in variants}
        for rnd in range(2):
            for name, fn in variants.items():
                med[name].append(statistics.median(timer.run(fn, warmup=args.warmup if rnd == 0 else 0,
                                                             reps=args.reps, max_s=args.max_s)))
        for name, m in med.items():
            row[f"{name}_ms"] = statistics.mean(m)
            row[f"{name}_spread_pct"] = 100 * abs(m[0] - m[-1]) / statistics.mean(m)
        row["recurrent_over_grid"] = row["recurrent_ms"] / row["chunk_grid_ms"]
        results["rows"].append(row)
        save()
        print("  " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    cols = [("case", "case", ""), ("recurrent_ms", "recurrent ms", ".3f"), ("chunk_grid_ms", "chunk grid ms", ".3f"),
            ("chain_ms", "chain ms", ".3f"), ("outputs_ms", "outputs ms", ".3f"), ("fla_chunk_ms", "FLA chunk ms", ".3f"),
            ("max_abs_o_vs_recurrent", "max|o diff|", ".1e"), ("cut_at_chunk_equals_whole", "cut == whole", "")]
    print("\nSUMMARY\n" + fmt_table(results["rows"], cols))
    ok = all(r["cut_at_chunk_equals_whole"] for r in results["rows"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
