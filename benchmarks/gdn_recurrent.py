"""Issue 25 item 3 / issue 21: the project's recurrent GDN kernel (``kernels.gdn_triton``) against FLA's, on
Qwen3.5-9B GDN shapes (16 qk heads, 32 v heads, dim 128). One process builds, checks and times every variant.

    python benchmarks/gdn_recurrent.py [--out gdn_recurrent.json]
    TRITON_INTERPRET=1 python benchmarks/gdn_recurrent.py --smoke --device cpu   # tiny shapes, CPU
    python benchmarks/gdn_recurrent.py --long [--out gdn_long.json]   # one 32K and one 64K prompt, shipped config

Workloads (one GDN layer's token mixing; inputs as ``GatedDeltaNet`` hands them over: q/k fp32 L2-normalised,
v/beta bf16, g fp32):
  train     T = 8192 packed from 1000,3000,2500,1692, no state        (the BI trainer's forward)
  prefill   16 x 2048 with states                                       (a BI prefill step in vLLM)
  decode_B  B = 1, 32, 256 sequences of one token with states           (a decode step)
  long      (``--long``, instead of the above) one prompt of 32768 / 65536 tokens with a state: a long prompt's
            prefill, where the recurrent kernel has one program per (value head, value block) and the figure of
            merit is its per-token chain (the shipped config, FLA's chunk and recurrent kernels)

Variants:
  fla_rec     FLA fused_recurrent (BV 8, one warp)   -- what BI runs today (TITAN_GDN_RECURRENT=fla)
  fla_chunk   FLA chunk                               -- the non-BI forward, the speed to aim at
  titan[...]  kernels.gdn_triton at each config: BV, warps
  titan_prep  the default config with the l2norm and gates fused in (raw q/k/a/b), against
              rows.l2norm x2 + rows.gdn_gates + the kernel (titan_unfused), one layer's preparation included
  fla_gather / titan_gather / titan_slots  (workloads with states) the call as the vLLM wrapper makes it, from an
              engine's state cache: gather the slots, run, scatter back -- or (titan_slots) read and write the
              slots in place

Checks, each titan config on the GPU (a config whose bits break is reported and not a candidate):
  split_decode_equal   one 300-token call == a 100/150 split prefill + 50 one-token decode calls (o and state)
  alone_equal          a sequence alone == its rows in the packed train batch
  max_err_vs_f64       |o - o_f64| max over the train batch, f64 = the torch chunked form in float64
                       (FLA's recurrent reported beside it)
Throughput floor: the state is read and written once per sequence; the inputs once per token -- at the train
shape 8192 x (2 x 16 x 128 x 4 + 32 x 128 x 2 + 32 x 6) B ~ 168 MB, 0.04 ms at 4.3 TB/s, so every variant is
bound by the per-token dependency chain, not bytes: the figure of merit is us per token of the longest sequence.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common (it also puts the repo root on sys.path)
from bench_common import Timer, add_timing_args, base_parser, environment, fmt_table, json_saver  # noqa: E402
from bench_common import print_header, resolve_device, two_rounds  # noqa: E402

from titan_rl_ext.kernels import rows  # noqa: E402
from titan_rl_ext.kernels.gdn import chunk_gated_delta_rule_torch, fla_available, gated_delta_rule  # noqa: E402


def make_inputs(lengths: list[int], H: int, HV: int, K: int, V: int, dev: torch.device, state: bool,
                seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator(device=dev).manual_seed(seed)
    T = sum(lengths)
    q_raw = torch.randn(T, H, K, device=dev, generator=gen).bfloat16()
    k_raw = torch.randn(T, H, K, device=dev, generator=gen).bfloat16()
    a = torch.randn(T, HV, device=dev, generator=gen).bfloat16()
    b = torch.randn(T, HV, device=dev, generator=gen).bfloat16()
    A_log = torch.empty(HV, device=dev).uniform_(1, 16, generator=gen).log()
    dt_bias = torch.ones(HV, device=dev, dtype=torch.bfloat16)
    g, beta = rows.gdn_gates_torch(a, b, A_log, dt_bias)
    x = dict(
        q=F.normalize(q_raw.float(), dim=-1), k=F.normalize(k_raw.float(), dim=-1),
        v=torch.randn(T, HV, V, device=dev, generator=gen).bfloat16(), g=g, beta=beta,
        q_raw=q_raw, k_raw=k_raw, a=a, b=b, A_log=A_log, dt_bias=dt_bias, scale=K**-0.5,
        cu=torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=dev),
        s0=(torch.randn(len(lengths), HV, K, V, device=dev, generator=gen) * 0.1) if state else None,
    )
    if state:  # an engine's state cache: twice the sequences' slots, each sequence at a random one
        n = len(lengths)
        x["cache"] = torch.randn(2 * n, HV, K, V, device=dev, generator=gen) * 0.1
        x["slots"] = torch.randperm(2 * n, device=dev, generator=gen)[:n]
    return x


def engine_step(x: dict[str, Any], kernel: str) -> Any:
    """One GDN core call as the vLLM wrapper makes it, state handling included: ``fla_gather`` / ``titan_gather``
    gather the sequences' slots from the cache, run the kernel and scatter the new states back (the wrapper's
    path with TITAN_GDN_RECURRENT=fla, today's default); ``titan_slots`` reads and writes the slots in place."""
    from titan_rl_ext.kernels.gdn_triton import gated_delta_rule_recurrent

    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    if kernel == "titan_slots":
        return gated_delta_rule_recurrent(*args, x["cu"], x["scale"], x["cache"], state_slots=x["slots"])
    h0 = x["cache"].index_select(0, x["slots"])
    if kernel == "fla_gather":
        o, s = gated_delta_rule(*args, x["cu"], x["scale"], h0, "recurrent", "fla")
    else:
        o, s = gated_delta_rule_recurrent(*args, x["cu"], x["scale"], h0)
    x["cache"].index_copy_(0, x["slots"], s)
    return o, s


STATEFUL = ("fla_gather", "titan_gather", "titan_slots")  # timed where the workload carries states


def configs(smoke: bool) -> list[Any]:
    from titan_rl_ext.kernels.gdn_triton import CONFIG, RecurrentConfig

    if smoke:
        return [CONFIG, RecurrentConfig(BV=4)]
    layouts = ((8, 1), (4, 1), (16, 1), (16, 2), (32, 2), (32, 4), (8, 2), (64, 4), (128, 4))
    return [CONFIG, *(RecurrentConfig(BV=bv, num_warps=w) for bv, w in layouts)]


def name_of(cfg: Any) -> str:
    return f"titan[bv{cfg.BV} w{cfg.num_warps}]"


def run_titan(x: dict[str, Any], cfg: Any, fused_prep: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    from titan_rl_ext.kernels.gdn_triton import gated_delta_rule_recurrent

    if fused_prep:
        return gated_delta_rule_recurrent(x["q_raw"], x["k_raw"], x["v"], x["a"], x["b"], x["cu"], x["scale"], x["s0"],
                                          A_log=x["A_log"], dt_bias=x["dt_bias"], norm_qk=True, config=cfg)
    return gated_delta_rule_recurrent(x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu"], x["scale"], x["s0"], config=cfg)


def run_unfused(x: dict[str, Any], cfg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """What the layer runs today before the rule kernel: l2norm q, l2norm k, the gates (one launch each on CUDA)."""
    from titan_rl_ext.kernels.gdn_triton import gated_delta_rule_recurrent

    q, k = rows.l2norm(x["q_raw"]), rows.l2norm(x["k_raw"])
    g, beta = rows.gdn_gates(x["a"], x["b"], x["A_log"], x["dt_bias"])
    return gated_delta_rule_recurrent(q, k, x["v"], g, beta, x["cu"], x["scale"], x["s0"], config=cfg)


def bit_checks(cfg: Any, train: dict[str, Any], H: int, HV: int, K: int, V: int, dev: torch.device,
               n: int = 300) -> dict[str, Any]:
    from titan_rl_ext.kernels.gdn_triton import gated_delta_rule_recurrent as rec

    x = make_inputs([n], H, HV, K, V, dev, state=True, seed=7)
    args = lambda a, b: [x[name][a:b] for name in ("q", "k", "v", "g", "beta")]  # noqa: E731
    one = lambda m: torch.tensor([0, m], dtype=torch.int32, device=dev)  # noqa: E731
    o_all, s_all = rec(*args(0, n), x["cu"], x["scale"], x["s0"], config=cfg)
    cuts = [0, n // 3, n // 3 + n // 2, *range(n // 3 + n // 2 + 1, n + 1)]
    state, outs = x["s0"], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        o, state = rec(*args(a, b), one(b - a), x["scale"], state, config=cfg)
        outs.append(o)
    split_ok = torch.equal(torch.cat(outs), o_all) and torch.equal(state, s_all)
    o_pack, _ = run_titan(train, cfg)
    c = train["cu"].tolist()
    alone, _ = rec(*(train[nm][c[1]:c[2]] for nm in ("q", "k", "v", "g", "beta")), one(c[2] - c[1]), train["scale"],
                   None, config=cfg)
    return {"split_decode_equal": split_ok, "alone_equal": torch.equal(alone, o_pack[c[1]:c[2]])}


def main() -> int:
    ap = base_parser(__doc__, "tiny heads and lengths (CPU: set TRITON_INTERPRET=1)")
    ap.add_argument("--heads", default="16,32,128,128", help="qk heads, v heads, k dim, v dim (9B)")
    add_timing_args(ap, warmup=2, reps=10, max_s=1.5)
    ap.add_argument("--out", default="")
    ap.add_argument("--long", action="store_true", help="one 32K and one 64K prompt instead, the shipped config only")
    args = ap.parse_args()
    dev = resolve_device(ap, args)
    t_start = time.perf_counter()
    if args.smoke:
        H, HV, K, V = 2, 4, 32, 32
        shapes = {"train": ([20, 50, 30], False), "prefill": ([24] * 2, True), "decode_B4": ([1] * 4, True)}
        args.reps, args.warmup = 2, 1
    else:
        H, HV, K, V = (int(n) for n in args.heads.split(","))
        shapes = {"train": ([1000, 3000, 2500, 1692], False), "prefill": ([2048] * 16, True),
                  "decode_B1": ([1], True), "decode_B32": ([1] * 32, True), "decode_B256": ([1] * 256, True)}
        if args.long:
            shapes = {"train": ([1000, 3000, 2500, 1692], False), "long_32k": ([32768], True),
                      "long_64k": ([65536], True)}
    use_fla = dev.type == "cuda" and fla_available()
    env = environment(dev)
    env.update(fla_used=use_fla, heads=dict(H=H, HV=HV, K=K, V=V))
    print_header(f"gdn_recurrent: H={H} HV={HV} K={K} V={V}", env)
    results: dict[str, Any] = {"env": env, "shapes": {k: v[0] if len(v[0]) <= 16 else f"{len(v[0])} x 1"
                                                      for k, v in shapes.items()}}
    save = json_saver(args.out, results, t_start)
    inputs = {w: make_inputs(lens, H, HV, K, V, dev, state) for w, (lens, state) in shapes.items()}
    train = inputs["train"]

    # ---- variants, each compiled once and its bits checked ----------------------------------------
    variants: dict[str, Callable[[dict[str, Any]], Any]] = {}
    if use_fla:
        for mode in ("recurrent", "chunk"):
            variants[f"fla_{mode[:5] if mode == 'chunk' else 'rec'}"] = (
                lambda x, mode=mode: gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu"], x["scale"],
                                                      x["s0"], mode, "fla"))
    checks: dict[str, Any] = {}
    if args.long:
        from titan_rl_ext.kernels.gdn_triton import CONFIG

        cfgs = [CONFIG]
    else:
        cfgs = configs(args.smoke)
    for cfg in cfgs:
        t0 = time.perf_counter()
        name = name_of(cfg)
        try:
            with torch.no_grad():
                checks[name] = bit_checks(cfg, train, H, HV, K, V, dev, n=30 if args.smoke else 300)
        except Exception as e:  # a config that does not compile here is a result, not a crash
            checks[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(f"  {name}: FAILED {checks[name]['error']}")
            continue
        ok = all(checks[name].values())
        checks[name]["compile_and_check_s"] = round(time.perf_counter() - t0, 2)
        print(f"  {name}: bits {'ok' if ok else 'BROKEN ' + str(checks[name])}")
        if ok:
            variants[name] = lambda x, cfg=cfg: run_titan(x, cfg)
    default = name_of(cfgs[0])
    if default in variants:
        variants["titan_unfused"] = lambda x: run_unfused(x, cfgs[0])
        variants["titan_prep"] = lambda x: run_titan(x, cfgs[0], fused_prep=True)
    for n in () if args.long else STATEFUL:
        if n.startswith("titan") or use_fla:
            variants[n] = lambda x, n=n: engine_step(x, n)
    results["checks"] = checks
    save()

    # ---- accuracy against float64 (train batch) ----------------------------------------------------
    with torch.no_grad():
        if not args.smoke or dev.type == "cpu":
            o64, _ = chunk_gated_delta_rule_torch(train["q"], train["k"], train["v"].float(), train["g"],
                                                  train["beta"].float(), train["cu"], train["scale"],
                                                  compute_dtype=torch.float64)
            o64 = o64.double()
            err = {}
            for name, fn in variants.items():
                if name in ("titan_unfused", "titan_prep", "fla_chunk", *STATEFUL):
                    continue
                err[name] = (fn(train)[0].double() - o64).abs().max().item()
            results["max_err_vs_f64"] = err
            print("max |o - o_f64| (train batch; bf16 output, one ulp at 1 is 7.8e-3):",
                  {k: f"{v:.2e}" for k, v in err.items()})
    save()

    # ---- timing: two interleaved rounds -------------------------------------------------------------
    timer = Timer(dev)
    table: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        for w, x in inputs.items():
            timed = {n: fn for n, fn in variants.items() if x["s0"] is not None or n not in STATEFUL}
            med: dict[str, list[float]] = {n: [] for n in timed}
            for _ in range(2):
                for n, fn in timed.items():
                    med[n].append(statistics.median(timer.run(lambda: fn(x), args.warmup, args.reps, args.max_s)))
            table[w] = {n: two_rounds(m) for n, m in med.items()}
            results["timing_ms"] = table
            save()
    longest = {w: max(lens) for w, (lens, _) in shapes.items()}
    rows_out = []
    for n in variants:
        r: dict[str, Any] = {"variant": n}
        for w in inputs:
            if n in table[w]:
                r[w] = table[w][n]["ms"]
                r[f"us_per_token_{w}"] = 1e3 * table[w][n]["ms"] / longest[w]
        rows_out.append(r)
    per_token = [w for w in inputs if w == "train" or w.startswith("long")]
    cols = [("variant", "variant", "s")] + [(w, f"{w} ms", ".3f") for w in inputs] + [
        (f"us_per_token_{w}", f"us/token ({w}, longest seq)", ".3f") for w in per_token]
    print(fmt_table(rows_out, cols))
    if args.long:
        results["table"] = rows_out
        save()
        return 0
    base = "fla_rec" if "fla_rec" in variants else default
    cands = [n for n in variants if n.startswith("titan[")]
    if cands:
        best = min(cands, key=lambda n: table["train"][n]["ms"] + table["prefill"][n]["ms"])
        results["best_titan"] = best
        results["vs_" + base] = {w: table[w][base]["ms"] / table[w][best]["ms"] for w in inputs}
        print(f"SUMMARY  best titan config (train + prefill): {best}")
        print("SUMMARY  speed-up over " + base + ": " + "  ".join(f"{w} {v:.2f}x" for w, v in results["vs_" + base].items()))
        if "fla_chunk" in variants:
            print("SUMMARY  fla_chunk / best (train): "
                  f"{table['train']['fla_chunk']['ms'] / table['train'][best]['ms']:.2f}")
        if "titan_slots" in variants:
            gather = "fla_gather" if "fla_gather" in variants else "titan_gather"
            print(f"SUMMARY  state cache in place / {gather} (the wrapper today): " + "  ".join(
                f"{w} {table[w][gather]['ms'] / table[w]['titan_slots']['ms']:.2f}x" for w in inputs
                if "titan_slots" in table[w]))
        if "titan_prep" in variants:
            print("SUMMARY  fused prep / unfused: " + "  ".join(
                f"{w} {table[w]['titan_prep']['ms'] / table[w]['titan_unfused']['ms']:.2f}" for w in inputs))
    results["table"] = rows_out
    save()
    broken = [n for n, c in checks.items() if "error" in c or not all(v for k, v in c.items() if k != "compile_and_check_s")]
    if broken:
        print(f"SUMMARY  configs with broken bits or no build: {broken}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
