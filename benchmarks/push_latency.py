"""Weight-push latency under load: the OpenAI port vs the weights listener (issue 16, item 2). CPU.

One real vLLM server (``--model-impl titan``, tiny Qwen3.5, fp32, BI, prefix caching) serves every path at
once, so they are measured in one process, under the same load, interleaved push by push:

- ``openai_port_paused``: the OpenAI app's route, whose body is read on the event loop that is busy
  streaming, and a swap inside a pause of the scheduler (pause, copy, set version, resume: four engine
  calls through that loop) -- what every push did before;
- ``listener_paused``: the weights listener (``push_port``, its own thread and loop), same paused swap;
- ``openai_port``: the OpenAI route, and the swap as one engine-core call between two steps;
- ``listener``: the listener, and the swap between two steps.

Latency is from "the pusher starts sending" to "the response says the new version is live" (the server
answers after the engine core has the new version and generation resumed). Measured first with no
streams, then with ``--streams`` streaming completions kept running by a separate load process.

    .venv/bin/python benchmarks/push_latency.py --out benchmarks/results/push_latency_cpu.json

The target (issue 16): the default path's loaded p99 within 3x the unloaded p50.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TOKEN = "titan-push-latency-bench"
# a push's time, in order: before the route starts (connect, send, the listener's or the OpenAI loop's turn),
# reading the body, validating it, waiting for the engine's event loop, the swap, the answer's way back
PHASES = ("queue_s", "receive_s", "validate_s", "hop_s", "swap_s", "reply_s")


def _load(base: str, model: str, streams: int, stop: Any, started: Any, tokens: Any) -> None:
    """Child process: ``streams`` streaming completions at all times until ``stop`` is set."""
    import httpx

    from titan_rl_ext.rl.sse import sse_lines

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": model, "prompt": [3 + (i * 7 + j) % 500 for j in range(8 + i % 17)], "max_tokens": 128,
                "temperature": 1.0, "ignore_eos": True, "stream": True, "logprobs": 0, "return_token_ids": True}
        async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
            async for line in sse_lines(r.aiter_bytes()):
                if line.startswith("data: {"):
                    with tokens.get_lock():
                        tokens.value += 1

    async def main() -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=streams)
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
            n = 0

            async def slot() -> None:
                nonlocal n
                while not stop.is_set():
                    n += 1
                    await one(client, n)

            tasks = [asyncio.create_task(slot()) for _ in range(streams)]
            started.set()
            await asyncio.gather(*tasks)

    asyncio.run(main())


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _summary(xs: list[float]) -> dict[str, Any]:
    return {"n": len(xs), "p50_s": statistics.median(xs), "p99_s": _pct(xs, 0.99), "max_s": max(xs),
            "all_s": [round(x, 4) for x in xs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--pushes", type=int, default=24, help="pushes per path and condition")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    import requests
    import torch

    from bench_common import git_state
    from titan_rl_ext.models.hf import load_hf_model
    from titan_rl_ext.rl.generator_server import GeneratorServer, server_env
    from titan_rl_ext.rl.weight_sync import WeightPusher, serialize
    from titan_rl_ext.tools.make_tiny import make_tiny

    work = Path(tempfile.mkdtemp(prefix="push-latency-"))
    model_dir = make_tiny("qwen3_5", work / "ckpt", seed=0, layout="vlm", tie=False)
    env = server_env({"HF_HUB_OFFLINE": "1", "TITAN_SWAP_TOKEN": TOKEN, "TITAN_BATCH_INVARIANT": "1",
                      "TITAN_SWAP_PORT": "0"})
    results: dict[str, Any] = {"benchmark": "push_latency", "device": "cpu", "cpus": os.cpu_count(),
                               "streams": args.streams, **git_state()}
    with GeneratorServer(model_dir, work / "server.log", ["--dtype", "float32", "--max-model-len", "512",
                                                          "--enable-prefix-caching"], env) as srv:
        model, _ = load_hf_model(model_dir, dtype=torch.float32)
        ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
        srv.wait_ready()
        paths = {"openai_port_paused": WeightPusher([srv.base], TOKEN, use_listener=False, pause=True),
                 "listener_paused": WeightPusher([srv.base], TOKEN, pause=True),
                 "openai_port": WeightPusher([srv.base], TOKEN, use_listener=False),
                 "listener": WeightPusher([srv.base], TOKEN)}
        assert paths["listener"].push_url(srv.base) != srv.base, "the server advertises no weights listener"
        results["payload_bytes"] = len(serialize(ref))
        version = requests.get(f"{srv.base}/titan/v1/weights/version", timeout=30).json()["version"]

        parts: dict[str, dict[str, list[float]]] = {}

        def push(path: str, label: str = "warm-up") -> float:
            nonlocal version
            version += 1
            sd = {k: v * (1 + 1e-3 * (version % 7)) if v.is_floating_point() else v for k, v in ref.items()}
            payload = serialize(sd)
            wall0, t0 = time.time(), time.perf_counter()
            got = paths[path].push_payload(payload, version, "keep")
            dt = time.perf_counter() - t0
            r = got[0]
            assert r["version"] == version, got
            p = parts.setdefault(label, {}).setdefault(path, {k: [] for k in PHASES})
            # same host: the server's wall clock at the route's start tells the queueing before it
            phase = {"queue_s": r["entered_unix"] - wall0, "receive_s": r["receive_seconds"],
                     "validate_s": r["validate_seconds"], "hop_s": r["hop_seconds"], "swap_s": r["swap_seconds"]}
            phase["reply_s"] = dt - sum(phase.values())
            for k, v in phase.items():
                p[k].append(v)
            return dt

        def measure(label: str) -> None:
            lat: dict[str, list[float]] = {p: [] for p in paths}
            for i in range(args.pushes):
                for p in (list(paths) if i % 2 == 0 else list(paths)[::-1]):  # interleaved, order alternating
                    lat[p].append(push(p, label))
                    time.sleep(0.2)
            results[label] = {p: {**_summary(x), **{f"{k[:-2]}_p50_s": statistics.median(parts[label][p][k]) for k in PHASES},
                                  "swap_max_s": max(parts[label][p]["swap_s"])} for p, x in lat.items()}

        for p in paths:  # warm every path
            push(p)
        measure("unloaded")
        ctx = mp.get_context("spawn")
        stop, started, tokens = ctx.Event(), ctx.Event(), ctx.Value("q", 0)
        load = ctx.Process(target=_load, args=(srv.base, str(model_dir), args.streams, stop, started, tokens))
        load.start()
        try:
            started.wait(120)
            deadline = time.time() + 120
            while tokens.value < 4 * args.streams and time.time() < deadline:  # every stream is producing
                time.sleep(0.2)
            t0, n0 = time.time(), tokens.value
            measure("loaded")
            results["loaded_chunks_per_s"] = (tokens.value - n0) / (time.time() - t0)
        finally:
            stop.set()
            load.join(120)
            if load.is_alive():
                load.kill()
    for p in paths:
        u, lo = results["unloaded"][p], results["loaded"][p]
        results[f"{p}_p99_loaded_over_p50_unloaded"] = lo["p99_s"] / u["p50_s"]
    print(json.dumps({k: v for k, v in results.items() if k not in ("unloaded", "loaded")}, indent=1))
    for label in ("unloaded", "loaded"):
        for p in paths:
            r = results[label][p]
            print(f"{label:9s} {p:19s} p50 {r['p50_s'] * 1e3:7.1f} ms  p99 {r['p99_s'] * 1e3:7.1f} ms  (p50 of each "
                  "phase, ms: " + ", ".join(f"{k[:-2]} {r[k[:-2] + '_p50_s'] * 1e3:.1f}" for k in PHASES)
                  + f"; swap max {r['swap_max_s'] * 1e3:.1f}; n={r['n']})")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
