"""Where the chunk grid's folds lose their bits on a GPU (docs/gpu_runs.md §22): each fold kernel launched alone,
repeatedly, on one 64-token chunk at the 9B's GDN heads, its outputs compared launch against launch as integers
(NaN-aware: ``torch.equal`` on floats reads NaN as differing) and against the plain-PyTorch fold to a tolerance.

What it separates:
- ``intra`` repeated on the same inputs into fresh NaN-filled scratch: a launch that disagrees with itself is a race
  or an uninitialised read inside ``_intra_kernel``, per output (``w``, ``u``, ``kg``, ``gl``);
  ``intra_num_warps_4`` the same at another warp count;
- ``chain`` repeated from one intra's scratch and one boundary state: the fold chain alone (and at 8 warps);
  last, the chain's earlier form (``S [K, BV]``, a wgmma on sm_90) against the plain-PyTorch fold;
- ``prefill``/``decode_fold`` repeated from fresh states: the whole call;
- the values against the plain-PyTorch fold (``_fold_torch``'s ``W`` and ``S_b``): garbage (a race reading stale
  rows) or a rounding-level difference;
- non-finite counts everywhere.

    python tests/gpu/gdn_grid_diag.py --out $OUT/gdn_grid_diag.json     (CUDA; ~1 min)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the commit stamp, the comparison
from bench_common import bit_diff, environment  # noqa: E402
from bench_common import sync  # noqa: E402

from titan_rl_ext.kernels import gdn_chunk_grid as cg  # noqa: E402
from titan_rl_ext.kernels import gdn_chunk_grid_triton as kt  # noqa: E402

H, HV, K, V = 16, 32, 128, 128
C = cg.CHUNK
REPEATS = 6


def _repeat(fn: Any, names: list[str]) -> dict[str, Any]:
    """``fn()`` REPEATS times; each output against the first launch's."""
    first = fn()
    out: dict[str, Any] = {n: {"all_equal": True, "worst": None} for n in names}
    for _ in range(REPEATS - 1):
        got = fn()
        for n in names:
            c = bit_diff(got[n], first[n])
            if not c["equal_bits"]:
                out[n]["all_equal"] = False
                if out[n]["worst"] is None or c["differing"] > out[n]["worst"]["differing"]:
                    out[n]["worst"] = c
    for n in names:
        out[n]["nonfinite_first"] = int((~torch.isfinite(first[n].float())).sum())
    return out


class _Report(dict):  # type: ignore[type-arg]
    """A dict that rewrites its JSON file and prints each entry as it is set."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = Path(path)

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self.path.write_text(json.dumps(self, indent=1))
        print(key, json.dumps(value)[:400], flush=True)


def _nan(shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=dev)


def _chain_wgmma() -> Any:
    """The chain kernel's earlier form (the state as ``S [K, BV]``: ``kg^T delta`` has K rows, a wgmma on sm_90)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(r1_ptr, first_ptr, slot_ptr, w_ptr, u_ptr, kg_ptr, gl_ptr, sb_ptr, srun_ptr, scr_ptr, sb_n, srun_n,
               HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
               UPCAST: tl.constexpr):
        hv = tl.program_id(1)
        offs_c = tl.arange(0, C)
        offs_k = tl.arange(0, K)
        offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
        slot = tl.load(slot_ptr).to(tl.int64)
        p_S = hv * K * V + offs_k[:, None] * V + offs_v[None, :]
        S = tl.load(sb_ptr + slot * sb_n + p_S)
        W = tl.load(w_ptr + hv * C * K + offs_c[:, None] * K + offs_k[None, :])
        U = tl.load(u_ptr + hv * C * V + offs_c[:, None] * V + offs_v[None, :]).to(tl.float32)
        kgT = tl.load(kg_ptr + hv * C * K + offs_c[None, :] * K + offs_k[:, None])
        G_last = tl.load(gl_ptr + hv)
        delta = (U - kt._dot(W, S.to(tl.bfloat16), UPCAST)).to(tl.bfloat16)
        S = tl.exp(G_last) * S + kt._dot(kgT, delta, UPCAST)
        tl.store(sb_ptr + slot * sb_n + p_S, S)

    return kernel


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gdn_grid_diag.json")
    args = ap.parse_args()
    import os
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        print("needs CUDA (or TRITON_INTERPRET=1: the script's own check on CPU)")
        return 2
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    opts = {"enable_fp_fusion": True} if cuda else {}

    gen = torch.Generator(device=dev).manual_seed(5)
    k = F.normalize(torch.randn(C, H, K, device=dev, generator=gen), dim=-1).bfloat16()
    q = F.normalize(torch.randn(C, H, K, device=dev, generator=gen), dim=-1).bfloat16()
    v = torch.randn(C, HV, V, device=dev, generator=gen).bfloat16()
    g = -torch.rand(C, HV, device=dev, generator=gen) * 0.1
    beta = torch.rand(C, HV, device=dev, generator=gen).bfloat16()
    s0 = torch.randn(1, HV, K, V, device=dev, generator=gen) * 0.1
    R = cg.row_layout(K, V)["R"]
    plan = {key: torch.tensor(val, dtype=torch.int32, device=dev)
            for key, val in cg.chunk_plan([0, C], [0], C).items()}
    plan["slot"] = torch.zeros(1, dtype=torch.int32, device=dev)
    plan["seq_slot"] = plan["slot"]
    buf = torch.zeros(1, HV, C, R, dtype=torch.bfloat16, device=dev)
    strides = (k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0), buf.stride(0))
    report = _Report(args.out)  # each result written as it lands: an illegal address ends the process
    report.update({"env": environment(dev), "heads": [H, HV, K, V], "chunk": C, "repeats": REPEATS})
    if cuda:  # what this Triton makes of the fold kernels here: wgmma vs mma.sync, registers, spills
        from gdn_chunk_grid import _compile_report

        major, minor = torch.cuda.get_device_capability(dev)
        try:
            report["compiled"] = _compile_report(10 * major + minor)
        except Exception as e:  # a breakdown, not a result
            report["compiled"] = {"error": f"{type(e).__name__}: {e}"[:300]}

    def intra(num_warps: int) -> dict[str, torch.Tensor]:
        s = {"w": _nan((1, HV, C, K), torch.bfloat16, dev), "u": _nan((1, HV, C, V), torch.bfloat16, dev),
             "kg": _nan((1, HV, C, K), torch.bfloat16, dev), "gl": _nan((1, HV), torch.float32, dev)}
        kt._intra_kernel[(1, HV)](
            k, v, g, beta, plan["tok"], plan["r0"], plan["r1"], plan["slot"], buf, buf.view(torch.float32),
            s["w"], s["u"], s["kg"], s["gl"], *strides,
            H=H, HV=HV, K=K, V=V, C=C, R=R, UPCAST=not cuda, num_warps=num_warps, **opts)
        sync(dev)
        return s

    names = ["w", "u", "kg", "gl"]
    for nw in (cg.NUM_WARPS["intra"], 4):
        try:
            report[f"intra_num_warps_{nw}"] = _repeat(lambda nw=nw: intra(nw), names)
        except Exception as e:  # a failing variant is a result
            report[f"intra_num_warps_{nw}"] = {"error": f"{type(e).__name__}: {e}"[:400]}
    sc = intra(cg.NUM_WARPS["intra"])

    # the same chunk by the plain-PyTorch fold: T, W, U (and the fold) to a tolerance
    rows = torch.zeros(HV, C, R, dtype=torch.bfloat16)
    cg._save_rows_torch(rows, 0, k.cpu(), v.cpu(), g.cpu(), beta.cpu())
    kr = rows[..., :K].float()
    gr, br = cg._f32_cols(rows, K + V), cg._f32_cols(rows, K + V + 2)
    G = torch.cumsum(gr, 1)
    idx = torch.arange(C)
    A = torch.where(idx[:, None] > idx[None, :], br[:, :, None] * torch.exp(G[:, :, None] - G[:, None, :])
                    * (kr @ kr.transpose(1, 2)), 0.0)
    eye = torch.eye(C, dtype=torch.float64)
    T_ref = torch.linalg.solve_triangular(eye + A.double(), eye.expand(HV, C, C), upper=False).float()
    W_ref = cg._mm(T_ref.bfloat16().float() * (idx[:, None] >= idx[None, :]),
                   (kr * (br * torch.exp(G))[..., None]).bfloat16())
    report["W_vs_torch"] = bit_diff(sc["w"][0].float().cpu(), W_ref)
    S_ref = cg._fold_torch(rows, s0[0].cpu())

    def chain(num_warps: int = cg.NUM_WARPS["chain"], upcast: bool = not cuda) -> dict[str, torch.Tensor]:
        S_b, S_run = s0.clone(), _nan((1, HV, K, V), torch.float32, dev)
        kt._chain_kernel[(1, HV, V // cg.BV)](
            plan["r1"], plan["first"], plan["seq_slot"], sc["w"], sc["u"], sc["kg"], sc["gl"], S_b, S_run, S_b,
            S_b.stride(0), S_run.stride(0), HV=HV, K=K, V=V, BV=cg.BV, C=C, UPCAST=upcast,
            num_warps=num_warps, **opts)
        sync(dev)
        return {"S_b": S_b, "S_run": S_run}

    report["fold_vs_torch_first"] = bit_diff(chain()["S_b"][0].cpu(), S_ref)
    print("fold vs torch:", report["fold_vs_torch_first"], flush=True)
    report["chain"] = _repeat(chain, ["S_b", "S_run"])
    report["chain_num_warps_8"] = _repeat(lambda: chain(8), ["S_b", "S_run"])
    report["chain_warps_8_vs_4"] = bit_diff(chain(8)["S_b"], chain()["S_b"])
    try:  # float64 dots (mma.sync, no wgmma): the fold's value by another instruction path
        report["chain_float64_vs_torch"] = bit_diff(chain(upcast=True)["S_b"][0].cpu(), S_ref)
    except Exception as e:  # a variant that does not compile is a result
        report["chain_float64_vs_torch"] = {"error": f"{type(e).__name__}: {e}"[:400]}
    report["fold_vs_torch"] = bit_diff(chain()["S_b"][0].cpu(), S_ref)

    def prefill() -> dict[str, torch.Tensor]:
        st = cg.new_state(1, HV, K, V, C, dev, s0)
        o, fin = cg.prefill(q, k, v, g, beta, [0, C], K ** -0.5, *st)
        sync(dev)
        return {"o": o, "final": fin, "S_b": st[1]}

    report["prefill"] = _repeat(prefill, ["o", "final", "S_b"])
    st63 = cg.new_state(1, HV, K, V, C, dev, s0)
    cg.prefill(q[:C - 1], k[:C - 1], v[:C - 1], g[:C - 1], beta[:C - 1], [0, C - 1], K ** -0.5, *st63)

    def decode_fold() -> dict[str, torch.Tensor]:
        st = tuple(t.clone() for t in st63)
        o = cg.decode(q[C - 1:], k[C - 1:], v[C - 1:], g[C - 1:], beta[C - 1:], K ** -0.5, *st,
                      torch.tensor([C - 1], device=dev))
        sync(dev)
        return {"o": o, "S_run": st[0], "S_b": st[1]}

    report["decode_fold"] = _repeat(decode_fold, ["o", "S_run", "S_b"])
    report["decode_vs_prefill_S_b"] = bit_diff(decode_fold()["S_b"], prefill()["S_b"])
    # last: the variant that may end the context (every result above is already written)
    # the chain as it was before the state was held transposed: S [K, BV], whose second product has K = 128 rows
    # and lowers to a wgmma on sm_90 (the form that gave garbage and illegal addresses): its value, last
    try:
        S_b = s0.clone()
        _chain_wgmma()[(1, HV, V // cg.BV)](
            plan["r1"], plan["first"], plan["seq_slot"], sc["w"], sc["u"], sc["kg"], sc["gl"], S_b,
            _nan((1, HV, K, V), torch.float32, dev), S_b, S_b.stride(0), S_b.stride(0), HV=HV, K=K, V=V, BV=cg.BV,
            C=C, UPCAST=not cuda, num_warps=8, **opts)
        sync(dev)
        report["fold_wgmma_form_vs_torch"] = bit_diff(S_b[0].cpu(), S_ref)
    except Exception as e:  # an illegal address ends the context: this runs after the others' results print
        report["fold_wgmma_form_vs_torch"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    text = json.dumps(report, indent=1)
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
