"""Runs a ``verifiers`` (0.4) environment's episodes for ``envs.verifiers_source``, in the Python that has
``verifiers`` installed (by path: ``python verifiers_runner.py ...``; it imports verifiers and the
standard library only, never torch or this package).

Every model call goes through verifiers' own ``TrainClient``: it renders the chat with the model's
renderer, bridges each new turn onto the previous turn's sampled token ids (no re-tokenisation where the
renderer can bridge) and POSTs token ids to ``--base-url`` + ``/inference/v1/generate``, which is the
trainer's shim over its generator client. What comes back per episode is each branch of each trace:
the token ids, verifiers' sampled mask and logprobs, and the reward.

Protocol, one JSON object per line: stdout first says ``{"ready": true, "num_tasks": N}``; then for each
stdin line ``{"id": k, "task": i, "n": G, "sampling": {...}}`` a line ``{"id": k, "episodes": [...]}``
(or ``{"id": k, "error": "..."}``), in completion order. EOF on stdin ends the runner.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any


def _renderer(name: str) -> Any:
    from renderers import configs

    by_name = {cls.model_fields["name"].default: cls for cls in vars(configs).values()
               if isinstance(cls, type) and issubclass(cls, configs.BaseRendererConfig) and "name" in cls.model_fields}
    if name not in by_name:
        raise SystemExit(f"unknown renderer {name!r}; verifiers' renderers: {sorted(by_name)}")
    kwargs: dict[str, Any] = {}
    if "enable_thinking" in by_name[name].model_fields:
        kwargs["enable_thinking"] = False
    return by_name[name](**kwargs)


def _episode(ep: Any) -> dict[str, Any]:
    traces = []
    for tr in ep.traces:
        traces.append({
            "trace_id": tr.id, "ok": bool(tr.ok), "reward": float(tr.reward or 0.0), "num_turns": int(tr.num_turns),
            "errors": [str(getattr(e, "message", e))[:500] for e in tr.errors],
            "branches": [{"token_ids": list(b.token_ids), "sampled_mask": [bool(m) for m in b.sampled_mask],
                          "logprobs": [float(x) for x in b.logprobs]} for b in tr.branches],
        })
    return {"ok": bool(ep.ok), "errors": [str(getattr(e, "message", e))[:500] for e in ep.errors], "traces": traces}


async def _serve(args: argparse.Namespace, proto: Any) -> None:
    import verifiers.v1 as vf

    taskset = {"id": args.taskset, **json.loads(args.taskset_args)}
    harness = {"id": args.harness, **json.loads(args.harness_args)}
    env = vf.load_environment(vf.SingleAgentEnvConfig(
        taskset=taskset, agent=vf.AgentConfig(harness=harness, runtime=vf.SubprocessConfig())))
    tasks = list(env.taskset.take(args.max_tasks))
    client = vf.TrainClientConfig(base_url=args.base_url, api_key_var="TITAN_VF_KEY",
                                  renderer=_renderer(args.renderer), renderer_model_name=args.tokenizer)
    out_lock = asyncio.Lock()
    limit = asyncio.Semaphore(args.max_concurrent)

    async def emit(obj: dict[str, Any]) -> None:
        async with out_lock:
            proto.write(json.dumps(obj) + "\n")
            proto.flush()

    async def handle(req: dict[str, Any]) -> None:
        try:
            task = tasks[int(req["task"]) % len(tasks)]
            ctx = vf.ModelContext(model=args.model, client=client, sampling=vf.SamplingConfig(**req.get("sampling", {})))
            eps = await asyncio.gather(*(env.run_slot(s, ctx, semaphore=limit) for s in env.slots(task, int(req["n"]))))
            await emit({"id": req["id"], "episodes": [_episode(e) for e in eps]})
        except Exception as e:  # noqa: BLE001 -- one request's failure is reported, the runner keeps serving
            await emit({"id": req.get("id"), "error": f"{type(e).__name__}: {e}"})

    async with env.serving():
        await emit({"ready": True, "num_tasks": len(tasks)})
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        pending: set[asyncio.Task[None]] = set()
        while line := await reader.readline():
            if line.strip():
                t = asyncio.create_task(handle(json.loads(line)))
                pending.add(t)
                t.add_done_callback(pending.discard)
        if pending:
            await asyncio.gather(*pending)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--taskset", required=True, help="verifiers taskset id (an importable module)")
    ap.add_argument("--taskset-args", default="{}", help="JSON: further fields of the taskset's config")
    ap.add_argument("--harness", required=True, help="verifiers harness id (an importable module)")
    ap.add_argument("--harness-args", default="{}")
    ap.add_argument("--base-url", required=True, help="the shim, ending in /v1")
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer", required=True, help="a local tokenizer directory (the model's)")
    ap.add_argument("--renderer", default="qwen3", help="verifiers renderer name matching the model's chat format")
    ap.add_argument("--max-tasks", type=int, default=100_000)
    ap.add_argument("--max-concurrent", type=int, default=64, help="episodes in flight at once")
    args = ap.parse_args()
    os.environ.setdefault("TITAN_VF_KEY", "local")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # stdout carries the protocol alone: whatever a library prints goes to stderr
    proto, sys.stdout = sys.stdout, sys.stderr
    asyncio.run(_serve(args, proto))


if __name__ == "__main__":
    main()
