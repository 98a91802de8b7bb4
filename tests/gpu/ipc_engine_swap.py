"""GPU, a real vLLM server: pushes through vLLM's weight-transfer calls with CUDA IPC handles (``titan_ipc``), timed
beside today's IPC route (``cuda_ipc``) on the same server in the same run (issue 43).

    python tests/gpu/ipc_engine_swap.py --model-dir DIR [--pushes 6] [--out result.json]

One titan generator, a server process started with ``--weight-transfer-config '{"backend": "titan_ipc"}'``, the
commit's worker extension, the push token and vLLM's dev routes: its worker opens this process's handles as a
same-host generator would. This process is the trainer: the checkpoint on the same GPU in the served dtypes, and
a perturbed copy (``vllm_ipc_swap.trainer_weights``). Today's IPC route is ``cuda_ipc``: one push request whose
JSON manifest the server's ``titan_load_weights_ipc`` worker method opens (what ``vllm_ipc_swap.py`` calls
directly, here behind the push route's version and re-salt); ``titan_ipc`` makes vLLM's four calls
(``/init_weight_transfer_engine`` once, ``/start_weight_update``, one ``/update_weights`` per bucket, each with
a manifest, ``/finish_weight_update`` with the version), the worker staging each bucket and the finish committing.

Rounds alternate perturbed and original weights; each round pushes with both transports (their order alternating,
so neither always follows the other), each push a new version. Per push: the trainer's wall time from ``push()`` to
the answer (the commit included) and the server's own phases. After every push the served version is the pushed
one (version route, and every token of a greedy completion tagged with it), the served checksums are the pushed
tensors', and the greedy tokens are the original's exactly after original weights and other tokens after
perturbed ones. The first push of each transport is a warm-up (``titan_ipc``'s carries the init), kept out of
the medians. Exit 0 when every check holds, 1 otherwise; 0 with a ``SKIP`` line without CUDA or vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # vllm_ipc_swap: the trainer's weights and the prompt, shared with today's IPC check
sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))  # the commit stamp every result carries
from vllm_ipc_swap import GREEDY_TOKENS, PROMPT_IDS, nbytes, trainer_weights  # noqa: E402

TRANSPORTS = ("titan_ipc", "cuda_ipc")
ENGINE_ARGS = ["--worker-extension-cls", "vllm_titan_plugin.swap.transfer_engine.TitanTransferExtension",
               "--weight-transfer-config", '{"backend": "titan_ipc"}']


def greedy(url: str, model: str) -> tuple[list[int], list[int | None]]:
    """A greedy completion of ``PROMPT_IDS``: its tokens and each token's weight version."""
    from titan_rl_ext.rl.generator_client import GeneratorClient
    from titan_rl_ext.rl.samples import SamplingConfig

    async def run() -> tuple[list[int], list[int | None]]:
        client = GeneratorClient(url, model)
        try:
            gen = await client.generate(PROMPT_IDS, SamplingConfig(temperature=0.0, max_tokens=GREEDY_TOKENS,
                                                                   extra={"ignore_eos": True}))
        finally:
            await client.aclose()
        return gen.token_ids, gen.versions

    return asyncio.run(run())


def served_version(url: str) -> int:
    import requests

    from titan_rl_ext.wire.protocol import VERSION_ROUTE

    return int(requests.get(f"{url}{VERSION_ROUTE}", timeout=30).json()["version"])


def served_spec(pusher: Any, url: str) -> dict[str, Any]:
    """The served model's push spec, from the worker method over vLLM's (signed) ``/collective_rpc`` dev route."""
    got = pusher.dev_post(url, "/collective_rpc", {"method": "titan_weight_spec"})
    if not got["ok"]:
        raise RuntimeError(f"/collective_rpc titan_weight_spec: HTTP {got['status']} {got['error']}")
    res = got["response"]
    return (res["results"] if isinstance(res, dict) else res)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--pushes", type=int, default=6, help="rounds; each pushes once per transport")
    ap.add_argument("--bucket-mb", type=int, default=256, help="titan_ipc's bytes per update_weights")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    ap.add_argument("--timeout", type=float, default=600, help="seconds for the server to come up")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.pushes < 2:
        ap.error("--pushes must be >= 2 (perturbed, then original weights back)")
    import torch

    if not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None:
        print("SKIP: ipc_engine_swap needs CUDA and vLLM (torch.cuda.is_available() "
              f"{torch.cuda.is_available()}, vllm importable {importlib.util.find_spec('vllm') is not None})")
        return 0
    from bench_common import git_state

    from titan_rl_ext.rl.generator_server import GeneratorServer
    from titan_rl_ext.rl.weight_sync import WeightPusher
    from titan_rl_ext.wire.weights import checksum

    token = os.environ.setdefault("TITAN_SWAP_TOKEN", "ipc-engine-test")
    env = {"TITAN_SWAP_TOKEN": token, "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    server_args = ["--dtype", "bfloat16", "--attention-backend", "TRITON_ATTN", "--enforce-eager", "--seed", "0",
                   "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--max-model-len", "2048",
                   *ENGINE_ARGS]
    log = Path(tempfile.mkdtemp(prefix="ipc_engine_swap_")) / "server.log"
    server = GeneratorServer(args.model_dir, log, server_args, env)
    out: dict[str, Any] = {**git_state(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "model_dir": args.model_dir, "bucket_bytes": args.bucket_mb << 20, "server_log": str(log)}
    ok = True
    try:
        server.wait_ready(args.timeout)
        url = server.base
        pushers = {name: WeightPusher([url], token, transport=name,
                                      transport_options={"bucket_bytes": args.bucket_mb << 20}
                                      if name == "titan_ipc" else None) for name in TRANSPORTS}
        original, perturbed = trainer_weights(args.model_dir, served_spec(pushers["titan_ipc"], url))
        out.update(tensors=len(original), bytes=nbytes(original))
        base_tokens, base_versions = greedy(url, args.model_dir)
        ok &= checksum(original) == pushers["cuda_ipc"].checksums(url) and set(base_versions) == {0}
        out["served_checkpoint_before_pushes"] = ok
        rows: list[dict[str, Any]] = []
        version, first_perturbed = 0, None
        for rnd in range(args.pushes):
            state, label = (perturbed, "perturbed") if rnd % 2 == 0 else (original, "original")
            for name in (TRANSPORTS if rnd % 2 == 0 else TRANSPORTS[::-1]):
                version += 1
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                answer = pushers[name].push(state, version)[0]
                seconds = time.perf_counter() - t0
                tokens, versions = greedy(url, args.model_dir)
                first_perturbed = first_perturbed or (tokens if label == "perturbed" else None)
                row = {"transport": name, "version": version, "weights": label, "seconds": seconds,
                       "warmup": not any(r["transport"] == name for r in rows),
                       "server": {k: v for k, v in answer.items() if k.endswith("seconds") or k in ("num_buckets",)},
                       "served_version": served_version(url), "token_versions": sorted(set(versions), key=str),
                       "checksums_match": pushers["cuda_ipc"].checksums(url) == checksum(state),
                       "greedy_as_expected": tokens == base_tokens if label == "original" else tokens != base_tokens,
                       "greedy_same_as_first_perturbed": tokens == first_perturbed if label == "perturbed" else None}
                row["ok"] = (row["served_version"] == version and row["token_versions"] == [version]
                             and row["checksums_match"] and row["greedy_as_expected"])
                ok &= row["ok"]
                rows.append(row)
                print(f"v{version:<3d} {name:9s} {label:9s} {seconds * 1e3:8.1f} ms  ok={row['ok']}  "
                      f"{row['server']}", flush=True)
        out["pushes"] = rows
        size = out["bytes"]
        for name in TRANSPORTS:
            timed = [r["seconds"] for r in rows if r["transport"] == name and not r["warmup"]]
            out[name] = {"median_s": statistics.median(timed), "min_s": min(timed), "n": len(timed),
                         "median_gb_per_s": size / statistics.median(timed) / 1e9}
        out["ratio_titan_ipc_over_cuda_ipc"] = {k: out["titan_ipc"][k] / out["cuda_ipc"][k] for k in ("median_s", "min_s")}
        print(f"{len(original)} tensors, {size / 1e9:.3f} GB: " + "; ".join(
            f"{n} median {out[n]['median_s'] * 1e3:.1f} ms ({out[n]['median_gb_per_s']:.1f} GB/s)" for n in TRANSPORTS)
            + f"; titan_ipc / cuda_ipc {out['ratio_titan_ipc_over_cuda_ipc']['median_s']:.2f}")
    except Exception as e:  # recorded in the JSON: the run's figures so far are still worth reading
        ok = False
        out["error"] = f"{type(e).__name__}: {e}"
        print(f"FAILED: {out['error']}\n--- server log (end) ---\n{log.read_text(errors='replace')[-4000:]}")
    finally:
        server.close()
    out["ok"] = bool(ok)
    print(json.dumps({k: v for k, v in out.items() if k != "pushes"}))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
