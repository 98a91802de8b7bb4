"""Issue 25: where the trainer step's GEMM time and host waits go -- every matmul of one step with its shape and
operand layouts, each timed alone against the device's GEMM peak, and every host read (a sync) with its caller.

    python benchmarks/step_gemms.py [--modes nonbi,bi] [--out step_gemms.json]
    python benchmarks/step_gemms.py --smoke        # toy slice, CPU, < 1 minute

The step is ``bi_trainer_step``'s (4-layer Qwen3.5-9B slice, T = 8192 packed from 1000,3000,2500,1692,
``token_logprobs(...).nansum().backward()``). One step per mode runs under a dispatch mode that records each
``aten.mm / addmm / bmm / baddbmm`` call (shapes, strides, dtypes, forward or backward, the project function that
issued it), each op that makes the host wait for the device (``_local_scalar_dense`` = ``.item()``,
``nonzero``, boolean-mask indexing, copies to the CPU) and each op that only moves data (copies, casts, ``cat``,
gathers and scatters: bytes written), with the innermost project frame that called it.

Then every distinct GEMM is rebuilt (same shapes, strides, dtypes, keyword arguments) and timed alone, and, for
plain 2-D ``mm``, in the 7 other operand/result layouts of the same product (row- or column-major A, B and C):
a layout that is clearly faster is a change the model can make (store a weight transposed, ask for the gradient
in the other layout). Reference peak: a 8192^3 bf16 ``mm`` on the same device (the 788 TFLOP/s of issue 25's
floor was that figure on the H200). Each row: ms per call, TFLOP/s, and the *excess* (count x time minus
FLOPs at the peak), sorted by excess, so the table reads as "where the GEMMs lose to their floor".

Session 29's profile of this step (H200, non-BI): cuBLAS kernels 131.4 ms for 92.5 TFLOP (117 ms at 788
TFLOP/s), 173 ms wall for 165 ms of kernels. This script says which GEMMs make the 14 ms and what the 8 ms of
idle follows.
"""

from __future__ import annotations

import statistics
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common (it also puts the repo root on sys.path)
from bench_common import Timer, base_parser, build_slice, environment, fmt_table, json_saver  # noqa: E402
from bench_common import print_header, resolve_device, sync, two_packings  # noqa: E402
from bench_common import add_slice_args, packed_lengths  # noqa: E402

from titan_rl_ext.kernels.batch_invariant import batch_invariant  # noqa: E402
from titan_rl_ext.rl.logprobs import token_logprobs  # noqa: E402

aten = torch.ops.aten
GEMM_OPS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
# ops after which the host has a device value in hand, so it waited for every kernel queued before them
HOST_READ_OPS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.is_nonzero, aten.equal,
                 aten.unique_consecutive, aten._unique2, aten.repeat_interleave}
# ops that only move data: where the profile's "cat/copy/index" kernels come from
MOVE_OPS = {aten.copy_, aten._to_copy, aten.cat, aten.clone, aten.index, aten.index_put_, aten.index_put,
            aten.gather, aten.scatter, aten.scatter_add, aten.index_select, aten.index_add, aten.roll,
            aten.constant_pad_nd, aten.repeat, aten.stack}
PROJECT_DIRS = ("titan_rl_ext", "vllm_titan_plugin", "fla")


@dataclass(frozen=True)
class Spec:
    """A tensor argument as recorded: enough to rebuild one like it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def build(self, dev: torch.device, gen: torch.Generator) -> torch.Tensor:
        if not self.shape:
            return torch.randn((), generator=gen).to(dev, self.dtype)
        span = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride) if n > 0)
        base = (torch.randn(span, generator=gen) * 0.05).to(dev, self.dtype)  # small: fp16 products stay finite
        return base.as_strided(self.shape, self.stride)


def _spec(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return Spec(tuple(x.shape), tuple(x.stride()), x.dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_spec(v) for v in x)
    return x


def _build(x: Any, dev: torch.device, gen: torch.Generator) -> Any:
    if isinstance(x, Spec):
        return x.build(dev, gen)
    if isinstance(x, (list, tuple)):
        return type(x)(_build(v, dev, gen) for v in x)
    return x


def _site() -> str:
    """The innermost project frame on the Python stack ("autograd" when the engine called the op)."""
    for fr in reversed(traceback.extract_stack()[:-3]):
        if any(f"/{d}/" in fr.filename for d in PROJECT_DIRS):
            return f"{fr.filename.split('/')[-2]}/{fr.filename.split('/')[-1]}:{fr.lineno} {fr.name}"
    return "autograd"


@dataclass
class GemmCall:
    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    count: int = 0
    phases: Counter = field(default_factory=Counter)
    sites: Counter = field(default_factory=Counter)


class StepLog(TorchDispatchMode):
    """Records the GEMMs and the host reads of everything run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.gemms: dict[str, GemmCall] = {}
        self.host_reads: Counter = Counter()
        self.moves: dict[str, list[float]] = {}  # "op <- site" -> [calls, bytes written]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in GEMM_OPS:
            a, k = _spec(args), {n: _spec(v) for n, v in kwargs.items()}
            key = f"{func}|{a}|{k}"
            call = self.gemms.setdefault(key, GemmCall(func, a, k))
            call.count += 1
            call.phases["bwd" if torch._C._current_autograd_node() is not None else "fwd"] += 1
            call.sites[_site()] += 1
        elif packet in HOST_READ_OPS or (packet in (aten._to_copy, aten.copy_) and _to_host(args, kwargs)):
            self.host_reads[f"{packet.__name__} <- {_site()}"] += 1
        elif packet is aten.index and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                          for i in (args[1] if len(args) > 1 else ()) if i is not None):
            self.host_reads[f"index(bool mask) <- {_site()}"] += 1
        out = func(*args, **kwargs)
        if packet in MOVE_OPS:
            phase = "bwd" if torch._C._current_autograd_node() is not None else "fwd"
            rec = self.moves.setdefault(f"{packet.__name__} ({phase}) <- {_site()}", [0, 0.0])
            rec[0] += 1
            rec[1] += sum(t.numel() * t.element_size() for t in _tensors(out))
        return out


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def _to_host(args: tuple, kwargs: dict) -> bool:
    """A device-to-CPU copy: ``_to_copy(cuda, device=cpu)`` or ``cpu_dst.copy_(cuda_src)``."""
    src = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else args[0]
    if not isinstance(src, torch.Tensor) or src.device.type == "cpu":
        return False
    if len(args) > 1 and isinstance(args[0], torch.Tensor) and isinstance(args[1], torch.Tensor):
        return args[0].device.type == "cpu"
    dst = kwargs.get("device")
    return dst is not None and torch.device(dst).type == "cpu"


def gemm_flops(func: Any, args: tuple[Any, ...]) -> tuple[float, str]:
    """FLOPs of the product and its ``MxNxK`` (batched: ``BxMxNxK``)."""
    packet = func.overloadpacket
    a, b = (args[1], args[2]) if packet in (aten.addmm, aten.baddbmm) else (args[0], args[1])
    if packet in (aten.bmm, aten.baddbmm):
        B, M, K = a.shape
        N = b.shape[2]
        return 2.0 * B * M * N * K, f"{B}x{M}x{N}x{K}"
    M, K = a.shape
    N = b.shape[1]
    return 2.0 * M * N * K, f"{M}x{N}x{K}"


def layout(s: Spec) -> str:
    """``R`` row-major, ``C`` column-major (a transposed view), ``S`` anything else (strided slice)."""
    if len(s.shape) != 2:
        return "-"
    if s.stride[1] == 1:
        return "R" if s.stride[0] >= s.shape[1] else "S"
    return "C" if s.stride[0] == 1 else "S"


def layout_variants(call: GemmCall, dev: torch.device, gen: torch.Generator
                    ) -> dict[str, Callable[[], torch.Tensor]]:
    """Plain 2-D ``mm``: the same product with A, B row- or column-major and the result row-major (``mm(a, b)``)
    or column-major (``mm(b.t(), a.t()).t()``). Keyword arguments (``out_dtype``) are kept."""
    sa, sb, rest = call.args[0], call.args[1], call.args[2:]
    if call.func.overloadpacket is not aten.mm or any(not isinstance(s, Spec) or len(s.shape) != 2 for s in (sa, sb)):
        return {}
    kw = call.kwargs
    if any(isinstance(v, Spec) for v in (*rest, *kw.values())):  # an out= tensor: not rebuilt in other layouts
        return {}
    out: dict[str, Callable[[], torch.Tensor]] = {}
    for la in "RC":
        for lb in "RC":
            a = _of_layout(sa, la, dev, gen)
            b = _of_layout(sb, lb, dev, gen)
            out[f"A{la} B{lb} CR"] = lambda a=a, b=b: call.func(a, b, *rest, **kw)
            out[f"A{la} B{lb} CC"] = lambda a=a, b=b: call.func(b.t(), a.t(), *rest, **kw)
    return out


def _of_layout(s: Spec, lay: str, dev: torch.device, gen: torch.Generator) -> torch.Tensor:
    rows, cols = s.shape
    if lay == "R":
        return Spec((rows, cols), (cols, 1), s.dtype).build(dev, gen)
    return Spec((cols, rows), (rows, 1), s.dtype).build(dev, gen).t()


def time_call(timer: Timer, fn: Callable[[], Any], reps: int) -> float:
    return statistics.median(timer.run(fn, warmup=2, reps=reps, max_s=2.0))


def analyse(log: StepLog, dev: torch.device, timer: Timer, peak_tflops: float, reps: int,
            variants: bool, variants_min_ms: float = 0.0) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for call in log.gemms.values():
        flops, mnk = gemm_flops(call.func, call.args)
        args = _build(call.args, dev, gen)
        kwargs = _build(call.kwargs, dev, gen)
        ms = time_call(timer, lambda: call.func(*args, **kwargs), reps)
        del args, kwargs
        row: dict[str, Any] = {
            "op": call.func.overloadpacket.__name__, "mnk": mnk,
            "layout": " ".join(layout(s) for s in call.args if isinstance(s, Spec)),
            "dtypes": "/".join(str(s.dtype).replace("torch.", "") for s in call.args if isinstance(s, Spec)),
            "kwargs": {k: str(v) for k, v in call.kwargs.items()},
            "count": call.count, "phases": dict(call.phases), "site": call.sites.most_common(1)[0][0],
            "ms_each": ms, "ms_total": ms * call.count, "tflops": flops / ms / 1e9,
            "excess_ms": (ms - flops / (peak_tflops * 1e9)) * call.count,
        }
        if variants and ms * call.count >= variants_min_ms:
            alt = {name: time_call(timer, fn, reps) for name, fn in layout_variants(call, dev, gen).items()}
            if alt:
                best = min(alt, key=alt.__getitem__)
                row.update(layouts_ms=alt, best_layout=best, best_ms_each=alt[best],
                           layout_gain_ms=(ms - alt[best]) * call.count)
        rows.append(row)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return sorted(rows, key=lambda r: -r["excess_ms"])


def peak_mm_tflops(dev: torch.device, timer: Timer, n: int) -> float:
    a = torch.randn(n, n, device=dev).to(torch.bfloat16)
    b = torch.randn(n, n, device=dev).to(torch.bfloat16)
    ms = time_call(timer, lambda: a @ b, 10)
    return 2.0 * n**3 / ms / 1e9


def main() -> int:
    ap = base_parser(__doc__, "toy-width slice, 152 tokens: CPU check")
    add_slice_args(ap)
    ap.add_argument("--modes", default="nonbi,bi", help="nonbi and/or bi")
    ap.add_argument("--reps", type=int, default=6, help="timed calls per GEMM")
    ap.add_argument("--layouts-min-ms", type=float, default=0.3,
                    help="time the other layouts only of GEMMs whose calls take this long in all (ms)")
    ap.add_argument("--no-layouts", action="store_true", help="skip the other-layout timings")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    t_start = time.perf_counter()
    dev = resolve_device(ap, args)
    lengths = packed_lengths(args)
    if args.smoke:
        args.reps = 2
    cfg, model = build_slice(dev, args.smoke, args.vocab)
    env = environment(dev)
    print_header(f"step_gemms: {len(model.layers)}-layer Qwen3.5-9B slice, vocab {cfg.vocab_size}, T={sum(lengths)}", env)
    toks, batch, *_ = two_packings(lengths, cfg.vocab_size, dev)
    timer = Timer(dev)
    peak = peak_mm_tflops(dev, timer, 512 if args.smoke else 8192)
    print(f"reference peak: bf16 mm {'512' if args.smoke else '8192'}^3 = {peak:.1f} TFLOP/s", flush=True)
    results: dict[str, Any] = {"env": env, "args": vars(args), "lengths": lengths, "peak_tflops": peak, "modes": {}}
    save = json_saver(args.out, results, t_start)

    def step() -> None:
        token_logprobs(model, toks, batch).nansum().backward()
        model.zero_grad(set_to_none=True)

    for mode in args.modes.split(","):
        with batch_invariant(mode == "bi"):
            step()  # warm-up: compile and autotune outside the log
            sync(dev)
            log = StepLog()
            with log:
                step()
            sync(dev)
        rows = analyse(log, dev, timer, peak, args.reps, not args.no_layouts, 0.0 if args.smoke else args.layouts_min_ms)
        total = sum(r["ms_total"] for r in rows)
        floor = sum(r["ms_total"] - r["excess_ms"] for r in rows)
        gain = sum(max(r.get("layout_gain_ms", 0.0), 0.0) for r in rows)
        reads = dict(log.host_reads.most_common())
        moves = [{"what": k, "calls": int(v[0]), "gb_written": v[1] / 1e9}
                 for k, v in sorted(log.moves.items(), key=lambda kv: -kv[1][1])]
        results["modes"][mode] = {"gemms": rows, "gemm_ms_alone": total, "gemm_floor_ms": floor,
                                  "layout_gain_ms": gain, "n_gemm_calls": sum(r["count"] for r in rows),
                                  "host_reads": reads, "n_host_reads": sum(reads.values()),
                                  "moves": moves, "moves_gb_written": sum(m["gb_written"] for m in moves)}
        save()
        print(f"\n{mode}: {sum(r['count'] for r in rows)} cuBLAS GEMM calls ({len(rows)} distinct), alone "
              f"{total:.1f} ms, at the peak {floor:.1f} ms (excess {total - floor:.1f} ms); best other layouts "
              f"would save {gain:.1f} ms")
        print(fmt_table(rows, [("op", "op", ""), ("mnk", "MxNxK", ""), ("layout", "A B", ""), ("dtypes", "dtypes", ""),
                               ("count", "n", "d"), ("ms_each", "ms", ".3f"), ("tflops", "TFLOP/s", ".1f"),
                               ("excess_ms", "excess", ".2f"), ("best_layout", "best layout", ""),
                               ("layout_gain_ms", "gain", ".2f"), ("site", "issued by", "")]))
        print(f"host reads (the host waits for the queue): {sum(reads.values())}")
        for what, n in reads.items():
            print(f"  {n:4d}x {what}")
        print(f"data movement (copies, casts, cat, gathers/scatters): {results['modes'][mode]['moves_gb_written']:.2f} GB "
              "written; the largest:")
        for m in moves[:15]:
            print(f"  {m['gb_written']:8.3f} GB {m['calls']:4d}x {m['what']}")

    print("\nSUMMARY step_gemms")
    for mode, m in results["modes"].items():
        print(f"  {mode}: GEMMs alone {m['gemm_ms_alone']:.1f} ms vs {m['gemm_floor_ms']:.1f} ms at {peak:.1f} TFLOP/s; "
              f"other layouts -{m['layout_gain_ms']:.1f} ms; {m['n_host_reads']} host reads")
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
