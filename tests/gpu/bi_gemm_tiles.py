"""Which BI GEMM launch shapes give the default's bits, and which is fastest at each M? (GPU; writes JSON.)

    python tests/gpu/bi_gemm_tiles.py --out tiles.json [--ms 1,8,64,256,1024,4096,8192,16384] [--quick]

``bi_matmul`` promises batch invariance by reducing each output over K in one order whatever M is. A row's bits
can only depend on how its K reduction is done; session 20 measured that ten output-tile shapes (``BLOCK_K`` 64
throughout) give the default's bits on every shape, which is what lets the tile follow M. This sweep widens the
question (issue 25 item 2: the BI GEMM at cuBLAS speed) to every launch shape ``MMConfig`` offers: output
tiles up to 256 wide, ``BLOCK_K`` 32/64/128, persistent grid or one program per tile, pointer loads or TMA
descriptors, more pipeline stages. For each of the Qwen3.5-9B projections and the fp32-output LM head, at
each M, it checks every configuration's bits against the default's (rows 0..M-1 of one reference run at the
largest M: batch invariance across configurations *and* row counts) and times it against cuBLAS
(``F.linear`` / ``torch.mm(out_dtype=fp32)``). It prints the fastest bit-equal configuration per shape and M,
and a proposed M-bucket table (the configuration with the least total time over the shapes in each bucket) --
what ``bi_matmul`` should use on this GPU; ``--table-out titan_rl_ext/kernels/bi_gemm_tables.json`` writes it
where ``mm_config`` reads it (only bit-equal configurations can be proposed).
Targets (issue 25): >= 0.9x cuBLAS at M >= 1024, >= 0.8x at M <= 256.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from titan_rl_ext.kernels import batch_invariant_triton as tri  # noqa: E402
from titan_rl_ext.kernels.batch_invariant_triton import MMConfig  # noqa: E402

DEFAULT = tri._MM_CONFIGS[torch.bfloat16]
CANDIDATES: list[MMConfig] = [
    DEFAULT,
    # decode-sized tiles (what _SMALL_M_CONFIGS holds today first), then narrower / deeper ones
    MMConfig(16, 128, 64, 8, 4, 4),
    MMConfig(64, 128, 64, 8, 4, 4),
    MMConfig(16, 64, 64, 8, 4, 4),
    MMConfig(16, 32, 64, 8, 4, 6),
    MMConfig(16, 64, 64, 8, 4, 6, tma=True),
    MMConfig(16, 64, 128, 8, 4, 4),
    MMConfig(16, 128, 128, 8, 4, 4, tma=True),
    MMConfig(64, 64, 64, 8, 4, 4, tma=True),
    # N = 4096 at M = 1 is 64 programs at BLOCK_N 64: narrower columns and deeper pipelines put more of the
    # 132 SMs to streaming the weight (~36 KB in flight per SM covers ~1 us of latency at 4.8 TB/s)
    MMConfig(16, 32, 128, 8, 4, 4),
    MMConfig(16, 32, 64, 8, 4, 8),
    MMConfig(16, 32, 128, 8, 4, 6, tma=True),
    # prefill / trainer tiles
    MMConfig(128, 256, 64, 8, 8, 3),
    MMConfig(128, 256, 64, 8, 8, 4, tma=True),
    MMConfig(128, 256, 64, 8, 8, 3, persistent=False),
    MMConfig(128, 256, 64, 8, 8, 4, persistent=False, tma=True),
    MMConfig(128, 128, 64, 8, 4, 4, tma=True),
    MMConfig(256, 128, 64, 8, 8, 3, persistent=False, tma=True),
    MMConfig(128, 128, 128, 8, 8, 3, tma=True),
    MMConfig(128, 128, 32, 8, 4, 5, persistent=False),
    # 65-256 rows (decode at B = 128-256): a 128x256 tile leaves 16-32 of 132 SMs busy at N = 4096, each walking
    # all of K alone; narrower tiles put more programs on the weight stream at the same K order
    MMConfig(32, 64, 64, 8, 4, 4),
    MMConfig(64, 64, 64, 8, 4, 4),
    MMConfig(64, 64, 64, 8, 4, 6),
    MMConfig(64, 64, 128, 8, 4, 4),
    MMConfig(128, 64, 64, 8, 4, 4),
    MMConfig(64, 128, 64, 8, 4, 3, tma=True),
    MMConfig(64, 256, 64, 8, 8, 3),
]
SHAPES = {  # name: (N, K) of y = x @ W^T, Qwen3.5-9B
    "gdn_in_proj": (12352, 4096), "gdn_out": (4096, 4096), "mlp_w13": (24576, 4096), "mlp_w2": (4096, 12288),
    "attn_qkv": (12288, 4096), "lm_head_fp32out": (248320, 4096),
}
BUCKETS = (16, 32, 64, 128, 256, 1024, 1 << 30)  # M <= bound


NARROW_N = 4096  # the projections whose output is the model width (mlp.w2, the GDN/attention out projections)


def _at(by_m: dict[Any, float], m: int) -> float:
    """A per-M figure, keyed by int in a live run and by str once read back from JSON."""
    return by_m[m] if m in by_m else by_m[str(m)]


def _bucket_rows(res: dict[str, Any], names: list[str], ms: list[int]) -> dict[str, float]:
    """Total time over ``names`` x ``ms`` of every configuration bit-equal on every measured shape."""
    totals: dict[str, float] = {}
    keys = set.intersection(*(set(s["configs"]) for s in res["shapes"].values()))
    for k in sorted(keys):
        if all(s["configs"][k].get("equal_bits") for s in res["shapes"].values()):
            totals[k] = sum(_at(res["shapes"][n]["configs"][k]["us"], m) for n in names for m in ms)
    return totals


def propose(res: dict[str, Any]) -> list[dict[str, Any]]:
    """One configuration per M bucket (least total time over the shapes), and before it, where it pays >= 5 %, one
    for the bucket's narrow shapes (N <= NARROW_N) alone. Only configurations bit-equal everywhere are proposed."""
    ms = [int(m) for m in res["ms"]]
    names = list(res["shapes"])
    narrow = [n for n in names if res["shapes"][n]["N"] <= NARROW_N]
    table: list[dict[str, Any]] = []
    lo = 0
    for hi in BUCKETS:
        in_b = [m for m in ms if lo < m <= hi]
        lo = hi
        if not in_b:
            continue
        totals = _bucket_rows(res, names, in_b)
        k_best = min(totals, key=totals.get)
        cub = sum(_at(res["shapes"][n]["cublas_us"], m) for n in names for m in in_b)
        if narrow and len(narrow) < len(names):
            t_n = _bucket_rows(res, narrow, in_b)
            k_n = min(t_n, key=t_n.get)
            if t_n[k_n] < 0.95 * t_n[k_best]:
                cub_n = sum(_at(res["shapes"][n]["cublas_us"], m) for n in narrow for m in in_b)
                table.append({"max_m": hi, "max_n": NARROW_N, "ms": in_b, "config": k_n, "bi_us": t_n[k_n],
                              "cublas_us": cub_n, "cublas_over_bi": cub_n / t_n[k_n],
                              "bucket_config_us": t_n[k_best]})
        table.append({"max_m": hi, "ms": in_b, "config": k_best, "bi_us": totals[k_best], "cublas_us": cub,
                      "cublas_over_bi": cub / totals[k_best], "default_us": totals.get(key(DEFAULT))})
    return table


def write_table(res: dict[str, Any], path: Path) -> None:
    """Merge the proposal into the tables file ``path`` under the sweep's GPU name."""
    by_key = {key(c): c for c in CANDIDATES}
    tables = json.loads(path.read_text()) if path.exists() else {}
    tables[res["gpu"]] = [{"max_m": row["max_m"], **({"max_n": row["max_n"]} if "max_n" in row else {}),
                           "config": dataclasses.asdict(by_key[row["config"]])} for row in res["proposal"]]
    path.write_text(json.dumps(tables, indent=1) + "\n")
    print(f"table for {res['gpu']} written to {path}")


def print_summary(res: dict[str, Any]) -> None:
    for row in res["proposal"]:
        n = f"N <= {row['max_n']}" if "max_n" in row else "all N"
        base = (f"(bucket's config {row['cublas_us'] / row['bucket_config_us']:.2f}x)" if "max_n" in row
                else f"(default {row['cublas_us'] / row['default_us']:.2f}x)" if row.get("default_us") else "")
        print(f"SUMMARY  M <= {row['max_m']:>10} {n:12s}: {row['config']:26s} {row['cublas_over_bi']:.2f}x cuBLAS {base}")


def key(cfg: MMConfig) -> str:
    flags = ("p" if cfg.persistent else "") + ("t" if cfg.tma else "")
    return f"{cfg.BLOCK_M}x{cfg.BLOCK_N}x{cfg.BLOCK_K} w{cfg.num_warps} s{cfg.num_stages} {flags or '-'}"


def bench(fn: Any, reps: int, max_s: float = 1.0) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times: list[float] = []
    stop = time.perf_counter() + max_s
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
        if len(times) >= 3 and time.perf_counter() > stop:
            break
    times.sort()
    return times[len(times) // 2] * 1e3  # us


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--ms", default="1,8,64,256,1024,4096,8192,16384")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="the first four configurations and two shapes")
    ap.add_argument("--from-json", default="", help="no GPU: re-derive the proposal (and --table-out) from an earlier "
                    "sweep's --out JSON")
    ap.add_argument("--table-out", default="", help="merge the proposal into this tables file under the GPU's name "
                    "(titan_rl_ext/kernels/bi_gemm_tables.json is what bi_matmul reads)")
    args = ap.parse_args()
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
        res["proposal"] = propose(res)
        if args.table_out:
            write_table(res, Path(args.table_out))
        print_summary(res)
        return 0
    dev = torch.device("cuda")
    ms = [int(m) for m in args.ms.split(",")]
    cands = CANDIDATES[:4] if args.quick else CANDIDATES
    shapes = dict(list(SHAPES.items())[:2]) if args.quick else SHAPES
    g = torch.Generator(device=dev).manual_seed(0)
    t0 = time.perf_counter()
    res: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "default": key(DEFAULT), "ms": ms, "shapes": {}}
    for name, (N, K) in shapes.items():
        out = torch.float32 if name.endswith("fp32out") else None
        w = (torch.randn(N, K, device=dev, generator=g) * 0.02).bfloat16()
        x_all = torch.randn(max(ms), K, device=dev, generator=g).bfloat16()
        ref = tri.bi_matmul(x_all, w.t(), out_dtype=out, config=DEFAULT)  # the default configuration, largest M
        rows: dict[str, Any] = {}
        for cfg in cands:
            r: dict[str, Any] = {"equal_bits": True, "us": {}}
            try:
                for M in ms:
                    y = tri.bi_matmul(x_all[:M], w.t(), out_dtype=out, config=cfg)
                    r["equal_bits"] &= bool(torch.equal(y, ref[:M]))
                    del y
                    r["us"][M] = bench(lambda: tri.bi_matmul(x_all[:M], w.t(), out_dtype=out, config=cfg), args.reps)
            except Exception as e:  # a configuration that does not build here is a result
                r = {"error": f"{type(e).__name__}: {e}"[:300]}
            rows[key(cfg)] = r
            shown = r.get("error") or " ".join(f"M={m}:{u:8.1f}" for m, u in r["us"].items())
            print(f"{name:16s} {key(cfg):26s} equal={r.get('equal_bits')!s:5s} {shown}", flush=True)
        cub = {}
        for M in ms:
            if out is not None:
                cub[M] = bench(lambda: torch.mm(x_all[:M], w.t(), out_dtype=torch.float32), args.reps)
            else:
                cub[M] = bench(lambda: F.linear(x_all[:M], w), args.reps)
        print(f"{name:16s} {'cuBLAS':26s}       " + " ".join(f"M={m}:{u:8.1f}" for m, u in cub.items()), flush=True)
        best = {}
        for M in ms:
            ok = {k: r["us"][M] for k, r in rows.items() if r.get("equal_bits")}
            k_best = min(ok, key=ok.get)
            best[M] = {"config": k_best, "us": ok[k_best], "cublas_us": cub[M], "cublas_over_bi": cub[M] / ok[k_best],
                       "default_us": rows[key(DEFAULT)]["us"][M]}
        res["shapes"][name] = {"N": N, "K": K, "configs": rows, "cublas_us": cub, "best": best,
                               "weight_floor_us_at_4.8TBps": N * K * 2 / 4.8e12 * 1e6}
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
    res["proposal"] = propose(res)
    if args.table_out and not args.quick:
        write_table(res, Path(args.table_out))
    res["wall_s"] = time.perf_counter() - t0
    print("\nSUMMARY  fastest bit-equal configuration per M bucket (sum over shapes), cuBLAS time / BI time:")
    print_summary(res)
    broken = sorted({k for s in res["shapes"].values() for k, r in s["configs"].items() if not r.get("equal_bits")})
    print(f"SUMMARY  configurations with other bits or no build: {broken or 'none'}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
