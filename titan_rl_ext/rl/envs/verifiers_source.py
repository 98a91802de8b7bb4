"""``verifiers`` environments as a rollout source: their episodes, run by ``verifiers_runner.py`` in the
Python that has ``verifiers`` 0.4 (its own virtualenv: it pins ``openai<3``, which vLLM's may not), with
every model call served by this process's generator client, so samples keep token ids, per-token
logprobs and per-token weight versions.

How tokens stay the generator's: verifiers' ``TrainClient`` renders each turn with the model's renderer
and bridges it onto the previous turn's sampled ids; it sends token ids to ``/inference/v1/generate``.
``GenerateShim`` serves that route on loopback over the ``Generator`` and records every call (prompt ids,
sampled ids, logprobs, versions) by verifiers' session id. A branch of a trace becomes a ``Sample`` only
if each of its sampled runs is a call the shim served on exactly the branch's tokens before it: then the
trainer's sequence is what the generator computed, token for token, and under batch invariance its
recompute is bit-equal. Where the renderer cannot bridge, verifiers re-renders the chat and the trace
forks into branches (each still checked, each a sample); ``VerifiersSource.stats`` counts them. A branch
that fails the check is refused with the place it differs, never trained on.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import os
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titan_rl_ext import settings
from titan_rl_ext.rl.generator_client import Generator
from titan_rl_ext.rl.samples import ENV_TOKEN_VERSION, Sample, SamplingConfig

logger = logging.getLogger(__name__)

PLUGINS_DIR = Path(__file__).resolve().parent / "verifiers_plugins"
RUNNER = Path(__file__).resolve().parent / "verifiers_runner.py"


def default_python() -> str:
    """The Python that runs verifiers: ``TITAN_VERIFIERS_PYTHON``, else the repo's ``.venv-verifiers`` (made by
    ``scripts/setup.sh``) when present, else this interpreter (verifiers installed alongside)."""
    if settings.VERIFIERS_PYTHON.is_set():
        return settings.VERIFIERS_PYTHON.get()
    repo_venv = Path(__file__).resolve().parents[3] / ".venv-verifiers" / "bin" / "python"
    return str(repo_venv) if repo_venv.exists() else sys.executable


@dataclass(slots=True)
class Call:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int | None]


class BranchMismatch(ValueError):
    """A verifiers branch whose tokens are not the generator's (re-tokenised): never trained on."""


class GenerateShim:
    """``POST /inference/v1/generate`` and ``GET /v1/models`` (what verifiers' ``TrainClient`` calls) over a
    ``Generator``, bound to 127.0.0.1 on a free port. ``calls[session]``: every call it served, in order."""

    def __init__(self, generator: Generator, model: str, max_model_len: int | None = None) -> None:
        self.generator, self.model, self.max_model_len = generator, model, max_model_len
        self.calls: dict[str, list[Call]] = {}
        self._runner: Any = None
        self.base_url = ""

    async def start(self) -> str:
        from aiohttp import web

        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/inference/v1/generate", self._generate)
        app.router.add_post("/inference/v1/generate", self._generate)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        return self.base_url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        card: dict[str, Any] = {"id": self.model, "object": "model"}
        if self.max_model_len:
            card["max_model_len"] = self.max_model_len
        return web.json_response({"object": "list", "data": [card]})

    async def _generate(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.json()
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            return web.json_response({"error": {"message": "token_ids must be a non-empty list of ints"}}, status=400)
        sp = dict(body.get("sampling_params") or {})
        extra = {k: sp[k] for k in ("stop_token_ids", "top_k", "min_p", "repetition_penalty", "ignore_eos") if sp.get(k) is not None}
        sampling = SamplingConfig(temperature=float(sp.get("temperature") if sp.get("temperature") is not None else 1.0),
                                  top_p=float(sp.get("top_p") if sp.get("top_p") is not None else 1.0),
                                  max_tokens=int(sp.get("max_tokens") or 256), extra=extra)
        try:
            gen = await self.generator.generate(ids, sampling)
        except Exception as e:  # noqa: BLE001 -- the client sees the generator's failure as a 502, with why
            return web.json_response({"error": {"message": f"generator: {e}"}}, status=502)
        session = request.headers.get("X-Session-ID", "")
        self.calls.setdefault(session, []).append(Call(list(ids), list(gen.token_ids), list(gen.logprobs), list(gen.versions)))
        content = [{"token": f"token_id:{t}", "logprob": lp, "top_logprobs": []} for t, lp in zip(gen.token_ids, gen.logprobs)]
        return web.json_response({
            "request_id": uuid.uuid4().hex, "prompt_token_ids": ids,
            "choices": [{"index": 0, "token_ids": list(gen.token_ids), "finish_reason": gen.finish_reason or "stop",
                         "logprobs": {"content": content}}],
        })


def branch_sample(branch: dict[str, Any], calls: list[Call], reward: float, group_id: int, num_turns: int) -> Sample:
    """One verifiers branch as a ``Sample``, every sampled run matched to the call that produced it on the
    same preceding tokens (``BranchMismatch`` otherwise)."""
    ids, mask = list(branch["token_ids"]), list(branch["sampled_mask"])
    if not any(mask):
        raise BranchMismatch("the branch has no sampled token")
    start = mask.index(True)
    lps: list[float] = [math.nan] * len(ids)
    versions: list[int] = [ENV_TOKEN_VERSION] * len(ids)
    i = start
    while i < len(ids):
        if not mask[i]:
            i += 1
            continue
        j = i
        while j < len(ids) and mask[j]:
            j += 1
        call = next((c for c in calls if len(c.prompt_ids) == i and c.prompt_ids == ids[:i]
                     and c.token_ids[: j - i] == ids[i:j]), None)
        if call is None:
            near = [len(c.prompt_ids) for c in calls]
            raise BranchMismatch(f"sampled tokens {i}..{j} follow a context no generator call had "
                                 f"(calls' prompt lengths {near}): the turn was re-tokenised")
        lps[i:j] = call.logprobs[: j - i]
        versions[i:j] = [int(v) if v is not None else 0 for v in call.versions[: j - i]]
        i = j
    return Sample(prompt_ids=ids[:start], completion_ids=ids[start:], gen_logprobs=lps[start:],
                  token_versions=versions[start:], loss_mask=mask[start:], reward=reward, finish_reason=None,
                  group_id=group_id, num_turns=num_turns)


@dataclass
class VerifiersStats:
    episodes: int = 0
    traces: int = 0
    forked_traces: int = 0
    """Traces verifiers split into several branches (the renderer could not bridge a turn: re-rendered)."""
    refused_branches: int = 0
    failed_episodes: int = 0
    errors: list[str] = field(default_factory=list)


class VerifiersSource:
    """A long-lived ``verifiers_runner.py`` subprocess plus the shim. ``await source.group(task, G,
    sampling, group_id)`` runs G episodes of task ``task`` and returns their samples (one per branch)."""

    def __init__(self, generator: Generator, *, taskset: str, harness: str = "titan_chat", model: str,
                 tokenizer_dir: str, renderer: str = "qwen3", python: str | None = None,
                 taskset_args: dict[str, Any] | None = None, harness_args: dict[str, Any] | None = None,
                 max_model_len: int | None = None, max_concurrent: int = 64, start_timeout_s: float = 120.0) -> None:
        self.shim = GenerateShim(generator, model, max_model_len)
        self.python = python or default_python()
        self.args = dict(taskset=taskset, harness=harness, model=model, tokenizer=tokenizer_dir, renderer=renderer,
                         taskset_args=json.dumps(taskset_args or {}), harness_args=json.dumps(harness_args or {}),
                         max_concurrent=str(max_concurrent))
        self.start_timeout_s = start_timeout_s
        self.num_tasks = 0
        self.stats = VerifiersStats()
        self._proc: asyncio.subprocess.Process | None = None
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count()
        self._reader: asyncio.Task[None] | None = None
        self._stderr_tail: list[str] = []

    async def __aenter__(self) -> VerifiersSource:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        base = await self.shim.start()
        cmd = [self.python, str(RUNNER), "--base-url", base]
        for k, v in self.args.items():
            cmd += [f"--{k.replace('_', '-')}", v]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(PLUGINS_DIR), os.environ.get("PYTHONPATH", "")) if p),
               "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self._proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                          stderr=asyncio.subprocess.PIPE, env=env, limit=256 << 20)
        asyncio.get_running_loop().create_task(self._drain_stderr())
        try:
            first = await asyncio.wait_for(self._proc.stdout.readline(), self.start_timeout_s)  # type: ignore[union-attr]
        except asyncio.TimeoutError:
            await self.close()
            raise RuntimeError(f"the verifiers runner did not start in {self.start_timeout_s:.0f} s") from None
        ready = json.loads(first) if first.strip() else {}
        if not ready.get("ready"):
            await asyncio.sleep(0.2)
            await self.close()
            raise RuntimeError(f"the verifiers runner ({self.python}) failed to start:\n" + "".join(self._stderr_tail[-40:]))
        self.num_tasks = int(ready["num_tasks"])
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _drain_stderr(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        while line := await self._proc.stderr.readline():
            self._stderr_tail = (self._stderr_tail + [line.decode(errors="replace")])[-200:]

    async def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        while line := await self._proc.stdout.readline():
            msg = json.loads(line)
            fut = self._waiting.pop(msg.get("id"), None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        why = "the verifiers runner exited:\n" + "".join(self._stderr_tail[-40:])
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(RuntimeError(why))
        self._waiting.clear()

    def metrics(self) -> dict[str, float]:
        """Running totals, logged with the rollout metrics (``tasks.base.RolloutSource``)."""
        st = self.stats
        return {"verifiers/episodes_total": st.episodes, "verifiers/failed_episodes_total": st.failed_episodes,
                "verifiers/forked_traces_total": st.forked_traces, "verifiers/refused_branches_total": st.refused_branches}

    async def close(self) -> None:
        if self._proc is not None:
            if self._proc.stdin is not None and not self._proc.stdin.is_closing():
                self._proc.stdin.close()
            try:
                await asyncio.wait_for(self._proc.wait(), 20)
            except asyncio.TimeoutError:
                self._proc.kill()
                await self._proc.wait()
            self._proc = None
        if self._reader is not None:
            await self._reader
            self._reader = None
        await self.shim.close()

    async def group(self, task: int, G: int, sampling: SamplingConfig, group_id: int) -> list[Sample]:
        """G episodes of task ``task`` (modulo the taskset's size) as samples; every branch checked."""
        if self._proc is None or self._proc.stdin is None:
            raise RuntimeError("VerifiersSource.start() first")
        rid = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        req = {"id": rid, "task": task, "n": G,
               "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p, "max_tokens": sampling.max_tokens}}
        self._proc.stdin.write((json.dumps(req) + "\n").encode())
        await self._proc.stdin.drain()
        msg = await fut
        if "error" in msg:
            raise RuntimeError(f"verifiers episode failed: {msg['error']}")
        samples: list[Sample] = []
        for ep in msg["episodes"]:
            self.stats.episodes += 1
            if not ep["ok"]:
                self.stats.failed_episodes += 1
                self.stats.errors += ep["errors"][:2]
                # why it failed: verifiers keeps it on the episode or on the trace that stopped it
                why = ep["errors"][:2] + [e for tr in ep["traces"] for e in tr["errors"][:2]]
                logger.warning("verifiers episode %d of task %d failed: %s", self.stats.failed_episodes, task,
                               " | ".join(why)[:2000] or "no error recorded")
            for tr in ep["traces"]:
                self.stats.traces += 1
                self.stats.errors += tr["errors"][:2]
                self.stats.forked_traces += len(tr["branches"]) > 1
                calls = self.shim.calls.pop(tr["trace_id"], [])
                for br in tr["branches"]:
                    try:
                        samples.append(branch_sample(br, calls, tr["reward"], group_id, tr["num_turns"]))
                    except BranchMismatch as e:
                        self.stats.refused_branches += 1
                        self.stats.errors.append(str(e))
        return samples
