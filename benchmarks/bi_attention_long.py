"""Attention at long contexts, Qwen3.5-9B heads (16 q / 4 kv x 256, bf16, paged cache): the batch-invariant
split-KV kernel against vLLM's unified Triton attention (the kernel titan's non-BI decode and vLLM's native
class run) and against the memory floor.

    python benchmarks/bi_attention_long.py [--out bi_attention_long.json] [--block-size 544]
    TRITON_INTERPRET=1 python benchmarks/bi_attention_long.py --smoke --device cpu   # toy sizes, seconds

Decode (one query per sequence, ``B`` sequences of ``ctx`` keys): the BI kernel as shipped (split-parallel:
programs per sequence and KV head chosen to fill the GPU, partials folded by a second kernel), the BI kernel
per tile (one program per sequence and KV head: what a launch without split parallelism does, the shape of
the kernel before the split), and vLLM's kernel where vLLM is importable. The floor is the K/V bytes read once
(``B * ctx * kv_heads * head_dim * 2 * 2``) over the HBM bandwidth measured in the same process (a device
copy). Prefill (one sequence of ``ctx`` tokens in chunks of ``--chunk`` queries over its cached prefix, as
vLLM's chunked prefill schedules it): BI vs vLLM, against the tensor-core floor (causal FLOPs over the bf16
matrix rate measured here).

Before timing, each context's bits are checked: the split-parallel decode of a sequence's last query equals
the last row of the trainer's packed launch over the whole sequence (``torch.equal``), and every launch variant
(software prefetch of the next key block, pipelining stages: ``attention_triton.Launch``) gives the shipped
launch's bits. ``--alt-block-n`` times another key-block width (``n{W}_*``): a different row definition,
which the trainer and every generator would have to adopt together, so its bits are checked against its own
packed launch (decode == packed row), not against the shipped table's. Decode variants are captured in a CUDA graph and timed by replay (the engine runs decode
under graphs: the host's launch cost is not the kernel's); each variant is timed in two interleaved rounds.
"""

from __future__ import annotations

import statistics
from contextlib import contextmanager
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Timer, base_parser, environment, fmt_table, json_saver, print_header, resolve_device  # noqa: E402

from titan_rl_ext.kernels import attention_triton  # noqa: E402
from titan_rl_ext.kernels.attention_triton import LAUNCH, SPLIT, Launch, bi_attention_fwd  # noqa: E402

N_HEADS, KV_HEADS, HEAD_DIM = 16, 4, 256


def _paged_cache(B: int, ctx: int, bs: int, dev: torch.device, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Keys/values of B sequences of ctx tokens scattered over shuffled blocks of one paged cache."""
    per_seq = -(-ctx // bs)
    nb = B * per_seq
    kc = torch.randn(nb, bs, KV_HEADS, HEAD_DIM, device=dev, generator=g).bfloat16()
    vc = torch.randn(nb, bs, KV_HEADS, HEAD_DIM, device=dev, generator=g).bfloat16()
    bt = torch.randperm(nb, device=dev, generator=g).to(torch.int32).view(B, per_seq)
    return kc, vc, bt


def _gather(cache: torch.Tensor, bt_row: torch.Tensor, n: int) -> torch.Tensor:
    return cache[bt_row.long()].reshape(-1, *cache.shape[2:])[:n].contiguous()


def vllm_attention() -> Callable[..., None] | None:
    """vLLM's unified Triton attention as its TRITON_ATTN backend calls it, or None where vLLM is absent."""
    try:
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means no vLLM row
        try:
            from vllm.attention.ops.triton_unified_attention import unified_attention  # noqa: F401
        except Exception:  # noqa: BLE001
            return None
    import inspect

    params = inspect.signature(unified_attention).parameters

    def run(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, out: torch.Tensor, cu_q: torch.Tensor, max_q: int,
            seq_lens: torch.Tensor, max_k: int, bt: torch.Tensor, scale: float, segm: dict[str, Any]) -> None:
        kw: dict[str, Any] = dict(q=q, k=kc, v=vc, out=out, cu_seqlens_q=cu_q, max_seqlen_q=max_q, seqused_k=seq_lens,
                                  max_seqlen_k=max_k, softmax_scale=scale, causal=True, window_size=(-1, -1),
                                  block_table=bt, softcap=0, q_descale=None, k_descale=None, v_descale=None)
        kw.update({k: v for k, v in segm.items() if k in params})
        unified_attention(**kw)

    run.params = list(params)  # type: ignore[attr-defined]
    return run


def _segm_buffers(dev: torch.device) -> dict[str, Any]:
    """The 3D (segmented) path's settings and buffers as vLLM's TRITON_ATTN metadata builder makes them: below
    ``128 // kv_heads`` sequences (the capture size nearest it with graphs on: 32 here) a decode splits each
    sequence into 16 segments."""
    rows, segs = 32, 16
    return {"seq_threshold_3D": rows, "num_par_softmax_segments": segs,
            "softmax_segm_output": torch.empty(rows, N_HEADS, segs, HEAD_DIM, dtype=torch.float32, device=dev),
            "softmax_segm_max": torch.empty(rows, N_HEADS, segs, dtype=torch.float32, device=dev),
            "softmax_segm_expsum": torch.empty(rows, N_HEADS, segs, dtype=torch.float32, device=dev)}


def _hbm_gbs(dev: torch.device, timer: Timer) -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    ms = statistics.median(timer.run(lambda: b.copy_(a), warmup=2, reps=10))
    return 2 * a.numel() / ms / 1e6  # read + write


def _tflops(dev: torch.device, timer: Timer) -> float:
    x = torch.randn(8192, 8192, device=dev).bfloat16()
    ms = statistics.median(timer.run(lambda: x @ x, warmup=2, reps=10))
    return 2 * 8192**3 / ms / 1e9


def main() -> int:
    ap = base_parser(__doc__, "toy sizes (run under TRITON_INTERPRET=1 on CPU)")
    ap.add_argument("--block-size", type=int, default=544, help="KV cache block size (vLLM's hybrid attention page)")
    ap.add_argument("--decode", default="8192:1,8,32;32768:1,8,32;65536:1,4", help="ctx:B,B,...;...")
    ap.add_argument("--prefill", default="32768,65536", help="one sequence of each length, in chunks")
    ap.add_argument("--chunk", type=int, default=8192, help="queries per prefill chunk")
    ap.add_argument("--alt-block-n", default="", help="other key-block widths to time as whole definitions, e.g. 32,128")
    ap.add_argument("--program-factors", default="",
                    help="split-parallel decode launched with about F programs per multiprocessor (the shipped F is "
                         "attention_triton.PROGRAMS_PER_SM), e.g. 1,4,8: a launch choice, the bits the same")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    t0 = time.perf_counter()
    dev = resolve_device(ap, args)
    env = environment(dev)
    if args.smoke:
        args.decode, args.prefill, args.chunk, args.block_size = f"{SPLIT + 100}:1,2", f"{SPLIT + 40}", 256, 48
    decode = [(int(c), [int(b) for b in bs.split(",")]) for c, bs in (x.split(":") for x in args.decode.split(";") if x)]
    prefill = [int(x) for x in args.prefill.split(",") if x]
    alt = [int(x) for x in args.alt_block_n.split(",") if x]
    factors = [int(x) for x in args.program_factors.split(",") if x]
    if bad := [w for w in alt if SPLIT % w]:
        ap.error(f"--alt-block-n {bad}: a split of {SPLIT} keys must hold whole key blocks")
    print_header(f"bi_attention_long: {N_HEADS}/{KV_HEADS} heads x {HEAD_DIM}, block size {args.block_size}, split {SPLIT}", env)
    results: dict[str, Any] = {"env": env, "args": vars(args), "split": SPLIT, "rows": [], "checks": []}
    save = json_saver(args.out, results, t0)
    timer = Timer(dev)
    cuda = dev.type == "cuda"
    vllm_run = vllm_attention() if cuda else None
    results["vllm_kernel"] = None if vllm_run is None else vllm_run.params  # type: ignore[attr-defined]
    if cuda:
        results["hbm_gbs"], results["bf16_tflops"] = _hbm_gbs(dev, timer), _tflops(dev, timer)
        print(f"measured: HBM copy {results['hbm_gbs']:.0f} GB/s, bf16 GEMM {results['bf16_tflops']:.0f} TFLOP/s")
    scale = HEAD_DIM**-0.5
    g = torch.Generator(device=dev).manual_seed(0)
    for ctx, batches in decode:
        kc, vc, bt = _paged_cache(max(batches), ctx, args.block_size, dev, g)
        # bits: the decode of sequence 0's last query, split-parallel, equals its row in a packed prefill
        k0, v0 = _gather(kc, bt[0], ctx), _gather(vc, bt[0], ctx)
        q0 = torch.randn(ctx, N_HEADS, HEAD_DIM, device=dev, generator=g).bfloat16()
        cu = torch.tensor([0, ctx], dtype=torch.int32, device=dev)
        packed = bi_attention_fwd(q0, k0, v0, cu, cu[1:], ctx, scale, k_start=cu[:1])
        one = torch.tensor([0, 1], dtype=torch.int32, device=dev)
        dec = bi_attention_fwd(q0[-1:], kc, vc, one, cu[1:], 1, scale, block_table=bt[:1])
        results["checks"].append({"ctx": ctx, "decode_equals_packed": bool(torch.equal(dec, packed[-1:]))})
        print(f"ctx {ctx}: split-parallel decode == packed prefill row: {results['checks'][-1]['decode_equals_packed']}")
        for w in alt:
            with _block_n(w):
                same = torch.equal(bi_attention_fwd(q0[-1:], kc, vc, one, cu[1:], 1, scale, block_table=bt[:1]),
                                   bi_attention_fwd(q0, k0, v0, cu, cu[1:], ctx, scale, k_start=cu[:1])[-1:])
            results["checks"].append({"ctx": ctx, "block_n": w, "decode_equals_packed": bool(same)})
            print(f"ctx {ctx}, key blocks of {w}: split-parallel decode == packed prefill row: {same}")
        del k0, v0, q0, packed
        for B in batches:
            q = torch.randn(B, N_HEADS, HEAD_DIM, device=dev, generator=g).bfloat16()
            cu_q = torch.arange(B + 1, dtype=torch.int32, device=dev)
            sl = torch.full((B,), ctx, dtype=torch.int32, device=dev)
            bt_b = bt[:B]
            out = torch.empty_like(q)
            variants: dict[str, Callable[[], Any]] = {
                "bi_split": lambda: bi_attention_fwd(q, kc, vc, cu_q, sl, 1, scale, block_table=bt_b),
                "bi_tile": lambda: bi_attention_fwd(q, kc, vc, cu_q, sl, 1, scale, block_table=bt_b,
                                                    split_programs_override=1),
            }
            for name, how in _launch_variants("split"):
                variants[name] = lambda how=how: bi_attention_fwd(q, kc, vc, cu_q, sl, 1, scale, block_table=bt_b,
                                                                  launch=how)
            for w in alt:
                variants[f"n{w}_split"] = _with_block_n(w, lambda: bi_attention_fwd(q, kc, vc, cu_q, sl, 1, scale,
                                                                                     block_table=bt_b))
            max_splits = -(-bt_b.shape[1] * args.block_size // SPLIT)
            for f in factors:
                n_progs = attention_triton.split_programs(B, KV_HEADS, max_splits, dev, per_sm=f)
                variants[f"split_x{f}"] = lambda n=n_progs: bi_attention_fwd(q, kc, vc, cu_q, sl, 1, scale,
                                                                             block_table=bt_b, split_programs_override=n)
            if vllm_run is not None:
                segm = _segm_buffers(dev)
                variants["vllm"] = lambda: vllm_run(q, kc, vc, out, cu_q, 1, sl, ctx, bt_b, scale, segm)
            other_definitions = ("vllm",) + tuple(f"n{w}_split" for w in alt)
            row = {"variants_equal": _same_bits(variants, exclude=other_definitions)}
            row.update(_time(variants, timer, args.reps, graphs=cuda))
            # a variant whose bits differ is reported and never the fastest
            row["bits_differ"] = [n for n, ok in row["variants_equal"].items() if not ok]
            nbytes = B * ctx * KV_HEADS * HEAD_DIM * 2 * 2
            row.update(case=f"decode ctx={ctx} B={B}", ctx=ctx, B=B, bytes=nbytes)
            if cuda:
                row["floor_ms"] = nbytes / results["hbm_gbs"] / 1e6
            if "vllm_ms" in row:
                row["bi_over_vllm"] = row["bi_split_ms"] / row["vllm_ms"]
            results["rows"].append(row)
            save()
            print(_line(row))
        del kc, vc, bt
        if cuda:
            torch.cuda.empty_cache()
    for L in prefill:
        kc, vc, bt = _paged_cache(1, L, args.block_size, dev, g)
        q = torch.randn(L, N_HEADS, HEAD_DIM, device=dev, generator=g).bfloat16()
        out = torch.empty_like(q)
        chunks = [(s, min(s + args.chunk, L)) for s in range(0, L, args.chunk)]
        segm = _segm_buffers(dev) if vllm_run is not None else {}

        res = torch.empty_like(q)  # every BI variant copies its chunks here, so their bits can be compared

        def bi_prefill(how: Launch | None = None) -> torch.Tensor:
            for s, e in chunks:
                cuq = torch.tensor([0, e - s], dtype=torch.int32, device=dev)
                res[s:e].copy_(bi_attention_fwd(q[s:e], kc, vc, cuq, cuq[1:] + s, e - s, scale, block_table=bt,
                                                launch=how))
            return res.clone()

        def vllm_prefill() -> None:
            for s, e in chunks:
                cuq = torch.tensor([0, e - s], dtype=torch.int32, device=dev)
                vllm_run(q[s:e], kc, vc, out[s:e], cuq, e - s, cuq[1:] + s, e, bt, scale, segm)

        variants: dict[str, Callable[[], Any]] = {"bi_split": bi_prefill}
        for name, how in _launch_variants("tile"):
            variants[name] = lambda how=how: bi_prefill(how)
        for w in alt:
            variants[f"n{w}_tile"] = _with_block_n(w, bi_prefill)
        if vllm_run is not None:
            variants["vllm"] = vllm_prefill
        row = {"variants_equal": _same_bits(variants, exclude=("vllm",) + tuple(f"n{w}_tile" for w in alt))}
        row["bits_differ"] = [n for n, ok in row["variants_equal"].items() if not ok]
        row.update(_time(variants, timer, max(2, args.reps // 3)))
        flops = 2 * 2 * N_HEADS * HEAD_DIM * L * (L + 1) / 2  # QK^T and PV over the causal triangle
        row.update(case=f"prefill 1x{L} (chunks of {args.chunk})", ctx=L, B=1, flops=flops)
        if cuda:
            row["floor_ms"] = flops / results["bf16_tflops"] / 1e9
            row["bi_tflops"] = flops / row["bi_split_ms"] / 1e9
        if "vllm_ms" in row:
            row["bi_over_vllm"] = row["bi_split_ms"] / row["vllm_ms"]
        results["rows"].append(row)
        save()
        print(_line(row))
        del kc, vc, bt, q, out
    results["all_bits_equal"] = (all(c["decode_equals_packed"] for c in results["checks"])
                                 and all(not r.get("bits_differ") for r in results["rows"]))
    bi_cols = sorted({k for r in results["rows"] for k in r if k.endswith("_ms") and k.startswith(("split_", "tile_"))})
    alt_cols = sorted({k for r in results["rows"] for k in r if k.endswith("_ms") and k[0] == "n" and k[1].isdigit()})
    results["fastest"] = {r["case"]: min([("bi_split", r["bi_split_ms"])] + [(k[:-3], r[k]) for k in bi_cols
                                                                             if k in r and k[:-3] not in r.get("bits_differ", [])],
                                         key=lambda x: x[1]) for r in results["rows"]}
    save()
    cols = [("case", "case", ""), ("bi_split_ms", "BI split ms", ".4f"), ("bi_tile_ms", "BI per-tile ms", ".4f"),
            ("vllm_ms", "vLLM ms", ".4f"), ("floor_ms", "floor ms", ".4f"), ("bi_over_vllm", "BI/vLLM", ".2f"),
            ("bi_split_spread_pct", "spread %", ".1f")]
    print("\nSUMMARY " + ("bits equal" if results["all_bits_equal"] else "BITS DIFFER"))
    print(fmt_table(results["rows"], cols))
    print("fastest BI launch per case (bits equal): " + "; ".join(f"{c}: {n} {ms:.4f}" for c, (n, ms) in results["fastest"].items()))
    print(fmt_table(results["rows"], [("case", "case", "")] + [(k, k[:-3], ".4f") for k in bi_cols]))
    if alt_cols:
        print("other key-block widths (whole definitions; the shipped table's BI split ms beside them):")
        print(fmt_table(results["rows"], [("case", "case", ""), ("bi_split_ms", "shipped", ".4f")]
                        + [(k, k[:-3], ".4f") for k in alt_cols]))
    return 0 if results["all_bits_equal"] else 1


def _launch_variants(path: str) -> list[tuple[str, Launch]]:
    """Launches other than the shipped one (``TILE_LAUNCH`` at this head size for the per-tile path, else
    ``LAUNCH[path]``) to time beside it: prefetch on/off, 2-3 stages and, per tile, the table's and taller tiles."""
    shipped = attention_triton.TILE_LAUNCH.get(attention_triton.config_for(HEAD_DIM)[0], LAUNCH[path]) \
        if path == "tile" else LAUNCH[path]
    out = []
    for pf in (0, 1):
        for st in (2, 3):
            how = Launch(prefetch=pf, stages=st)
            if how != shipped:
                out.append((f"{path}_pf{pf}_st{st}", how))
    if path == "tile":  # the table's 64-row tile and other tall ones (bits checked like every variant)
        for rows, warps in ((None, None), (128, 8), (128, 16)):
            how = Launch(stages=shipped.stages, rows=rows, warps=warps)
            if how != shipped:
                out.append((f"tile_r{rows or 'table'}_w{warps or 'table'}", how))
    return [(n, h) for n, h in out if h != shipped]


@contextmanager
def _block_n(width: int) -> Iterator[None]:
    """The tile table with key blocks of ``width`` for this benchmark's head size, for the duration."""
    key = attention_triton.config_for(HEAD_DIM)[0]  # the table's key: the head size padded as the kernel pads it
    shipped = attention_triton.CONFIGS[key]
    attention_triton.CONFIGS[key] = (shipped[0], width, *shipped[2:])
    try:
        yield
    finally:
        attention_triton.CONFIGS[key] = shipped


def _with_block_n(width: int, fn: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        with _block_n(width):
            return fn()
    return run


def _same_bits(variants: dict[str, Callable[[], Any]], exclude: tuple[str, ...]) -> dict[str, bool]:
    """Per BI variant: whether its output equals the first's (the shipped launch)."""
    outs = {name: fn() for name, fn in variants.items() if name not in exclude}
    first = next(iter(outs.values()))
    return {name: bool(torch.equal(first, o)) for name, o in outs.items()}


def _graphed(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` captured once in a CUDA graph (after an eager call that compiles it); the replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _time(variants: dict[str, Callable[[], Any]], timer: Timer, reps: int, graphs: bool = False) -> dict[str, Any]:
    """Two interleaved rounds of every variant; per variant the mean of the round medians and their spread."""
    if graphs:
        variants = {name: _graphed(fn) for name, fn in variants.items()}
    med: dict[str, list[float]] = {k: [] for k in variants}
    for rnd in range(2):
        for name, fn in variants.items():
            med[name].append(statistics.median(timer.run(fn, warmup=2 if rnd == 0 else 1, reps=reps, max_s=10)))
    row: dict[str, Any] = {}
    for name, m in med.items():
        row[f"{name}_ms"] = statistics.mean(m)
        row[f"{name}_spread_pct"] = 100 * abs(m[0] - m[-1]) / statistics.mean(m)
    return row


def _line(row: dict[str, Any]) -> str:
    return "  " + row["case"] + ": " + ", ".join(f"{k} {v:.4f}" for k, v in row.items() if k.endswith("_ms"))


if __name__ == "__main__":
    sys.exit(main())
