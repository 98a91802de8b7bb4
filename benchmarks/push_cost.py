"""Push cost: seconds per GB of weights, HTTP (``safetensors``) vs broadcast (``titan_gloo``, ``titan_gloo_relay``)
against the number of generators (issue 43, item 4). CPU.

Real vLLM servers (``--model-impl titan``, fp32, the ``titan_gloo`` engine, the push token), booted side by
side once; a Qwen3-shaped checkpoint of a few hundred MB (``--hidden``, ``--layers``) so that bytes, not
per-call overhead, dominate. For each generator count and transport: one untimed push (the broadcast group's
build, the HTTP listener's discovery), then ``--reps`` timed pushes of a new version each. A push's time is
the pusher's wall time from ``push()`` to every generator's answer (so it includes the commit on each).

    .venv/bin/python benchmarks/push_cost.py --out benchmarks/results/push_cost_cpu.json

Prints a table and the ratios (broadcast / HTTP per count; 2 generators / 1 per transport). The projection to
48 engines on 6 hosts lives in docs/transfer_engines.md (its formula takes these measured figures as inputs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TOKEN = "titan-push-cost-bench"
TRANSPORTS = ("safetensors", "titan_gloo", "titan_gloo_relay")
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "256",
               "--worker-extension-cls", "vllm_titan_plugin.swap.transfer_engine.TitanTransferExtension",
               "--weight-transfer-config", '{"backend": "titan_gloo"}']


def _kill(srv: Any) -> None:
    try:
        os.killpg(srv.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    srv.proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--generators", default="1,2", help="comma-separated generator counts")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "push_cost_cpu.json")
    args = ap.parse_args(argv)
    counts = sorted({int(c) for c in args.generators.split(",")})
    if not counts or counts[0] < 1:
        ap.error("--generators takes positive counts, e.g. 1,2")

    import torch

    from titan_rl_ext.models.hf import load_hf_model
    from titan_rl_ext.rl.generator_server import GeneratorServer, server_env
    from titan_rl_ext.rl.weight_sync import WeightPusher
    from titan_rl_ext.tools.make_tiny import make_tiny

    work = Path(tempfile.mkdtemp(prefix="push_cost_"))
    heads = args.hidden // 32
    model_dir = make_tiny("qwen3", work / "ckpt", layout="text", hidden_size=args.hidden,
                          intermediate_size=4 * args.hidden, num_hidden_layers=args.layers, num_attention_heads=heads,
                          num_key_value_heads=max(1, heads // 4), head_dim=32)
    env = server_env({"HF_HUB_OFFLINE": "1", "TITAN_SWAP_TOKEN": TOKEN, "VLLM_SERVER_DEV_MODE": "1"})
    servers = [GeneratorServer(model_dir, work / f"server{i}.log", SERVER_ARGS, env) for i in range(max(counts))]
    rows: list[dict[str, Any]] = []
    try:
        model, _ = load_hf_model(model_dir, dtype=torch.float32)
        ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
        nbytes = sum(t.numel() * t.element_size() for t in ref.values())
        for s in servers:
            s.wait_ready()
        version = 0
        for n in counts:
            urls = [s.base for s in servers[:n]]
            for name in TRANSPORTS:
                if name == "titan_gloo_relay" and n < 2:
                    continue  # one generator: the relay has no one to relay to
                opts = {"bucket_bytes": args.bucket_mb << 20} if name.startswith("titan_gloo") else None
                pusher = WeightPusher(urls, TOKEN, timeout_s=600, transport=name, transport_options=opts)
                times, phases = [], []
                for rep in range(args.reps + 1):
                    version += 1
                    sd = {k: v * (1 + 1e-3 * version) for k, v in ref.items()}
                    t0 = time.perf_counter()
                    answers = pusher.push(sd, version)
                    dt = time.perf_counter() - t0
                    if rep:  # the first push builds the group / finds the listener
                        times.append(dt)
                        phases.append({k: answers[0].get(k) for k in ("init_seconds", "transfer_seconds",
                                                                      "finish_seconds") if k in answers[0]})
                close = getattr(pusher.transport, "close", None)
                if close is not None:
                    close()
                med, best = statistics.median(times), min(times)
                # min too: on a shared 2-core host the median carries other processes' load
                rows.append({"transport": name, "generators": n, "bytes": nbytes, "seconds": times,
                             "median_s": med, "min_s": best, "s_per_gb": med / (nbytes / 1e9),
                             "min_s_per_gb": best / (nbytes / 1e9), "phases": phases,
                             "loadavg_1m": os.getloadavg()[0]})
                print(f"{name:18s} n={n}  {nbytes / 1e6:7.1f} MB  median {med:6.3f} s  "
                      f"{med / (nbytes / 1e9):6.2f} s/GB  min {best / (nbytes / 1e9):6.2f} s/GB  "
                      f"load {os.getloadavg()[0]:.1f}  {phases[-1]}", flush=True)
    finally:
        for s in servers:
            _kill(s)

    def med(name: str, n: int, key: str = "median_s") -> float | None:
        got = [r[key] for r in rows if r["transport"] == name and r["generators"] == n]
        return got[0] if got else None

    ratios: dict[str, float] = {}
    for n in counts:
        for name in ("titan_gloo", "titan_gloo_relay"):
            a, b = med(name, n), med("safetensors", n)
            if a and b:
                ratios[f"{name}/safetensors@{n}"] = a / b
            a, b = med(name, n, "min_s"), med("safetensors", n, "min_s")
            if a and b:
                ratios[f"{name}/safetensors@{n} (min)"] = a / b
    for name in TRANSPORTS:
        a, b = med(name, counts[-1]), med(name, counts[0])
        if a and b and counts[-1] != counts[0]:
            ratios[f"{name}@{counts[-1]}/@{counts[0]}"] = a / b
        a, b = med(name, counts[-1], "min_s"), med(name, counts[0], "min_s")
        if a and b and counts[-1] != counts[0]:
            ratios[f"{name}@{counts[-1]}/@{counts[0]} (min)"] = a / b
    for k, v in ratios.items():
        print(f"ratio {k}: {v:.2f}")
    doc = {"machine": f"{platform.machine()} {os.cpu_count()} cores, CPU only", "torch": torch.__version__,
           "model": {"arch": "qwen3", "hidden": args.hidden, "layers": args.layers, "bytes": nbytes,
                     "dtype": "float32"},
           "bucket_mb": args.bucket_mb, "reps": args.reps, "rows": rows, "ratios": ratios,
           "note": "all generators and the trainer on one 2-core host: loopback network; a push's time is "
                   "push() to every generator's answer, commit included"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
