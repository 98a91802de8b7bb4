"""Issue 8, benchmark 3 (the headline): trainer forward+backward tokens/s, batch invariance on vs off.

    python benchmarks/bi_trainer_step.py [--vocab 248320] [--lengths 1000,3000,2500,1692] [--profile] [--out step.json]
    python benchmarks/bi_trainer_step.py --smoke        # tiny slice, CPU, < 1 minute

Model: a 4-layer slice of Qwen3.5-9B (3 GDN + 1 gated attention, hidden 4096, MLP 12288, bf16 weights,
real 248320 vocabulary unless ``--vocab``), random weights. One trainer step is exactly what the RL
losses do: ``token_logprobs`` (fused fp32 LM head + fp32 log-softmax, in row chunks) over T packed tokens of mixed-length
sequences (default 8192 = 1000+3000+2500+1692), ``nansum``, ``backward``, grads dropped. BI on and off
run in the same process, interleaved in two rounds (each round: median of reps) -> tokens/s and the
ratio BI/non-BI (throughput; < 1 = BI slower).

Also:
- sanity check that BI is really on: the same sequences packed in another order, behind an extra filler
  sequence (so T changes too), and the first ``PREFIX_LEN`` tokens of the first sequence alone (a product of
  that few rows, for which cuBLAS picks other kernels) must give bit-identical per-token logprobs with BI on;
  on CUDA the BI-off control must differ somewhere, or the check could not tell (exit code 1 if either fails);
  and the head's log-softmax statistics kernel must give the bits of ``torch.log_softmax`` (``bi_torch_lse``:
  ``bench_common.torch_head_lse``), counted as ``lse_kernel_vs_torch_differing``;
- beside ``bi`` / ``nonbi``, the same step with one change undone, same process: ``*_head_recompute`` (the head's
  backward recomputes its logits), ``*_ref_bwd`` (the fused kernels' torch-reference gradients),
  ``*_torch_lse`` (torch's log-softmax), ``bi_fla_rec`` (FLA's recurrent GDN kernel instead of the project's, the default);
- a breakdown (``--no-breakdown`` to skip): fwd+bwd of one GDN block, the attention block and the head
  (fp32 logits + log-softmax + backward) alone, so the largest term is visible without a profiler;
- ``--profile``: one profiled step per mode, top-20 CUDA kernels by total time (torch.profiler), kernel
  count and the GPU-busy fraction (kernel time / step wall time; low = launch/Python bound).

GDN backward on Hopper: both modes differentiate FLA's chunk form, whose backward fla-core 0.6.0
refuses with Triton < 3.7.1 (FLA issue #640). The project overrides that guard itself
(``kernels.gdn.allow_fla_chunk_backward``; gradients checked against float64 by
``tests/gpu/test_bi_kernels_cuda.py``); ``--no-guard-override`` (with ``TITAN_FLA_CHUNK_BWD=0``) keeps it,
BI then differentiates the torch chunked form and the non-BI step fails and is reported as unavailable.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common (it also puts the repo root on sys.path)
from bench_common import FILLER_LEN, Timer, base_parser, build_slice, env_summary, environment  # noqa: E402
from bench_common import fla_chunk_bwd_guard, fmt_table, json_saver, print_header, resolve_device  # noqa: E402
from bench_common import env_set, print_profile, profile_step, torch_head_lse, two_packings, two_rounds  # noqa: E402
from bench_common import add_slice_args, packed_lengths  # noqa: E402

from titan_rl_ext.kernels.batch_invariant import batch_invariant  # noqa: E402
from titan_rl_ext.kernels.conv_triton import bwd_config  # noqa: E402
from titan_rl_ext.kernels.gdn import RECURRENT_ENV, fla_available  # noqa: E402
from titan_rl_ext.kernels.rows import reference_backward  # noqa: E402
from titan_rl_ext.models.common.batch import SeqBatch  # noqa: E402
from titan_rl_ext.models.common.decoder import FULL_ATTENTION, LINEAR_ATTENTION, Decoder  # noqa: E402
from titan_rl_ext.models.qwen3_5.model import Qwen3_5Config  # noqa: E402
from titan_rl_ext.kernels.lm_head import token_logprobs_fused  # noqa: E402
from titan_rl_ext.rl.logprobs import token_logprobs  # noqa: E402

GUARD_OVERRIDDEN = "OVERRIDDEN for both modes (FLA #640; gradients checked by tests/gpu/test_bi_kernels_cuda.py)"
# The order check's small packing: the first sequence's first tokens alone. Beside thousands of rows, another
# order or a filler leaves stock GEMMs on the same kernels (the BI-off control then shows 0 differing on an
# H100), so only a product of few rows makes the control differ there.
PREFIX_LEN = 16
BI_CHECK_MODES = ("bi", "bi_fla_rec", "bi_torch_lse")


def order_verdict(check: dict[str, Any], control_must_differ: bool) -> bool:
    """The order check passes: every BI mode gives the same bits in every packing, the head's statistics kernel
    gives torch's, and (``control_must_differ``) the BI-off control differs in some packing. CPU kernels give
    the same bits at any row count, so there the control cannot differ and is not asked to."""
    bi_same = all(check[m]["differing"] == 0 and check[m]["prefix_differing"] == 0 and check[m]["nan_pattern_equal"]
                  and check[m]["finite"] for m in BI_CHECK_MODES) and check["lse_kernel_vs_torch_differing"] == 0
    control_differs = check["nonbi"]["differing"] + check["nonbi"]["prefix_differing"] > 0
    return bi_same and (control_differs or not control_must_differ)


def block_step(layer: nn.Module, x0: torch.Tensor, batch: SeqBatch, rope: tuple[torch.Tensor, torch.Tensor],
               gy: torch.Tensor) -> torch.Tensor:
    """fwd+bwd of one decoder block alone -> the gradient at its input. A block returns ``(x, h, state)`` with the
    feed-forward's ``h`` still to be added (the next norm adds it), so the stream it hands on, the one the
    gradient enters, is ``x + h``."""
    x = x0.detach().requires_grad_(True)
    out, h, _ = layer(x, batch, rope, None)
    (out + h).backward(gy)
    assert x.grad is not None
    return x.grad

# --------------------------------------------------------------------------------------------------
# FLOP count, profiler


def step_flops(model: Decoder, cfg: Qwen3_5Config, lengths: list[int]) -> dict[str, float]:
    """Useful FLOPs of one fwd+bwd (bwd = 2x fwd): projections, fp32 head, causal attention core, and an
    estimate of the GDN core (chunked form's matmuls). BI attention computes all key blocks (no causal
    skipping), so it does about twice the attention FLOPs counted here."""
    T = sum(lengths)
    proj = sum(m.in_features * m.out_features for m in model.layers.modules() if isinstance(m, nn.Linear))
    n_attn = sum(layer.layer_type == FULL_ATTENTION for layer in model.layers)
    g, C = cfg.gdn, 64
    gdn_tok = g.n_v_heads * (4 * C * g.k_head_dim + C * (g.v_head_dim + g.k_head_dim) + 2 * C * g.v_head_dim
                             + 6 * g.k_head_dim * g.v_head_dim)
    return {
        "projections_bf16": 3 * 2 * T * proj,
        "lm_head_fp32": 3 * 2 * T * cfg.dim * cfg.vocab_size,
        "attention_core": 3 * n_attn * sum(2 * L * L * cfg.n_heads * cfg.head_dim for L in lengths),
        "gdn_core_est": 3 * (len(model.layers) - n_attn) * T * gdn_tok,
    }


# --------------------------------------------------------------------------------------------------


def main() -> int:
    ap = base_parser(__doc__, "toy-width slice, 256 tokens: CPU check")
    add_slice_args(ap)
    ap.add_argument("--reps", type=int, default=3, help="timed steps per round (2 rounds per mode)")
    ap.add_argument("--max-s", type=float, default=25.0, help="cap on one timing run (s)")
    ap.add_argument("--budget-s", type=float, default=170.0, help="skip breakdown/profile once past this (s)")
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--profile", action="store_true", help="top-20 CUDA kernels of one step per mode")
    ap.add_argument("--no-guard-override", action="store_true", help="leave FLA's #640 guard in place")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    t_start = time.perf_counter()
    dev = resolve_device(ap, args)
    lengths = packed_lengths(args)
    if args.smoke:
        args.reps, args.max_s = 1, 5.0
    T = sum(lengths)
    uses_fla = dev.type == "cuda" and fla_available()
    guard = fla_chunk_bwd_guard(not args.no_guard_override, GUARD_OVERRIDDEN) if uses_fla else "n/a (FLA not used)"
    env = environment(dev)
    env["fla_chunk_bwd_guard"] = guard
    env["conv_bwd_launch"] = bwd_config(dev)  # the GPU's entry of kernels/conv_bwd_tables.json, else the default

    cfg, model = build_slice(dev, args.smoke, args.vocab)
    n_params = sum(p.numel() for p in model.parameters())
    print_header(f"bi_trainer_step: {len(model.layers)}-layer Qwen3.5-9B slice ({'toy width' if args.smoke else 'real width'}), "
                 f"vocab {cfg.vocab_size}, {n_params / 1e9:.2f} B params bf16, T={T} packed from {lengths}", env)
    print(f"    GDN kernels: BI = recurrent {'FLA' if uses_fla else 'torch'} fwd + {'FLA' if uses_fla else 'torch'} chunked bwd; "
          f"non-BI = chunk {'FLA' if uses_fla else 'torch'} fwd+bwd.  FLA #640 guard: {guard}", flush=True)
    results: dict[str, Any] = {"env": env, "args": vars(args), "lengths": lengths, "vocab": cfg.vocab_size,
                               "params": n_params, "flops": step_flops(model, cfg, lengths)}
    save = json_saver(args.out, results, t_start)

    # packing A (timed) and packing B (the order check, below)
    toks, batch, perm, toks2, batch2 = two_packings(lengths, cfg.vocab_size, dev)
    order = list(range(len(lengths)))

    def train_step() -> None:
        lp = token_logprobs(model, toks, batch)
        lp.nansum().backward()
        model.zero_grad(set_to_none=True)

    modes = {"bi": True, "nonbi": False}
    fla_rec = functools.partial(env_set, **{RECURRENT_ENV: "fla"})  # each mode: a context to run it in
    # bi_torch_lse: the head's log-softmax through torch.log_softmax instead of the statistics kernel, whose
    # logprobs must be the same bits (it replicates torch's summation order)
    check_modes = {"bi": (True, nullcontext), "nonbi": (False, nullcontext), "bi_fla_rec": (True, fla_rec),
                   "bi_torch_lse": (True, torch_head_lse)}

    # ---- sanity: another batch composition -> BI logprobs bit-identical (also warms up every kernel) -------
    # Packing B = a 127-token filler sequence, then the same sequences rotated: every sequence sits at
    # another offset and the total T (the GEMMs' M) changes, so stock kernels may pick other tilings.
    start_b = {i: FILLER_LEN + sum(lengths[j] for j in perm[: perm.index(i)]) for i in order}
    lp_by_mode: dict[str, torch.Tensor] = {}
    check: dict[str, Any] = {"order_a": order, "order_b": [f"filler{FILLER_LEN}"] + perm,
                             "order_c": f"first {PREFIX_LEN} tokens of sequence 0 alone"}
    n_prefix = min(PREFIX_LEN, lengths[0])
    batch_c = SeqBatch.from_lengths([n_prefix], device=dev)
    for mode, (on, switches) in check_modes.items():
        with torch.no_grad(), batch_invariant(on), switches():
            lp_a = token_logprobs(model, toks, batch)
            lp_b_packed = token_logprobs(model, toks2, batch2)
            lp_c = token_logprobs(model, toks[:n_prefix], batch_c)
        lp_b = torch.cat([lp_b_packed[start_b[i]: start_b[i] + lengths[i]] for i in order])  # back to packing A
        valid = ~lp_a.isnan()
        diff = (lp_a[valid] - lp_b[valid]).abs()
        check[mode] = {"tokens": int(valid.sum()), "differing": int((diff != 0).sum()), "max_abs_diff": diff.max().item(),
                       "nan_pattern_equal": bool(torch.equal(lp_a.isnan(), lp_b.isnan())),
                       "finite": bool(torch.isfinite(lp_a[valid]).all()),
                       "prefix_tokens": int((~lp_c.isnan()).sum()),
                       "prefix_differing": int(((lp_c != lp_a[:n_prefix]) & ~lp_c.isnan()).sum())}
        lp_by_mode[mode] = lp_a
        del lp_a, lp_b, lp_b_packed
    v = ~lp_by_mode["bi"].isnan()
    check["bi_vs_nonbi_max_abs_diff"] = (lp_by_mode["bi"][v] - lp_by_mode["nonbi"][v]).abs().max().item()
    check["lse_kernel_vs_torch_differing"] = int((lp_by_mode["bi"][v] != lp_by_mode["bi_torch_lse"][v]).sum())
    del lp_by_mode
    bi_ok = order_verdict(check, control_must_differ=dev.type == "cuda")
    results["order_check"] = check
    print(f"order check (sequences packed {order} vs {check['order_b']}): BI on {check['bi']['differing']}/{check['bi']['tokens']} "
          f"logprobs differ, BI with FLA's recurrent kernel {check['bi_fla_rec']['differing']} "
          f"({'OK, bit-identical' if bi_ok else 'FAIL'}); BI off {check['nonbi']['differing']}/"
          f"{check['nonbi']['tokens']} differ (max {check['nonbi']['max_abs_diff']:.2e}), alone "
          f"{check['nonbi']['prefix_differing']}/{check['nonbi']['prefix_tokens']} (BI "
          f"{check['bi']['prefix_differing']}); head statistics kernel vs "
          f"torch.log_softmax {check['lse_kernel_vs_torch_differing']} differ; "
          f"BI vs non-BI max |diff| {check['bi_vs_nonbi_max_abs_diff']:.2e}", flush=True)
    save()

    # ---- headline: full trainer step, two interleaved rounds per mode -----------------------------------
    # *_head_recompute: the fp32 head's backward recomputing its logits (TITAN_HEAD_SAVE_GB=0), the path
    # before the forward's log-softmax was kept: the same step in the same process, for the before/after
    from titan_rl_ext.kernels import lm_head

    # bi_fla_rec: BI with FLA's recurrent GDN kernel (TITAN_GDN_RECURRENT=fla) instead of the project's (default);
    # *_ref_bwd: the fused kernels' backward through their torch references (rows.reference_backward), the path
    # before the backward kernels (the conv's first)
    keep = lm_head.SAVE_BYTES
    step_modes = {m: (on, keep, nullcontext) for m, on in modes.items()}
    step_modes.update({"bi_head_recompute": (True, 0, nullcontext), "nonbi_head_recompute": (False, 0, nullcontext),
                       "bi_fla_rec": (True, keep, fla_rec),
                       "bi_torch_lse": (True, keep, torch_head_lse),
                       "nonbi_torch_lse": (False, keep, torch_head_lse),
                       "bi_ref_bwd": (True, keep, reference_backward),
                       "nonbi_ref_bwd": (False, keep, reference_backward)})
    timer = Timer(dev)
    med: dict[str, list[float]] = {m: [] for m in step_modes}
    peak: dict[str, float | None] = {}
    errors: dict[str, str] = {}
    for rnd in range(2):
        for mode, (on, save_bytes, switches) in step_modes.items():
            if mode in errors:
                continue
            if dev.type == "cuda" and rnd == 0:
                torch.cuda.reset_peak_memory_stats(dev)
            kept, lm_head.SAVE_BYTES = lm_head.SAVE_BYTES, save_bytes
            try:
                with batch_invariant(on), switches():
                    t = timer.run(train_step, warmup=1 if rnd == 0 else 0, reps=args.reps, max_s=args.max_s)
            except RuntimeError as e:  # e.g. FLA's #640 guard left in place
                errors[mode] = str(e).splitlines()[0][:200]
                model.zero_grad(set_to_none=True)
                print(f"  {mode}: step failed: {errors[mode]}", flush=True)
                continue
            finally:
                lm_head.SAVE_BYTES = kept
            if dev.type == "cuda" and rnd == 0:
                peak[mode] = torch.cuda.max_memory_allocated(dev) / 2**30
            med[mode].append(statistics.median(t))
            print(f"  round {rnd + 1} {mode:<6} {med[mode][-1]:10.1f} ms/step  ({len(t)} reps: "
                  + ", ".join(f"{x:.0f}" for x in t) + ")", flush=True)
    flops = results["flops"]
    useful = sum(flops.values())
    rows = []
    for mode in step_modes:
        if not med[mode]:
            rows.append({"mode": mode, "error": errors.get(mode)})
            continue
        r = two_rounds(med[mode])
        ms = r["ms"]
        rows.append({"mode": mode, **r, "tokens_per_s": T / ms * 1e3,
                     "useful_tflops": useful / ms / 1e9, "peak_gib": peak.get(mode)})
    results["step"] = rows
    by = {r["mode"]: r for r in rows if "ms" in r}

    def tput_ratio(a: str, b: str) -> float | None:
        return by[a]["tokens_per_s"] / by[b]["tokens_per_s"] if a in by and b in by else None

    ratio = tput_ratio("bi", "nonbi")
    results["ratio_bi_over_nonbi_throughput"] = ratio
    results["ratio_kept_head_over_recompute_throughput"] = {"bi": tput_ratio("bi", "bi_head_recompute"),
                                                           "nonbi": tput_ratio("nonbi", "nonbi_head_recompute")}
    results["ratio_fused_bwd_over_ref_bwd_throughput"] = {"bi": tput_ratio("bi", "bi_ref_bwd"),
                                                          "nonbi": tput_ratio("nonbi", "nonbi_ref_bwd")}
    print(f"  backward kernels vs the references' gradients (throughput): "
          f"{results['ratio_fused_bwd_over_ref_bwd_throughput']}", flush=True)
    results["ratio_bi_fla_rec_over_bi_throughput"] = tput_ratio("bi_fla_rec", "bi")
    results["ratio_bi_fla_rec_over_nonbi_throughput"] = tput_ratio("bi_fla_rec", "nonbi")
    print(f"  BI with FLA's recurrent GDN kernel vs the project's (throughput): {results['ratio_bi_fla_rec_over_bi_throughput']}; "
          f"vs non-BI: {results['ratio_bi_fla_rec_over_nonbi_throughput']}", flush=True)
    print(f"  head backward from the kept log-softmax vs recomputed logits (throughput): "
          f"{results['ratio_kept_head_over_recompute_throughput']}", flush=True)
    results["ratio_lse_kernel_over_torch_log_softmax_throughput"] = {
        "bi": tput_ratio("bi", "bi_torch_lse"), "nonbi": tput_ratio("nonbi", "nonbi_torch_lse")}
    print(f"  head log-softmax statistics kernel vs torch.log_softmax (throughput): "
          f"{results['ratio_lse_kernel_over_torch_log_softmax_throughput']}", flush=True)
    save()

    # ---- breakdown: each component's fwd+bwd alone ------------------------------------------------------
    breakdown: list[dict[str, Any]] = []
    if not args.no_breakdown:
        rope = model.rope(batch.positions, torch.bfloat16)
        x_gen = torch.Generator(device=dev).manual_seed(2)
        x0 = (torch.randn(T, cfg.dim, device=dev, generator=x_gen) * 0.5).bfloat16()
        gy = torch.randn(T, cfg.dim, device=dev, generator=x_gen).bfloat16()
        head_tok = toks.roll(-1)

        def block(i: int) -> Callable[[], None]:
            def run() -> None:
                block_step(model.layers[i], x0, batch, rope, gy)
                model.zero_grad(set_to_none=True)
            return run

        def head() -> None:  # what token_logprobs runs after the blocks: final norm + the fused fp32 head
            h = model.norm(x0.detach().requires_grad_(True))
            token_logprobs_fused(h, model.lm_head_weight(), head_tok).sum().backward()
            model.zero_grad(set_to_none=True)

        first = {t: next(i for i, layer in enumerate(model.layers) if layer.layer_type == t)
                 for t in {layer.layer_type for layer in model.layers}}
        n_of = {t: sum(layer.layer_type == t for layer in model.layers) for t in first}
        label = {LINEAR_ATTENTION: "GDN block", FULL_ATTENTION: "attention block"}
        parts = {f"{label[t]} (x{n_of[t]})": (block(i), n_of[t]) for t, i in sorted(first.items(), key=lambda kv: kv[1])}
        parts["head: norm + fp32 logits + log_softmax (x1)"] = (head, 1)
        for mode, on in modes.items():
            if mode in errors:
                continue
            est = statistics.mean(med[mode]) / 1e3 * 3.5  # 3 calls per part (warm-up + 1 rep per round) ~ 3 steps
            if time.perf_counter() - t_start + est > args.budget_s:
                print(f"  breakdown {mode}: skipped (budget)")
                continue
            for part, (fn, count) in parts.items():
                m_: list[float] = []
                for rnd in range(2):
                    with batch_invariant(on):
                        m_.append(statistics.median(timer.run(fn, warmup=1 if rnd == 0 else 0, reps=1)))
                breakdown.append({"mode": mode, "part": part, "ms_r1": m_[0], "ms_r2": m_[1], "ms_each": statistics.mean(m_),
                                  "ms_total": statistics.mean(m_) * count,
                                  "pct_of_step": 100 * statistics.mean(m_) * count / statistics.mean(med[mode])})
                print(f"  breakdown {mode:<6} {part:<44} {m_[0]:9.1f} / {m_[1]:9.1f} ms", flush=True)
        results["breakdown"] = breakdown
        save()

    # ---- summary (printed before profiling, so a timeout during the profile loses nothing) ---------------
    print(f"\nSUMMARY bi_trainer_step  {env_summary(env)}")
    print(f"    4-layer Qwen3.5-9B slice (3 GDN + 1 gated attn, hidden {cfg.dim}), vocab {cfg.vocab_size}, bf16 weights, "
          f"fp32 head; T={T} packed {lengths}; token_logprobs -> nansum -> backward")
    print(f"    GDN: BI = recurrent {'FLA' if uses_fla else 'torch'} fwd + {'FLA' if uses_fla else 'torch'} chunked bwd; non-BI = chunk "
          f"{'FLA' if uses_fla else 'torch'} fwd+bwd. FLA #640 guard: {guard}")
    print(fmt_table(rows, [("mode", "mode", ""), ("ms_r1", "r1 ms/step", ".1f"), ("ms_r2", "r2 ms/step", ".1f"),
                           ("spread_pct", "spread%", ".1f"), ("tokens_per_s", "tokens/s", ",.0f"),
                           ("useful_tflops", "useful TF/s", ".1f"), ("peak_gib", "peak GiB", ".1f"), ("error", "error", "")]))
    print("    useful FLOPs/step: " + ", ".join(f"{k} {v / 1e12:.2f} T" for k, v in flops.items()))
    if ratio is not None:
        print(f"RATIO BI/non-BI throughput = {ratio:.3f}  (BI step {1 / ratio:.2f}x the time of the non-BI step)")
    if results["ratio_bi_fla_rec_over_nonbi_throughput"] is not None:
        print(f"RATIO BI (FLA recurrent GDN)/non-BI throughput = {results['ratio_bi_fla_rec_over_nonbi_throughput']:.3f}")
    print(f"BI order check: {'PASS' if bi_ok else 'FAIL'} ({check['bi']['differing']}/{check['bi']['tokens']} differ; "
          f"FLA recurrent {check['bi_fla_rec']['differing']}); "
          f"non-BI: {check['nonbi']['differing']}/{check['nonbi']['tokens']} differ, alone "
          f"{check['nonbi']['prefix_differing']}/{check['nonbi']['prefix_tokens']}")
    if breakdown:
        print("breakdown (fwd+bwd of each part alone; pct = part x count / full step):")
        print(fmt_table(breakdown, [("mode", "mode", ""), ("part", "part", ""), ("ms_r1", "r1 ms", ".1f"),
                                    ("ms_r2", "r2 ms", ".1f"), ("ms_total", "x count ms", ".1f"), ("pct_of_step", "% step", ".0f")]))
    save()

    # ---- profile: the cheap mode first, each only if the budget allows ----------------------------------
    if args.profile:
        profiles: dict[str, Any] = {}
        for mode in sorted((m for m in modes if m not in errors), key=lambda m: statistics.mean(med[m])):
            est = statistics.mean(med[mode]) / 1e3 * 3 + 10  # profiled step (slower) + trace processing
            if time.perf_counter() - t_start + est > args.budget_s + 30:
                print(f"\nPROFILE {mode}: skipped (budget: ~{est:.0f} s needed)")
                continue
            with batch_invariant(modes[mode]):
                profiles[mode] = profile_step(train_step, dev)
            print_profile(mode, profiles[mode])
            results["profile"] = profiles
            save()
    print(f"wall {time.perf_counter() - t_start:.1f} s" + (f"; wrote {args.out}" if args.out else ""))
    return 0 if bi_ok else 1


if __name__ == "__main__":
    sys.exit(main())
