"""Helpers shared by the issue-8 benchmarks (bi_gemm, gdn_kernels, bi_trainer_step, bi_inference).

Not a script. Each benchmark imports it as a sibling module (``sys.path`` gets the benchmark's own folder), so
``python benchmarks/X.py`` works from any directory; importing this module puts the repository root on
``sys.path`` for ``titan_rl_ext``.

- environment / output: ``environment``, ``print_header``, ``env_summary``, ``fmt_table``, ``write_json``,
  ``json_saver``
- timing: ``sync``, ``Timer`` (CUDA events, L2 flush, warm-up), ``two_rounds`` (the per-round medians of
  the interleaved rounds as a row)
- command line: ``base_parser``, ``add_timing_args``, ``resolve_device``
- FLA: ``fla_chunk_bwd_guard`` (FLA issue #640)
- profiler: ``profile_step`` (one call's CUDA kernels by total time, with heuristic categories),
  ``print_profile``
- model: ``build_slice`` (the 4-layer Qwen3.5-9B slice of bi_trainer_step and bi_inference), ``two_packings``
  (the same sequences packed two ways, for their batch-composition checks)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

if TYPE_CHECKING:
    from titan_rl_ext.models.common.batch import SeqBatch
    from titan_rl_ext.models.common.decoder import Decoder
    from titan_rl_ext.models.qwen3_5.model import Qwen3_5Config

# --------------------------------------------------------------------------------------------------
# command line


def base_parser(doc: str, smoke_help: str) -> argparse.ArgumentParser:
    """The parser every issue-8 benchmark starts from: description = the docstring's first paragraph,
    ``--device`` (cuda when available) and ``--smoke``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help=smoke_help)
    return ap


def add_timing_args(ap: argparse.ArgumentParser, warmup: int, reps: int, max_s: float) -> None:
    """``--warmup``, ``--reps``, ``--max-s`` (in that order) with the script's defaults."""
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--max-s", type=float, default=max_s, help="cap on one timing run (s)")


def resolve_device(ap: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device")
    return dev


# --------------------------------------------------------------------------------------------------
# timing


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def bit_diff(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    """Two tensors compared as integers (``torch.equal`` on floats reads a NaN as differing from itself, so a
    deterministic NaN would pass for a race): whether every bit agrees, how many elements differ, each side's
    non-finite count and the largest ``|a - b|`` over finite pairs. Another shape or dtype: not equal, nothing
    counted."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return {"equal_bits": False, "differing": None, "nonfinite": None, "max_abs": None}
    ia, ib = (x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32) for x in (a, b))
    same = ia == ib
    fa, fb = torch.isfinite(a.float()), torch.isfinite(b.float())
    d = (a.float() - b.float()).abs()[fa & fb]
    return {"equal_bits": bool(same.all()), "differing": int((~same).sum()),
            "nonfinite": [int((~fa).sum()), int((~fb).sum())], "max_abs": float(d.max()) if d.numel() else None}


class Timer:
    """Per-rep milliseconds of ``fn()`` after ``warmup`` untimed calls.

    CUDA: device events around each rep, each rep preceded by zeroing a 256 MiB buffer. That evicts the
    50 MiB L2 (weights are not cache resident in a real model step either), and since the zeroing keeps
    the GPU busy while Python enqueues the timed call, the start event is not followed by an idle gap
    waiting for the host (the trick ``triton.testing.do_bench`` uses). CPU: ``perf_counter``.
    ``max_s`` stops a run early once at least ``min_reps`` reps are done, so slow variants cannot eat
    the device budget.
    """

    def __init__(self, dev: torch.device, flush_mib: int = 256) -> None:
        self.dev = dev
        self.flush = torch.empty(flush_mib << 20, dtype=torch.int8, device=dev) if dev.type == "cuda" else None

    def run(self, fn: Callable[[], Any], warmup: int = 2, reps: int = 10, max_s: float = 5.0, min_reps: int = 1) -> list[float]:
        for _ in range(warmup):
            fn()
        sync(self.dev)
        times: list[float] = []
        stop_at = time.perf_counter() + max_s
        for i in range(reps):
            if self.flush is not None:
                self.flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            if i + 1 >= min_reps and time.perf_counter() > stop_at:
                break
        return times


def two_rounds(med: list[float]) -> dict[str, float]:
    """The medians of the interleaved rounds as a row: r1 = first, r2 = last, ms = their mean, spread in %."""
    ms = statistics.mean(med)
    return {"ms_r1": med[0], "ms_r2": med[-1], "ms": ms, "spread_pct": 100 * abs(med[0] - med[-1]) / ms}


@contextlib.contextmanager
def env_set(**values: str) -> Iterator[None]:
    """Settings the kernels read at each call (``TITAN_GDN_RECURRENT``) for a block, restored afterwards."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def torch_head_lse() -> Iterator[None]:
    """For a block, the LM head's log-softmax through ``torch.log_softmax`` even where the project's statistics
    kernel replicates it: the same bits (checked), another time."""
    from titan_rl_ext.kernels import lm_head

    before = lm_head._lse_variant
    lm_head._lse_variant = lambda logits: None
    try:
        yield
    finally:
        lm_head._lse_variant = before


# --------------------------------------------------------------------------------------------------
# environment / output


def environment(dev: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "device": str(dev)}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    try:
        info["fla_core"] = importlib.metadata.version("fla-core")
    except Exception:
        info["fla_core"] = None
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sm_count=p.multi_processor_count,
                    gpu_mem_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda,
                    tf32_matmul=torch.backends.cuda.matmul.allow_tf32, launch_tables=launch_tables_for(p.name))
    else:
        info.update(gpu=None, cpu=platform.machine(), torch_threads=torch.get_num_threads())
    info.update(git_state())
    return info


def launch_tables_for(gpu_name: str) -> dict[str, str | None]:
    """Which GPU's entry of each measured launch table serves ``gpu_name`` (None: the built-in defaults); a GPU
    without its own entry borrows one measured on its die (``kernels.gpu_tables``)."""
    import json

    from titan_rl_ext.kernels.batch_invariant_triton import TABLES_FILE
    from titan_rl_ext.kernels.conv_triton import BWD_TABLE_FILE
    from titan_rl_ext.kernels.gpu_tables import table_entry

    out: dict[str, str | None] = {}
    for name, path in (("bi_gemm", TABLES_FILE), ("conv_bwd", BWD_TABLE_FILE)):
        found = table_entry(json.loads(path.read_text()), gpu_name) if path.exists() else None
        out[name] = found[0] if found else None
    return out


def git_state() -> dict[str, str | None]:
    """``git``: HEAD, with ``+changes`` when the files differ from it; ``git_tree``: the hash of the tree
    the files form (``git write-tree`` through a scratch index). A device machine's copy of the repo may
    carry an older ``.git`` than its files: ``git_tree`` equals ``git rev-parse <commit>^{tree}`` of the
    commit that really ran, whatever HEAD says there."""
    import os
    import tempfile

    def git(*args: str, env: dict[str, str] | None = None) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=20,
                              env=env).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD") or None
        with tempfile.TemporaryDirectory() as d:
            env = dict(os.environ, GIT_INDEX_FILE=os.path.join(d, "index"))
            git("read-tree", "HEAD", env=env)
            git("add", "-A", env=env)
            tree = git("write-tree", env=env) or None
        same = tree is not None and tree == git("rev-parse", "HEAD^{tree}")
        return {"git": head if same or head is None else f"{head}+changes", "git_tree": tree}
    except Exception:
        return {"git": None, "git_tree": None}


def print_header(title: str, env: dict[str, Any]) -> None:
    print(f"=== {title}")
    print("    " + "  ".join(f"{k}={v}" for k, v in env.items()))


def env_summary(env: dict[str, Any], fla: bool = True) -> str:
    """The device and versions part of a SUMMARY line."""
    s = f"{env.get('gpu') or env.get('cpu')}  torch {env['torch']}  triton {env['triton']}"
    return s + (f"  fla {env['fla_core']}" if fla else "")


def fmt_table(rows: list[dict[str, Any]], cols: list[tuple[str, str, str]]) -> str:
    """cols: (key, header, format spec); missing values print as '-'."""
    def cell(r: dict[str, Any], k: str, f: str) -> str:
        v = r.get(k)
        return "-" if v is None else format(v, f)

    cells = [[h for _, h, _ in cols]] + [[cell(r, k, f) for k, _, f in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))) for row in cells)


def write_json(path: str, obj: Any) -> None:
    Path(path).write_text(json.dumps(obj, indent=1))


def json_saver(out: str, results: dict[str, Any], t_start: float) -> Callable[[], None]:
    """``save()``: writes ``results`` (plus ``wall_s`` since ``t_start``) to ``out`` when given, so partial
    results survive a timeout; a no-op without ``out``."""
    def save() -> None:
        if out:
            results["wall_s"] = time.perf_counter() - t_start
            write_json(out, results)
    return save


# --------------------------------------------------------------------------------------------------
# FLA issue #640 guard


def fla_chunk_bwd_guard(override: bool, overridden: str) -> str:
    """fla-core 0.6.0 refuses its chunk backward on Hopper with Triton 3.4..3.7.0 (FLA #640); the project
    overrides that guard itself (``kernels.gdn.allow_fla_chunk_backward``). ``override=False`` keeps it for
    this process (``TITAN_FLA_CHUNK_BWD=0``). Returns a status line; ``overridden`` is the line printed when
    the guard was overridden."""
    import os

    from titan_rl_ext.kernels.gdn import FLA_CHUNK_BWD_ENV, allow_fla_chunk_backward, fla_chunk_guard

    _, status = fla_chunk_guard()
    if status != "active":
        return status
    if not override:
        os.environ[FLA_CHUNK_BWD_ENV] = "0"
        return "ACTIVE: FLA chunk backward refuses to run (--no-guard-override)"
    allow_fla_chunk_backward()
    return overridden


# --------------------------------------------------------------------------------------------------
# model slice


def build_slice(dev: torch.device, smoke: bool, vocab: int | None, seed: int = 0) -> tuple[Qwen3_5Config, Decoder]:
    """4 layers of Qwen3.5-9B (3 GDN + 1 gated attention), bf16; ``smoke``: the same structure at toy width."""
    from titan_rl_ext.models.qwen3_5.flavors import qwen3_5_flavors
    from titan_rl_ext.models.qwen3_5.gdn import GDNConfig
    from titan_rl_ext.models.qwen3_5.model import hybrid_layer_types

    base = qwen3_5_flavors()["qwen3_5-9b"]
    types = hybrid_layer_types(4, 4)
    if smoke:
        cfg = dataclasses.replace(base, vocab_size=vocab or 512, dim=128, n_layers=4, n_heads=4, n_kv_heads=2,
                                  head_dim=32, ffn_dim=256, layer_types=types, gdn=GDNConfig(2, 4, 32, 32, 4))
    else:
        cfg = dataclasses.replace(base, vocab_size=vocab or base.vocab_size, n_layers=4, layer_types=types)
    torch.manual_seed(seed)
    with torch.device(dev):
        model = cfg.build()
    model.init_weights()  # fp32 init, then bf16 (A_log and rotary inv_freq stay fp32 by design)
    return cfg, model.to(torch.bfloat16)


FILLER_LEN = 127  # the extra sequence in front of packing B
SMOKE_LENGTHS = [24, 60, 40, 28]


def add_slice_args(ap: argparse.ArgumentParser, lengths_help: str = "packed sequence lengths") -> None:
    """``--vocab`` and ``--lengths`` of the benchmarks that build ``build_slice``'s model."""
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default: the real 248320)")
    ap.add_argument("--lengths", default="1000,3000,2500,1692", help=lengths_help)


def packed_lengths(args: argparse.Namespace) -> list[int]:
    """The sequence lengths ``--lengths`` asks for (``--smoke``: a few short ones)."""
    return list(SMOKE_LENGTHS) if args.smoke else [int(n) for n in args.lengths.split(",")]


def two_packings(lengths: list[int], vocab: int, dev: torch.device, seed: int = 1
                 ) -> tuple[torch.Tensor, SeqBatch, list[int], torch.Tensor, SeqBatch]:
    """Random token sequences of ``lengths`` in two packings, for the batch-composition checks.

    A: the sequences in order. B: a ``FILLER_LEN``-token filler sequence, then the same sequences rotated by
    one (``perm``): every sequence sits at another offset and the total T (the GEMMs' M) changes, so stock
    kernels may pick other tilings. Returns ``(tokens_a, batch_a, perm, tokens_b, batch_b)``."""
    from titan_rl_ext.models.common.batch import SeqBatch

    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (L,), generator=gen).to(dev) for L in lengths]
    perm = list(range(1, len(lengths))) + [0]
    seqs_b = [torch.randint(0, vocab, (FILLER_LEN,), generator=gen).to(dev)] + [seqs[i] for i in perm]
    return (torch.cat(seqs), SeqBatch.from_lengths([s.numel() for s in seqs], device=dev), perm,
            torch.cat(seqs_b), SeqBatch.from_lengths([s.numel() for s in seqs_b], device=dev))


# --------------------------------------------------------------------------------------------------
# profiler


# kernel-name keywords -> category (heuristic, first match wins)
KERNEL_CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("BI GEMM (triton _bi_mm)", ("_bi_mm_kernel", "_bi_mm_tma_kernel")),
    ("BI row reduction (triton)", ("_row_sum_sq",)),
    ("GDN recurrent (titan)", ("_gdn_recurrent_kernel",)),
    ("FLA recurrent", ("fused_recurrent",)),
    ("FLA chunk", ("chunk", "wy_repr", "solve_tril", "recompute_w_u", "l2norm")),
    ("triton fused (inductor / vLLM)", ("triton_",)),
    ("GEMM (cuBLAS/cutlass)", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "sm90_", "sm80_", "cublas")),
    ("triangular solve", ("trsm", "trsv", "triangular")),
    ("attention (SDPA / paged)", ("flash", "fmha", "attention", "efficient")),
    ("norm (fused)", ("rms_norm", "rmsnorm", "layer_norm", "layernorm")),
    ("conv1d (fused)", ("conv1d",)),
    ("softmax", ("softmax",)),
    ("memcpy/memset", ("memcpy", "memset")),
    ("cat/copy/index", ("catarray", "cat_", "copy", "index", "gather", "scatter")),
    ("reduction", ("reduce",)),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "fill")),
]


def categorize(name: str) -> str:
    low = name.lower()
    for cat, keys in KERNEL_CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def profile_step(fn: Callable[[], Any], dev: torch.device, top: int = 20) -> dict[str, Any]:
    """One profiled call of ``fn``: CUDA kernels by total time (CPU: aten ops by self time)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def record(activities: list[Any]) -> tuple[Any, float]:
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            fn()
            sync(dev)
            wall = time.perf_counter() - t0
        return prof, wall

    if dev.type == "cuda":
        try:
            prof, wall = record([ProfilerActivity.CUDA])  # kernels only: far fewer events to parse
        except Exception:
            prof, wall = record([ProfilerActivity.CPU, ProfilerActivity.CUDA])
    else:
        prof, wall = record([ProfilerActivity.CPU])
    t_parse = time.perf_counter()
    items: list[tuple[str, float]]
    if dev.type == "cuda":
        try:  # the raw kineto events: skips building ~10^6 Python FunctionEvents and their tree (a BI step
            # launches a few hundred thousand kernels)
            raw = prof.profiler.kineto_results.events()
            items = [(e.name(), (e.end_ns() - e.start_ns()) / 1e3) for e in raw if e.device_type() == DeviceType.CUDA]
        except Exception:
            items = [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == DeviceType.CUDA]
    else:
        items = [(e.name, e.self_cpu_time_total) for e in prof.events() if e.device_type == DeviceType.CPU]
    agg: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, us in items:
        agg[name][0] += 1
        agg[name][1] += us
    total_us = sum(v[1] for v in agg.values())
    cats: dict[str, float] = defaultdict(float)
    for name, (_, us) in agg.items():
        cats[categorize(name)] += us
    rows = [{"name": n, "count": int(c), "total_ms": us / 1e3, "pct": 100 * us / max(total_us, 1e-9), "avg_us": us / max(c, 1)}
            for n, (c, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]]
    return {
        "what": "CUDA kernels" if dev.type == "cuda" else "CPU ops (self time)",
        "wall_ms": wall * 1e3, "kernel_total_ms": total_us / 1e3, "n_events": int(sum(v[0] for v in agg.values())),
        "busy_pct": 100 * total_us / 1e3 / (wall * 1e3), "parse_s": time.perf_counter() - t_parse,
        "top": rows, "categories_ms": {k: v / 1e3 for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
    }


def print_profile(mode: str, p: dict[str, Any]) -> None:
    print(f"\nPROFILE {mode}: one step {p['wall_ms']:.1f} ms wall, {p['n_events']} {p['what']} totalling "
          f"{p['kernel_total_ms']:.1f} ms (busy {p['busy_pct']:.0f}%), parsed in {p['parse_s']:.1f} s")
    if p["what"] == "CUDA kernels":  # the keyword categories describe CUDA kernel names only
        print("  by category (heuristic): " + ", ".join(f"{k} {v:.1f} ms" for k, v in p["categories_ms"].items()))
    for r in p["top"]:
        print(f"  {r['total_ms']:9.2f} ms {r['pct']:5.1f}% {r['count']:7d}x {r['avg_us']:9.1f} us  {r['name'][:110]}")


# vLLM's own profiling scopes (``record_function_or_nullcontext``, on with VLLM_CUSTOM_SCOPES_FOR_PROFILING=1)
ENGINE_SCOPES = ("gpu_model_runner:", "llm_engine step:", "schedule:")


def step_anatomy(fn: Callable[[], Any], step_scope: str = "gpu_model_runner: preprocess") -> dict[str, Any]:
    """Where one engine step's time goes, from one profiled call of ``fn`` (a ``generate`` of many steps).

    Per step (median over the steps): the step's wall (from one ``step_scope`` start to the next), the host
    time of each vLLM scope, and the GPU's kernel time inside the step's window. A step whose wall is near
    host + GPU ran them in series; near max(host, GPU), they overlapped (async scheduling)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    scopes: dict[str, list[float]] = defaultdict(list)
    starts: list[int] = []
    kernels: list[tuple[int, int]] = []
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if e.device_type() == DeviceType.CUDA:
            kernels.append((e.start_ns(), e.end_ns()))
        elif name.startswith(ENGINE_SCOPES):
            scopes[name].append((e.end_ns() - e.start_ns()) / 1e3)
            if name == step_scope:
                starts.append(e.start_ns())
    starts.sort()
    kernels.sort()
    walls = [(b - a) / 1e3 for a, b in zip(starts, starts[1:])]
    busy = []
    for a, b in zip(starts, starts[1:]):
        inside = [(max(s, a), min(t, b)) for s, t in kernels if t > a and s < b]
        busy.append(sum(t - s for s, t in inside) / 1e3)
    med = statistics.median
    return {
        "steps": len(walls),
        "step_wall_us": med(walls) if walls else None,
        "gpu_busy_us": med(busy) if busy else None,
        "host_scopes_us": {k: {"median": med(v), "count": len(v)} for k, v in sorted(scopes.items())},
        "kernels_per_step": len(kernels) / max(len(starts), 1),
    }


def print_anatomy(what: str, a: dict[str, Any]) -> None:
    print(f"\nSTEP ANATOMY {what}: {a['steps']} steps, median step {a['step_wall_us']:.0f} us, GPU busy "
          f"{a['gpu_busy_us']:.0f} us in it, {a['kernels_per_step']:.0f} kernels/step; host scopes (median us, count):")
    for k, v in a["host_scopes_us"].items():
        print(f"  {v['median']:9.1f} us {v['count']:5d}x  {k}")
