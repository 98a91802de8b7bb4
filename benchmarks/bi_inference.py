"""Issue 8, benchmark 4: inference through the model's state path, batch invariance on vs off.

    python benchmarks/bi_inference.py [--vocab 248320] [--batches 1,32,256] [--decode-ctx 512] [--out inf.json]
    python benchmarks/bi_inference.py --smoke        # toy width, CPU, < 1 minute

Same 4-layer Qwen3.5-9B slice as ``bi_trainer_step.py`` (3 GDN + 1 gated attention, bf16, real vocab).
Every call goes through the inference-state path the vLLM plugin uses: ``Decoder.init_states`` for the
states, then one engine step = ``Decoder.hidden(tokens, batch, states)`` + the LM head on the last token
of each sequence -- i.e. ``Decoder.step`` with vLLM's logits selection and the plugin's head precision
(``vllm_titan_plugin.model.compute_logits``: fp32 head in BI mode, bf16 otherwise).

- prefill: T packed tokens of mixed-length new sequences (default 8192 = 1000+3000+2500+1692) from
  empty states -> tokens/s. GDN: recurrent kernel with BI on, chunked with BI off; attention:
  ``attention_bi`` vs SDPA.
- decode: one step of B sequences (B in 1, 32, 256), each with ``--decode-ctx`` tokens of context
  already in its state (random KV / GDN states of the right shapes: the step's cost does not depend on
  their values) -> step latency and tokens/s.
All modes in the same process, two interleaved rounds each (median of reps per round): BI and non-BI, each also
with FLA's recurrent GDN kernel (``*_fla``, ``TITAN_GDN_RECURRENT=fla``) in place of the project's (the default).
Sanity checks: BI prefill last-token logits bit-identical when the sequences are packed in another
order behind a filler sequence; BI decode logits of sequence 0 bit-identical at every batch size (exit
code 1 if either fails).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common (it also puts the repo root on sys.path)
from bench_common import Timer, base_parser, build_slice, env_summary, environment, fmt_table  # noqa: E402
from bench_common import env_set, json_saver, print_header, resolve_device, two_packings, two_rounds  # noqa: E402
from bench_common import add_slice_args, packed_lengths  # noqa: E402

from titan_rl_ext.kernels.batch_invariant import batch_invariant  # noqa: E402
from titan_rl_ext.kernels.gdn import RECURRENT_ENV, fla_available  # noqa: E402
from titan_rl_ext.models.common.attention import KVState  # noqa: E402
from titan_rl_ext.models.common.batch import SeqBatch  # noqa: E402
from titan_rl_ext.models.common.decoder import FULL_ATTENTION, Decoder, LayerState  # noqa: E402
from titan_rl_ext.models.qwen3_5.gdn import GDNState  # noqa: E402

# --------------------------------------------------------------------------------------------------
# the engine step and decode states


@torch.no_grad()
def engine_step(model: Decoder, tokens: torch.Tensor, batch: SeqBatch, states: list[LayerState],
                fp32_head: bool, literal: bool = False) -> tuple[torch.Tensor, list[LayerState]]:
    """``Decoder.step`` as the vLLM plugin runs it: logits only for each sequence's last token (what the
    sampler reads), fp32 head in BI mode. ``literal``: ``Decoder.step`` itself (bf16 logits of every token)."""
    if literal:
        return model.step(tokens, batch, states)
    h, new_states = model.hidden(tokens, batch, states)
    assert new_states is not None
    last = batch.cu_seqlens[1:].long() - 1
    return model.logits(h[last], fp32=fp32_head), new_states


def random_states(model: Decoder, B: int, ctx: int, dev: torch.device, seed: int = 3) -> list[LayerState]:
    """States of B sequences with ``ctx`` tokens already processed: ``init_states`` for the structure,
    random contents (KV history of ``ctx`` tokens; conv and fp32 SSM states)."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    out: list[LayerState] = []
    for layer, s in zip(model.layers, model.init_states(B, dev)):
        if isinstance(s, KVState):
            a = layer.attention
            dtype = s.k[0].dtype if s.k else torch.bfloat16
            k = torch.randn(B, ctx, a.n_kv_heads, a.head_dim, device=dev, generator=gen).to(dtype)
            v = torch.randn(B, ctx, a.n_kv_heads, a.head_dim, device=dev, generator=gen).to(dtype)
            out.append(KVState(tuple(k.unbind(0)), tuple(v.unbind(0))))
        else:
            conv = (torch.randn(s.conv.shape, device=dev, generator=gen) * 0.5).to(s.conv.dtype)
            ssm = torch.randn(s.ssm.shape, device=dev, generator=gen) * 0.05
            out.append(GDNState(conv, ssm))
    return out


def first_states(states: list[LayerState], B: int) -> list[LayerState]:
    """The states of the first B sequences (views; sequence 0's state is the same object at every B)."""
    return [KVState(s.k[:B], s.v[:B]) if isinstance(s, KVState) else GDNState(s.conv[:B], s.ssm[:B]) for s in states]


def weight_bytes(model: Decoder) -> tuple[int, int]:
    """(bytes of the layers' projection weights, bytes of the LM head weight) as stored."""
    proj = sum(m.weight.numel() * m.weight.element_size() for m in model.layers.modules() if isinstance(m, nn.Linear))
    w = model.lm_head_weight()
    return proj, w.numel() * w.element_size()


# --------------------------------------------------------------------------------------------------


def main() -> int:
    ap = base_parser(__doc__, "toy width, 152-token prefill, B in 1,4,8: CPU check")
    add_slice_args(ap, "prefill: packed sequence lengths")
    ap.add_argument("--batches", default="1,32,256", help="decode batch sizes")
    ap.add_argument("--decode-ctx", type=int, default=512, help="context tokens already in each decode state")
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--decode-reps", type=int, default=10)
    ap.add_argument("--max-s", type=float, default=8.0, help="cap on one timing run (s)")
    ap.add_argument("--literal-step", action="store_true",
                    help="time Decoder.step itself (bf16 logits of every token) instead of the plugin's head")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    t_start = time.perf_counter()
    dev = resolve_device(ap, args)
    lengths = packed_lengths(args)
    if args.smoke:
        batches, ctx = [1, 4, 8], 40
        args.prefill_reps, args.decode_reps, args.max_s = 1, 2, 3.0
    else:
        batches, ctx = [int(b) for b in args.batches.split(",")], args.decode_ctx
    T = sum(lengths)
    uses_fla = dev.type == "cuda" and fla_available()
    env = environment(dev)
    cfg, model = build_slice(dev, args.smoke, args.vocab)
    model.eval()
    proj_b, head_b = weight_bytes(model)
    print_header(f"bi_inference: 4-layer Qwen3.5-9B slice ({'toy width' if args.smoke else 'real width'}), vocab "
                 f"{cfg.vocab_size}; prefill T={T} {lengths}; decode B={batches} at ctx {ctx}", env)
    print(f"    GDN: BI = recurrent {'FLA' if uses_fla else 'torch'}; non-BI = chunk (prefill) / recurrent (decode: "
          f"the wrapper picks it for <=2 tokens per sequence){' via FLA' if uses_fla else ' (torch)'}; "
          "head fp32 with BI, bf16 without (as the vLLM plugin)", flush=True)
    # *_fla: FLA's recurrent GDN kernel (TITAN_GDN_RECURRENT=fla: BI's forward, non-BI decode) instead of the project's
    modes = {"bi": (True, {}), "nonbi": (False, {}), "bi_fla": (True, {RECURRENT_ENV: "fla"}),
             "nonbi_fla": (False, {RECURRENT_ENV: "fla"})}
    timer = Timer(dev)
    results: dict[str, Any] = {"env": env, "args": vars(args), "lengths": lengths, "batches": batches, "ctx": ctx,
                               "vocab": cfg.vocab_size}
    checks: dict[str, Any] = {}
    save = json_saver(args.out, results, t_start)

    # ---- prefill -------------------------------------------------------------------------------------------
    # packing A (timed); packing B: a 127-token filler sequence, then the same sequences rotated (other offsets, other T)
    toks, batch, perm, toks2, batch2 = two_packings(lengths, cfg.vocab_size, dev)

    def prefill(on: bool, t: torch.Tensor = toks, b: SeqBatch = batch) -> torch.Tensor:
        return engine_step(model, t, b, model.init_states(b.num_seqs, dev), fp32_head=on, literal=args.literal_step)[0]

    for mode, (on, sw) in modes.items():  # order check (doubles as the compile warm-up)
        with batch_invariant(on), env_set(**sw):
            a, b = prefill(on), prefill(on, toks2, batch2)
        if args.literal_step:  # logits of every token: keep each sequence's last
            a = a[batch.cu_seqlens[1:].long() - 1]
            b = b[batch2.cu_seqlens[1:].long() - 1]
        b = b[torch.tensor([1 + perm.index(i) for i in range(len(lengths))], device=dev)]  # back to packing A
        checks[f"prefill_order_{mode}_identical"] = bool(torch.equal(a, b))
        checks[f"prefill_order_{mode}_max_abs_diff"] = (a.float() - b.float()).abs().max().item()
    print(f"prefill order check: BI {'bit-identical' if checks['prefill_order_bi_identical'] else 'DIFFERENT'}; "
          f"non-BI max |diff| {checks['prefill_order_nonbi_max_abs_diff']:.2e}", flush=True)
    med: dict[str, list[float]] = {m: [] for m in modes}
    for rnd in range(2):
        for mode, (on, sw) in modes.items():
            with batch_invariant(on), env_set(**sw):
                t = timer.run(lambda: prefill(on), warmup=1 if rnd == 0 else 0, reps=args.prefill_reps, max_s=args.max_s)
            med[mode].append(statistics.median(t))
            print(f"  prefill round {rnd + 1} {mode:<6} {med[mode][-1]:10.2f} ms", flush=True)
    # useful prefill FLOPs: projections, causal attention core, head on the logits rows actually computed
    n_attn_layers = sum(layer.layer_type == FULL_ATTENTION for layer in model.layers)
    head_rows = T if args.literal_step else len(lengths)
    proj_params = sum(m.weight.numel() for m in model.layers.modules() if isinstance(m, nn.Linear))
    prefill_flops = (2 * T * proj_params + 2 * head_rows * cfg.dim * cfg.vocab_size
                     + n_attn_layers * sum(2 * L * L * cfg.n_heads * cfg.head_dim for L in lengths))
    prefill_rows = []
    for mode in modes:
        r = two_rounds(med[mode])
        ms = r["ms"]
        prefill_rows.append({"phase": "prefill", "mode": mode, "B": len(lengths), "tokens": T, **r,
                             "tokens_per_s": T / ms * 1e3, "tflops": prefill_flops / ms / 1e9})
    results["prefill"] = prefill_rows
    save()

    # ---- decode ---------------------------------------------------------------------------------------------
    full = random_states(model, max(batches), ctx, dev)
    dgen = torch.Generator().manual_seed(2)
    dec_toks = torch.randint(0, cfg.vocab_size, (max(batches),), generator=dgen).to(dev)
    g = cfg.gdn
    n_gdn = sum(isinstance(s, GDNState) for s in full)
    n_attn = len(full) - n_gdn
    decode_rows = []
    row0: dict[str, dict[int, torch.Tensor]] = {m: {} for m in modes}
    for B in batches:
        states = first_states(full, B)
        tok_B = dec_toks[:B]
        batch_B = SeqBatch.from_lengths([1] * B, [ctx] * B, device=dev)
        med = {m: [] for m in modes}
        for mode, (on, sw) in modes.items():
            with batch_invariant(on), env_set(**sw):
                row0[mode][B] = engine_step(model, tok_B, batch_B, states, fp32_head=on, literal=args.literal_step)[0][0].clone()
        for rnd in range(2):
            for mode, (on, sw) in modes.items():
                def step(on: bool = on) -> Any:
                    return engine_step(model, tok_B, batch_B, states, fp32_head=on, literal=args.literal_step)
                with batch_invariant(on), env_set(**sw):
                    t = timer.run(step, warmup=2 if rnd == 0 else 1, reps=args.decode_reps, max_s=args.max_s)
                med[mode].append(statistics.median(t))
        # bytes a step must move at least: weights once (BI: the head is also cast to fp32 every step,
        # not counted), GDN states read + written (fp32 ssm + conv), the KV history read
        state_b = n_gdn * B * (g.n_v_heads * g.k_head_dim * g.v_head_dim * 4 + (g.conv_kernel - 1) * g.conv_dim * 2) * 2
        kv_b = n_attn * B * (ctx + 1) * cfg.n_kv_heads * cfg.head_dim * 2 * 2
        min_bytes = proj_b + head_b + state_b + kv_b
        for mode in modes:
            r = two_rounds(med[mode])
            ms = r["ms"]
            decode_rows.append({"phase": "decode", "mode": mode, "B": B, "ctx": ctx, **r,
                                "tokens_per_s": B / ms * 1e3, "min_gb": min_bytes / 1e9, "gbs": min_bytes / ms / 1e6})
            print(f"  decode B={B:<4} {mode:<6} {med[mode][0]:9.2f} / {med[mode][1]:9.2f} ms", flush=True)
        del states
    for mode in modes:
        ref = row0[mode][batches[0]]
        checks[f"decode_seq0_{mode}_identical_across_B"] = all(torch.equal(ref, r) for r in row0[mode].values())
    results["decode"] = decode_rows
    results["checks"] = checks
    save()

    # ---- summary -------------------------------------------------------------------------------------------
    rows = prefill_rows + decode_rows
    by = {(r["phase"], r["B"], r["mode"]): r for r in rows}
    ratios = []
    for r in rows:
        if r["mode"] == "bi":
            base = by[(r["phase"], r["B"], "nonbi")]
            ratios.append({"phase": r["phase"], "B": r["B"], "bi_tok_s": r["tokens_per_s"], "nonbi_tok_s": base["tokens_per_s"],
                           "ratio": r["tokens_per_s"] / base["tokens_per_s"], "bi_ms": r["ms"], "nonbi_ms": base["ms"]})
    results["ratios"] = ratios
    # the recurrent kernels against each other: *_fla over the default (the project's), and BI with FLA's over non-BI
    results["ratios_fla"] = [
        {"phase": r["phase"], "B": r["B"], "mode": r["mode"],
         "over_default": r["tokens_per_s"] / by[(r["phase"], r["B"], r["mode"][:-4])]["tokens_per_s"],
         **({"bi_fla_over_nonbi": r["tokens_per_s"] / by[(r["phase"], r["B"], "nonbi")]["tokens_per_s"]}
            if r["mode"] == "bi_fla" else {})}
        for r in rows if r["mode"].endswith("_fla")]
    print(f"\nSUMMARY bi_inference  {env_summary(env)}")
    print(f"    4-layer 9B slice, vocab {cfg.vocab_size}; prefill T={T} {lengths} from empty states; decode at ctx {ctx} "
          "(random states); engine step = " + ("Decoder.step (bf16 logits of every token)" if args.literal_step
                                               else "Decoder.hidden + head on last tokens (fp32 head with BI)"))
    print("    useful TF/s: projections + causal attention + head rows (prefill); minIO GB/s: weights once + GDN "
          "states read/written + KV read (decode)")
    print(fmt_table(rows, [("phase", "phase", ""), ("mode", "mode", ""), ("B", "B", "d"), ("ms_r1", "r1 ms", ".2f"),
                           ("ms_r2", "r2 ms", ".2f"), ("spread_pct", "spread%", ".1f"), ("tokens_per_s", "tokens/s", ",.0f"),
                           ("tflops", "useful TF/s", ".1f"), ("gbs", "minIO GB/s", ".0f")]))
    print("RATIOS BI/non-BI throughput: " + "; ".join(f"{r['phase']} B={r['B']} {r['ratio']:.3f}" for r in ratios))
    print("RATIOS FLA's recurrent GDN kernel / the project's: " + "; ".join(
        f"{r['mode']} {r['phase']} B={r['B']} {r['over_default']:.3f}" for r in results["ratios_fla"]))
    print("RATIOS BI (FLA recurrent)/non-BI: " + "; ".join(
        f"{r['phase']} B={r['B']} {r['bi_fla_over_nonbi']:.3f}" for r in results["ratios_fla"] if r["mode"] == "bi_fla"))
    print("checks: " + json.dumps(checks))
    ok = all(checks[f"prefill_order_{m}_identical"] and checks[f"decode_seq0_{m}_identical_across_B"] for m in ("bi", "bi_fla"))
    if not ok:
        print("FAIL: BI inference results depend on batch composition")
    save()
    print(f"wall {time.perf_counter() - t_start:.1f} s" + (f"; wrote {args.out}" if args.out else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
