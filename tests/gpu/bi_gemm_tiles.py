"""Do the BI GEMM's bits depend on its output tile shape? (GPU; writes JSON.)

    python tests/gpu/bi_gemm_tiles.py --out tiles.json

``bi_matmul`` promises batch invariance by using one tile configuration for every M. A row's bits can only
depend on how its K reduction is done: the K step (``BLOCK_K``), the order of the steps, and how the
tensor-core instruction accumulates one step. If configurations that share ``BLOCK_K`` but differ in
``BLOCK_M`` / ``BLOCK_N`` / warps / stages give the default's bits on every shape, the GEMM may pick its
tile by M (small tiles for decode, where one 128x128 tile config leaves most SMs idle) without giving up
batch invariance. This script answers that on the GPU it runs on, and times every configuration on the
Qwen3.5-9B projection shapes and the fp32 LM head at M = 1, 8, 64, 256 against cuBLAS.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from titan_rl_ext.kernels import batch_invariant_triton as tri  # noqa: E402

DEFAULT = tri._MM_CONFIGS[torch.bfloat16]
CANDIDATES = [  # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages); BLOCK_K = 64 throughout
    DEFAULT,
    (64, 128, 64, 8, 4, 4),
    (64, 64, 64, 8, 4, 4),
    (64, 256, 64, 8, 8, 3),
    (128, 256, 64, 8, 8, 3),
    (128, 64, 64, 8, 4, 4),
    (16, 64, 64, 8, 4, 4),
    (16, 128, 64, 8, 4, 4),
    (32, 64, 64, 8, 4, 4),
    (128, 128, 64, 8, 4, 3),
]
SHAPES = {  # name: (N, K) of y = x @ W^T, Qwen3.5-9B
    "gdn_in_proj": (12352, 4096), "gdn_out": (4096, 4096), "mlp_w13": (24576, 4096), "mlp_w2": (4096, 12288),
    "attn_qkv": (12288, 4096), "lm_head_fp32out": (248320, 4096),
}
MS = (1, 8, 64, 256)


def bench(fn, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2] * 1e3  # us


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    res: dict = {"gpu": torch.cuda.get_device_name(), "default": DEFAULT, "shapes": {}}
    for name, (N, K) in SHAPES.items():
        out32 = name.endswith("fp32out")
        w = (torch.randn(N, K, device=dev, generator=g) * 0.02).bfloat16()
        x_all = torch.randn(max(MS), K, device=dev, generator=g).bfloat16()
        ref = tri.bi_matmul(x_all, w.t(), out_dtype=torch.float32 if out32 else None)
        rows: dict = {}
        for cfg in CANDIDATES:
            key = "x".join(map(str, cfg))
            r: dict = {"equal_bits": True, "us": {}}
            for M in MS:
                y = tri.bi_matmul(x_all[:M], w.t(), out_dtype=torch.float32 if out32 else None, config=cfg)
                r["equal_bits"] &= bool(torch.equal(y, ref[:M]))
                r["us"][M] = bench(lambda: tri.bi_matmul(x_all[:M], w.t(), out_dtype=torch.float32 if out32 else None,
                                                        config=cfg))
            rows[key] = r
            print(f"{name:16s} {key:22s} equal={r['equal_bits']!s:5s} " + " ".join(f"M={m}:{u:8.1f}us" for m, u in r["us"].items()), flush=True)
        cub = {}
        for M in MS:
            if out32:
                cub[M] = bench(lambda: torch.mm(x_all[:M], w.t(), out_dtype=torch.float32))
            else:
                cub[M] = bench(lambda: F.linear(x_all[:M], w))
        print(f"{name:16s} {'cuBLAS':22s}       " + " ".join(f"M={m}:{u:8.1f}us" for m, u in cub.items()), flush=True)
        res["shapes"][name] = {"N": N, "K": K, "configs": rows, "cublas_us": cub,
                               "weight_floor_us_at_4.8TBps": N * K * 2 / 4.8e12 * 1e6}
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
