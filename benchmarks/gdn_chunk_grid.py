"""What the chunk-grid gated delta rule (``kernels.gdn_chunk_grid``: boundary states by the chunk formula on
tensor-core tiles, rows by the recurrent kernel from them; prefill, decode and continued prefill with the same
bits) costs, against the shipped recurrent kernel (BI's prefill and decode today) and FLA's chunk kernel (titan's
non-BI prefill).

    python benchmarks/gdn_chunk_grid.py [--lengths 32768,65536] [--batches 1,8,32,128,256] [--out gdn_chunk_grid.json]
    TRITON_INTERPRET=1 python benchmarks/gdn_chunk_grid.py --smoke --device cpu   # toy sizes, seconds
    python benchmarks/gdn_chunk_grid.py --compile-only [--arch 90]   # no GPU needed: registers, spills

At the 9B's GDN heads (16 key / 32 value heads of 128), bf16 q/k/v/beta, fp32 g and state. First the bits
(``bits`` in the JSON; the run fails if any is False, and prints which part differs and from which output row): a
200-token prompt prefilled whole == continued from cuts after 1, 63, 64, 65, 130 tokens == prefilled to 60 then
decoded token by token to 70 (across the fold at 63/64) then prefilled (outputs, final state, running state,
boundary state, open-chunk rows); lengths 1, 63, 64, 65, 130 packed == each alone; a decode batch at mixed
positions (folding and not) == each sequence alone; a CUDA-graph replay of a decode step (folding and not) == the
eager step. Then timings, each variant timed in two interleaved rounds:

- prefill of one prompt per length: ``chunk_grid`` (``gdn_chunk_grid.prefill``, its host-side plan included, as an
  engine pays it; one profiled call splits it by kernel: ``_intra_kernel``, ``_chain_kernel``,
  ``_gdn_recurrent_kernel``, copies), ``recurrent`` (``gdn_triton.gated_delta_rule_recurrent``) and ``fla_chunk``
  (FLA's ``chunk_gated_delta_rule``, where importable; a failing FLA call is recorded, not fatal). Also checked
  there: the prompt prefilled to its last token and that token decoded gives the whole prefill's last output row
  and state;
- a decode step of B sequences: ``gdn_chunk_grid.decode`` at open-chunk row 31 (``grid_nofold``: the recurrent
  step, the row saved, fold launches whose programs exit at once) and row 63 (``grid_fold``: every sequence folds
  its chunk), both also replayed from CUDA graphs (``grid_graph_nofold``, ``grid_graph_fold``; and with the step's
  plan made beforehand, ``grid_graph_*_planned``: what each GDN layer after an engine step's first pays), against
  the recurrent kernel's step on a slotted state cache (as the engine runs it).
- ``chunk_grid_chain_w8`` / ``grid_fold_chain_w8`` (or ``_w4``): the same calls with the chain kernel at the other
  warp count (4 spills 40 B on sm_90, 8 none), to choose ``gdn_chunk_grid.NUM_WARPS``.

Floors predicted at the 9B's heads (H100 SXM: ~990 dense bf16 TFLOP/s, ~67 fp32 CUDA-core TFLOP/s, ~3.3 TB/s):
- 32K prefill (512 chunks): folds 7 MFLOP per chunk and value head (k k^T, T (k..), T (v..): 3 x 64x64x128 MACs;
  W S, kg^T delta: 2 x 64x128x128) x 16384 = 115 GFLOP on tensor cores, ~0.1 ms; their scratch (W, U, kg bf16,
  48 KiB per chunk and head) 0.75 GiB written and read, ~0.6 ms where it leaves L2; the serial chain (512
  steps of 2 dependent small products) ~1 ms. Rows: ~6 K V FLOP per token and value head on CUDA cores (k^T S,
  q^T S, the update) = 100 GFLOP, ~1.5 ms, over 512 x 32 x 4 independent 64-token programs; boundary states (64
  KiB per chunk and head) written by the chain, read and written back by the recurrent launch: 3 GiB, ~0.9 ms;
  q/k/v/o ~0.8 GB, ~0.25 ms. Expected ~3-5 ms (the intra and recurrent launches overlap nothing: they add).
- B=256 decode, no fold: the recurrent step (S read and written: 1 GiB, ~0.35 ms) + the row saved (~1 MB) + two
  launches whose 8192 + 32768 programs exit at once (~10 us): ~0.4 ms, the recurrent form's. A folding step adds
  the tile of every sequence (94 GFLOP-equivalent of 64-row tiles, scratch ~0.5 GB, S_b read and written 1 GiB):
  ~1.5-2.5 ms, once every 64 tokens (~0.03 ms a step amortised).

``--compile-only`` compiles the fold kernels at the 9B's heads for ``sm_<arch>`` without a GPU and reports, per
kernel, the registers and spill bytes where a ptxas that takes the PTX is found (Triton's own).
"""

from __future__ import annotations

import glob
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Timer, add_timing_args, base_parser, bit_diff, environment, fmt_table  # noqa: E402
from bench_common import json_saver, print_header, profile_step, resolve_device  # noqa: E402

from titan_rl_ext.kernels import gdn_chunk_grid as cg  # noqa: E402
from titan_rl_ext.kernels.gdn_triton import gated_delta_rule_recurrent  # noqa: E402

H, HV, K, V = 16, 32, 128, 128
CHAIN_WARPS_AB = 12 - cg.NUM_WARPS["chain"]  # the chain kernel's other warp count (4 <-> 8), timed beside it
DECODE_ROWS = {"nofold": 0.5, "fold": 1.0}  # open-chunk rows timed: C/2 - 1 and C - 1 (63: every sequence folds)


def _inputs(T: int, dev: torch.device, heads: tuple[int, int, int, int], seed: int) -> dict[str, torch.Tensor]:
    h, hv, k, v = heads
    gen = torch.Generator(device=dev).manual_seed(seed)
    return dict(
        q=F.normalize(torch.randn(T, h, k, device=dev, generator=gen), dim=-1).bfloat16(),
        k=F.normalize(torch.randn(T, h, k, device=dev, generator=gen), dim=-1).bfloat16(),
        v=torch.randn(T, hv, v, device=dev, generator=gen).bfloat16(),
        g=-torch.rand(T, hv, device=dev, generator=gen) * 0.1,
        beta=torch.rand(T, hv, device=dev, generator=gen).bfloat16(),
    )


def _fla() -> Callable[..., Any] | None:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:
        return None
    return chunk_gated_delta_rule


def _time(timer: Timer, variants: dict[str, Callable[[], Any]], args: Any) -> dict[str, float]:
    """Mean of two interleaved rounds' medians per variant (ms), and the rounds' spread (%)."""
    med: dict[str, list[float]] = {n: [] for n in variants}
    for rnd in range(2):
        for name, fn in variants.items():
            med[name].append(statistics.median(timer.run(fn, warmup=args.warmup if rnd == 0 else 0,
                                                         reps=args.reps, max_s=args.max_s)))
    row: dict[str, float] = {}
    for name, m in med.items():
        row[f"{name}_ms"] = statistics.mean(m)
        row[f"{name}_spread_pct"] = 100 * abs(m[0] - m[-1]) / max(statistics.mean(m), 1e-12)
    return row


def _chain_warps(fn: Callable[[], Any], num_warps: int) -> Callable[[], Any]:
    """``fn`` with the chain kernel at ``num_warps`` (the shipped count is ``cg.NUM_WARPS``): an A/B of the chain's
    warps inside one timing round, not a setting (every process must compile the same kernels)."""
    def call() -> Any:
        shipped = cg.NUM_WARPS["chain"]
        cg.NUM_WARPS["chain"] = num_warps
        try:
            return fn()
        finally:
            cg.NUM_WARPS["chain"] = shipped
    return call


def _prefill_row(T: int, dev: torch.device, heads: tuple[int, int, int, int], chunk: int, timer: Timer,
                 args: Any, fla: Callable[..., Any] | None) -> dict[str, Any]:
    x = _inputs(T, dev, heads, seed=T)
    qkvgb = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    s0 = torch.randn(1, *heads[1:2], heads[2], heads[3], device=dev, generator=torch.Generator(device=dev)
                     .manual_seed(1)) * 0.1
    scale = heads[2] ** -0.5
    cu_t = torch.tensor([0, T], dtype=torch.int32, device=dev)
    whole = cg.new_state(1, *heads[1:], chunk, dev, s0)
    o_w, fin_w = cg.prefill(*qkvgb, [0, T], scale, *whole)
    # the bits: prefill to the last token, decode it
    part = cg.new_state(1, *heads[1:], chunk, dev, s0)
    cg.prefill(*(t[:T - 1] for t in qkvgb), [0, T - 1], scale, *part)
    o_last = cg.decode(*(t[T - 1:] for t in qkvgb), scale, *part, torch.tensor([T - 1], device=dev))
    bits = _same_bits(o_last[0], o_w[T - 1]) and all(_same_state(part, whole, T % chunk).values())
    o_r, fin_r = gated_delta_rule_recurrent(*qkvgb, cu_t, scale, s0)
    row: dict[str, Any] = {
        "case": f"prefill 1x{T}", "T": T, "decode_continues_prefill_bits": bool(bits),
        "max_abs_o_vs_recurrent": (o_w.float() - o_r.float()).abs().max().item(),
        "max_abs_state_vs_recurrent": (fin_w - fin_r).abs().max().item(),
        # per chunk and value head: W, U, kg [C, K|V] bf16, the boundary state [K, V] fp32
        "scratch_mib": (len(cg.chunk_plan([0, T], [0], chunk)["tok"]) * heads[1]
                        * (chunk * 2 * (2 * heads[2] + heads[3]) + 4 * heads[2] * heads[3])) / 2**20,
    }
    del o_w, fin_w, fin_r, part
    state = cg.new_state(1, *heads[1:], chunk, dev, s0)
    variants: dict[str, Callable[[], Any]] = {
        "recurrent": lambda: gated_delta_rule_recurrent(*qkvgb, cu_t, scale, s0),
        # the state advances in place at every call: the same work each time
        "chunk_grid": lambda: cg.prefill(*qkvgb, [0, T], scale, *state),
    }
    variants[f"chunk_grid_chain_w{CHAIN_WARPS_AB}"] = _chain_warps(variants["chunk_grid"], CHAIN_WARPS_AB)
    if fla is not None:
        def fla_chunk() -> Any:
            return fla(*(t[None] for t in qkvgb), scale=scale, initial_state=s0, output_final_state=True,
                       cu_seqlens=cu_t.long())
        try:  # a baseline only: an FLA that fails here leaves the row without it
            o_f, _ = fla_chunk()
            row["max_abs_o_fla_vs_recurrent"] = (o_f[0].float() - o_r.float()).abs().max().item()
            variants["fla_chunk"] = fla_chunk
        except Exception as e:
            row["fla_chunk_error"] = f"{type(e).__name__}: {e}"[:300]
    del o_r
    row.update(_time(timer, variants, args))
    row["recurrent_over_grid"] = row["recurrent_ms"] / row["chunk_grid_ms"]
    if dev.type == "cuda":
        try:
            prof = profile_step(variants["chunk_grid"], dev, top=8)
            row["grid_kernels_ms"] = {r["name"]: r["total_ms"] for r in prof["top"]}
        except Exception as e:  # the profile is a breakdown, not a result: keep the timings
            row["grid_kernels_ms"] = f"profile failed: {type(e).__name__}: {e}"
    return row


def _decode_row(B: int, dev: torch.device, heads: tuple[int, int, int, int], chunk: int, timer: Timer,
                args: Any) -> dict[str, Any]:
    x = _inputs(B, dev, heads, seed=B + 7)
    qkvgb = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    scale = heads[2] ** -0.5
    # every sequence's open chunk filled by a prefill of one chunk less a token (its rows 0..C-2 real)
    fill = _inputs(B * (chunk - 1), dev, heads, seed=B + 8)
    s0 = torch.randn(B, *heads[1:], device=dev, generator=torch.Generator(device=dev).manual_seed(B)) * 0.1
    st = cg.new_state(B, *heads[1:], chunk, dev, s0)
    cg.prefill(*fill.values(), list(range(0, B * (chunk - 1) + 1, chunk - 1)), scale, *st)
    row: dict[str, Any] = {"case": f"decode B={B}", "B": B}
    # the bits: a batch == each sequence alone (the first two), at row C - 1 after the prefill's rows (a fold)
    pos = torch.full((B,), chunk - 1, dtype=torch.int64, device=dev)
    batch = _clone(st)
    o_b = cg.decode(*qkvgb, scale, *batch, pos)
    ok = True
    for n in range(min(B, 2)):
        one = _clone(st, slice(n, n + 1))
        o_1 = cg.decode(*(t[n:n + 1] for t in qkvgb), scale, *one, pos[n:n + 1])
        same = _same_state(_clone(batch, slice(n, n + 1)), one, 0)
        ok = ok and _same_bits(o_b[n:n + 1], o_1) and all(same.values())
    row["batch_equals_alone_bits"] = bool(ok)
    cache = st[0].clone()
    slots = torch.arange(B, dtype=torch.int32, device=dev)
    cu_t = torch.arange(B + 1, dtype=torch.int32, device=dev)
    variants: dict[str, Callable[[], Any]] = {
        "recurrent": lambda: gated_delta_rule_recurrent(*qkvgb, cu_t, scale, cache, state_slots=slots),
    }
    for name, frac in DECODE_ROWS.items():
        i = int(frac * chunk) - 1
        row[f"row_{name}"] = i
        p_i = torch.full((B,), i, dtype=torch.int64, device=dev)
        # rows before i hold the prefill's rows; a row-63 step folds every call (the same work every time)
        variants[f"grid_{name}"] = lambda p_i=p_i: cg.decode(*qkvgb, scale, *st, p_i)
        if name == "fold":
            variants[f"grid_fold_chain_w{CHAIN_WARPS_AB}"] = _chain_warps(variants["grid_fold"], CHAIN_WARPS_AB)
        # the plan made beforehand: what each GDN layer after an engine step's first pays
        plan_i = cg.make_decode_plan(p_i, torch.arange(B, device=dev), chunk)
        variants[f"grid_{name}_planned"] = lambda plan_i=plan_i: cg.decode(*qkvgb, scale, *st, plan=plan_i)
        if dev.type == "cuda":
            for suffix, plan in (("", None), ("_planned", plan_i)):
                graph, err, bits = _decode_graph(qkvgb, scale, st, p_i, plan)
                row[f"graph_{name}{suffix}_equals_eager_bits"] = bits
                if graph is not None:
                    variants[f"grid_graph_{name}{suffix}"] = graph
                else:
                    row[f"graph_{name}{suffix}_error"] = err
    row.update(_time(timer, variants, args))
    return row


def _decode_graph(qkvgb: tuple[torch.Tensor, ...], scale: float, st: cg.GridState, pos: torch.Tensor,
                  plan: dict[str, torch.Tensor] | None = None) -> tuple[Any, str, bool]:
    """A decode step captured in a CUDA graph (the plan made on the device: nothing to sync; or ``plan``, made
    beforehand and outside the graph) and its replay's bits against the eager step from the same state without a
    plan: ``(replay, "", equal)``, or ``(None, error, False)``."""
    def step(state: cg.GridState) -> torch.Tensor:
        return cg.decode(*qkvgb, scale, *state, pos) if plan is None else cg.decode(*qkvgb, scale, *state, plan=plan)

    try:
        eager = _clone(st)
        o_e = cg.decode(*qkvgb, scale, *eager, pos)
        own = _clone(st)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(_clone(st))  # warm-up: compile outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_g = step(own)
        for t, src in zip(own, st):
            t.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        same = _same_state(own, eager, int(pos[0].item()) % own[2].shape[2] + 1)
        if not (_same_bits(o_g, o_e) and all(same.values())):
            print(f"graph bits differ: outputs {_same_bits(o_g, o_e)}, {same}")
        # the captured launches address ``own`` and ``o_g``: the replay closure keeps them alive (freed, a replay
        # would write into memory the allocator has handed out again)
        return (lambda: (graph.replay(), own, o_g)[0]), "", bool(_same_bits(o_g, o_e) and all(same.values()))
    except Exception as e:  # a failed capture is a result to report, not a crash
        return None, f"{type(e).__name__}: {e}"[:300], False


def _clone(st: cg.GridState, sl: slice = slice(None)) -> cg.GridState:
    """Rows ``sl`` of each state tensor, copied."""
    return (st[0][sl].clone(), st[1][sl].clone(), st[2][sl].clone())


def _same_state(a: cg.GridState, b: cg.GridState, n_open: int) -> dict[str, bool]:
    """Running state, boundary state and the open chunk's ``n_open`` rows bit for bit (rows as integers: an fp32
    g's low half may read as a bf16 NaN), by part."""
    return {"running_state": _same_bits(a[0], b[0]), "boundary_state": _same_bits(a[1], b[1]),
            "open_rows": _same_bits(a[2][:, :, :n_open], b[2][:, :, :n_open])}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality as integers (``bench_common.bit_diff``), printing non-finite values and, where the bits differ,
    how many elements and by how much."""
    d = bit_diff(a, b)
    if d["nonfinite"] and sum(d["nonfinite"]):
        print(f"  non-finite values in a compared tensor: {sum(d['nonfinite'])} "
              f"(bits {'equal' if d['equal_bits'] else 'differ'})")
    if not d["equal_bits"] and d["differing"] is not None:
        print(f"  {d['differing']} of {a.numel()} elements differ, max |diff| over finite pairs "
              f"{d['max_abs'] if d['max_abs'] is not None else float('nan'):.3g}")
    return d["equal_bits"]


def _bits(dev: torch.device, heads: tuple[int, int, int, int], chunk: int) -> dict[str, bool]:
    """Whole == continued == decoded, packed == alone (the module docstring's list), at ``heads``."""
    scale = heads[2] ** -0.5
    T = 200 if chunk == cg.CHUNK else 3 * chunk + 8
    x = _inputs(T, dev, heads, seed=11)
    qkvgb = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    s0 = torch.randn(1, *heads[1:2], heads[2], heads[3], device=dev,
                     generator=torch.Generator(device=dev).manual_seed(3)) * 0.1
    whole = cg.new_state(1, *heads[1:], chunk, dev, s0)
    o_w, fin_w = cg.prefill(*qkvgb, [0, T], scale, *whole)

    def same(name: str, st: cg.GridState, o: torch.Tensor, fin: torch.Tensor) -> bool:
        parts_ok = {"outputs": _same_bits(o, o_w), "final_state": _same_bits(fin, fin_w),
                    **_same_state(st, whole, T % chunk)}
        if not all(parts_ok.values()):  # which part, and from which token on the outputs differ
            bad = (o != o_w).flatten(1).any(1).nonzero()
            print(f"bits differ ({name}): {parts_ok}, first differing output row "
                  f"{bad[0].item() if len(bad) else None}")
        return all(parts_ok.values())

    out: dict[str, bool] = {}
    cuts = [c for c in (1, chunk - 1, chunk, chunk + 1, 2 * chunk + 2) if c < T]
    st = cg.new_state(1, *heads[1:], chunk, dev, s0)
    parts = []
    for lo, hi in zip([0, *cuts], [*cuts, T]):
        o_p, fin = cg.prefill(*(t[lo:hi] for t in qkvgb), [0, hi - lo], scale, *st, pos=[lo])
        parts.append(o_p)
    out["continued_from_cuts"] = same("continued_from_cuts", st, torch.cat(parts), fin)
    d0, d1 = chunk - 4, chunk + 6
    st = cg.new_state(1, *heads[1:], chunk, dev, s0)
    parts = [cg.prefill(*(t[:d0] for t in qkvgb), [0, d0], scale, *st)[0]]
    for p in range(d0, d1):
        parts.append(cg.decode(*(t[p:p + 1] for t in qkvgb), scale, *st, torch.tensor([p], device=dev)))
    o_e, fin = cg.prefill(*(t[d1:] for t in qkvgb), [0, T - d1], scale, *st, pos=[d1])
    out["decoded_across_a_fold"] = same("decoded_across_a_fold", st, torch.cat([*parts, o_e]), fin)
    lens = [1, chunk - 1, chunk, chunk + 1, 2 * chunk + 2]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    y = _inputs(cu[-1], dev, heads, seed=12)
    qkvgb = (y["q"], y["k"], y["v"], y["g"], y["beta"])
    st = cg.new_state(len(lens), *heads[1:], chunk, dev)
    o, fin = cg.prefill(*qkvgb, cu, scale, *st)
    ok = True
    for n, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
        one = cg.new_state(1, *heads[1:], chunk, dev)
        o_1, fin_1 = cg.prefill(*(t[lo:hi] for t in qkvgb), [0, hi - lo], scale, *one)
        parts_ok = {"outputs": _same_bits(o[lo:hi], o_1), "final_state": _same_bits(fin[n:n + 1], fin_1),
                    **_same_state(_clone(st, slice(n, n + 1)), one, lens[n] % chunk)}
        if not all(parts_ok.values()):
            print(f"bits differ (packed_equals_alone, length {lens[n]}): {parts_ok}")
        ok = ok and all(parts_ok.values())
    out["packed_equals_alone"] = bool(ok)
    z = _inputs(len(lens), dev, heads, seed=13)
    qkvgb = (z["q"], z["k"], z["v"], z["g"], z["beta"])
    pos = torch.tensor(lens, device=dev)  # open rows 1, 63 (a fold), 0, 1, 2
    batch = _clone(st)
    o_b = cg.decode(*qkvgb, scale, *batch, pos)
    ok = True
    for n in range(len(lens)):
        one = _clone(st, slice(n, n + 1))
        o_1 = cg.decode(*(t[n:n + 1] for t in qkvgb), scale, *one, pos[n:n + 1])
        parts_ok = {"outputs": _same_bits(o_b[n:n + 1], o_1),
                    **_same_state(_clone(batch, slice(n, n + 1)), one, (lens[n] + 1) % chunk)}
        if not all(parts_ok.values()):
            print(f"bits differ (decode_batch_equals_alone, position {lens[n]}): {parts_ok}")
        ok = ok and all(parts_ok.values())
    out["decode_batch_equals_alone"] = bool(ok)
    return out


def _compile_report(arch: int) -> list[dict[str, Any]]:
    """Each kernel compiled for ``sm_<arch>`` (no device needed): FMAs in its PTX, and ptxas's registers/spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from titan_rl_ext.kernels import gdn_chunk_grid_triton as kt

    heads = dict(H=H, HV=HV, K=K, V=V, C=cg.CHUNK, UPCAST=False)
    ptrs = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "beta_ptr": "*bf16", "o_ptr": "*bf16",
            "g_ptr": "*fp32", "bufh_ptr": "*bf16", "buff_ptr": "*fp32", "w_ptr": "*bf16", "u_ptr": "*bf16",
            "kg_ptr": "*bf16", "gl_ptr": "*fp32", "a_ptr": "*fp32", "sb_ptr": "*fp32", "srun_ptr": "*fp32",
            "scr_ptr": "*fp32"}
    specs = [
        ("intra", kt._intra_kernel, dict(heads, R=cg.row_layout(K, V)["R"])),
        ("chain", kt._chain_kernel, {k: v for k, v in dict(heads, BV=cg.BV).items() if k != "H"}),
    ]
    ptxas = sorted(glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas*")))
    rows = []
    for name, fn, consts in specs:
        sig = {a: "constexpr" if a in consts else ptrs.get(a, "*i32" if a.endswith("_ptr") else
                                                         "fp32" if a == "scale" else "i32") for a in fn.arg_names}
        t0 = time.perf_counter()
        kern = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": cg.NUM_WARPS[name], "enable_fp_fusion": True})
        ptx = kern.asm["ptx"]
        row: dict[str, Any] = {"kernel": name, "num_warps": cg.NUM_WARPS[name], "compile_s": time.perf_counter() - t0,
                               # reads through the non-coherent path would not see this program's own writes
                               "ptx_ld_nc": len(re.findall(r"\bld\.global\.nc", ptx)),
                               # warp-group (Hopper's wgmma) vs warp-level tensor-core products
                               "ptx_wgmma": len(re.findall(r"\bwgmma\.mma_async", ptx)),
                               "ptx_mma_sync": len(re.findall(r"\bmma\.sync", ptx))}
        path = f"/tmp/gdn_chunk_grid_{name}_{os.getpid()}.ptx"
        with open(path, "w") as f:
            f.write(ptx)
        for exe in ptxas:  # the first that accepts this PTX version
            r = subprocess.run([exe, f"-arch=sm_{arch}a", "-v", path, "-o", os.devnull], capture_output=True,
                               text=True)
            out = r.stdout + r.stderr
            if r.returncode == 0:
                regs = re.search(r"Used (\d+) registers", out)
                spill = re.search(r"(\d+) bytes spill stores", out)
                row.update(registers=int(regs.group(1)) if regs else None,
                           spill_store_bytes=int(spill.group(1)) if spill else None, ptxas=os.path.basename(exe))
                break
        os.remove(path)
        rows.append(row)
        print("  " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    return rows


def main() -> int:
    ap = base_parser(__doc__, "toy heads and lengths (CPU, interpreter)")
    ap.add_argument("--lengths", default="32768,65536")
    ap.add_argument("--batches", default="1,8,32,128,256")
    ap.add_argument("--out", default="")
    ap.add_argument("--compile-only", action="store_true", help="compile for --arch without a GPU and report")
    ap.add_argument("--arch", type=int, default=90)
    add_timing_args(ap, warmup=1, reps=5, max_s=10.0)
    args = ap.parse_args()
    if args.compile_only:
        rows = _compile_report(args.arch)
        if args.out:
            Path(args.out).write_text(json.dumps({"compile": rows}, indent=1))
        return 0
    if args.smoke:  # checks and one timed call each: seconds under the interpreter
        args.warmup, args.reps, args.max_s = 0, 1, 1.0
    t0 = time.perf_counter()
    dev = resolve_device(ap, args)
    heads = (1, 2, 16, 16) if args.smoke else (H, HV, K, V)
    chunk = 16 if args.smoke else cg.CHUNK
    lengths = [21] if args.smoke else [int(x) for x in args.lengths.split(",") if x]
    batches = [2] if args.smoke else [int(x) for x in args.batches.split(",") if x]
    env = environment(dev)
    print_header(f"gdn_chunk_grid: {heads[0]}/{heads[1]} heads x {heads[2]}x{heads[3]}, chunk {chunk}", env)
    nine_b = cg.state_bytes(HV, K, V, cg.CHUNK)
    print(f"state per sequence and layer at the 9B's heads, chunk {cg.CHUNK}: S_run {nine_b['S_run']:,} B + S_b "
          f"{nine_b['S_b']:,} B + buffer {nine_b['buffer']:,} B = {nine_b['total'] / 2**20:.2f} MiB (recurrent: "
          f"{nine_b['S_run'] / 2**20:.2f} MiB)")
    results: dict[str, Any] = {"env": env, "args": vars(args), "chunk": chunk, "heads": heads,
                               "state_bytes_9b": nine_b, "state_bytes_run": cg.state_bytes(*heads[1:], chunk),
                               "rows": []}
    save = json_saver(args.out, results, t0)
    timer = Timer(dev)
    fla = _fla() if dev.type == "cuda" else None
    results["bits"] = _bits(dev, heads, chunk)
    print("bits:", results["bits"])
    save()
    rows: list[dict[str, Any]] = []
    results["rows"] = rows
    for T in lengths:  # each row saved as it lands: a fault (an illegal access ends the process) keeps the rest
        rows.append(_prefill_row(T, dev, heads, chunk, timer, args, fla))
        save()
    for B in batches:
        rows.append(_decode_row(B, dev, heads, chunk, timer, args))
        save()
    for row in rows:
        print("  " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    pre = [r for r in rows if "T" in r]
    dec = [r for r in rows if "B" in r]
    print("\nPREFILL\n" + fmt_table(pre, [
        ("case", "case", ""), ("recurrent_ms", "recurrent ms", ".3f"), ("chunk_grid_ms", "chunk grid ms", ".3f"),
        (f"chunk_grid_chain_w{CHAIN_WARPS_AB}_ms", f"chain w{CHAIN_WARPS_AB} ms", ".3f"),
        ("fla_chunk_ms", "FLA chunk ms", ".3f"), ("recurrent_over_grid", "rec/grid", ".2f"),
        ("max_abs_o_vs_recurrent", "max|o diff|", ".1e"), ("decode_continues_prefill_bits", "bits", "")]))
    print("\nDECODE\n" + fmt_table(dec, [("case", "case", ""), ("recurrent_ms", "recurrent ms", ".4f")]
                                   + [(f"grid_{n}_ms", f"grid {n} ms", ".4f") for n in DECODE_ROWS]
                                   + [(f"grid_fold_chain_w{CHAIN_WARPS_AB}_ms", f"fold chain w{CHAIN_WARPS_AB} ms",
                                       ".4f")]
                                   + [(f"grid_graph_{n}_ms", f"graph {n} ms", ".4f") for n in DECODE_ROWS]
                                   + [(f"grid_graph_{n}_planned_ms", f"graph {n} planned ms", ".4f")
                                      for n in DECODE_ROWS]
                                   + [("batch_equals_alone_bits", "bits", "")]))
    ok = (all(results["bits"].values()) and all(r["decode_continues_prefill_bits"] for r in pre)
          and all(r["batch_equals_alone_bits"] and all(r.get(f"graph_{n}{sfx}_equals_eager_bits", True)
                                                       for n in DECODE_ROWS for sfx in ("", "_planned"))
                  for r in dec))
    print("bits:", "ok" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
