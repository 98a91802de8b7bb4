"""Reliability and security of serving and weight swaps (issue 7).

What ``test_weight_swap.py`` does not cover yet, against one real OpenAI API server
(``--model-impl titan``, tiny Qwen3.5, fp32, prefix caching, batch invariant, ``TITAN_SWAP_TOKEN`` set):

- pushers killed (SIGKILL) in the middle of a push, and once right after the whole body: the weights,
  the version, the staging files in /dev/shm, the server's connections and its memory afterwards;
- 64 concurrent completions (kept at 64 until the last swap has landed; most streamed, some answered whole,
  some with two choices) while 6 swaps land (``recompute`` and ``keep``); the per-token versions come from
  the plugin's own token counts (``swap.ledger``), not vLLM's output stamps, which vLLM 0.26 lacks:
  nothing lost, every chunk tagged, versions monotone per request, and every
  token of 64 replayed requests has exactly the logprob the trainer's model gives when it replays the
  request as the engine ran it (BI): recomputed with the new weights after ``recompute``, continuing on
  the old weights' KV/GDN state after ``keep``;
- malformed / hostile requests to the OpenAI routes and to the push route: a 4xx naming the problem,
  the engine stays up and answers exactly as before.

The tests share the server; each one starts by pushing a known state instead of assuming one. Counts of
the inputs tried are printed (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import collections
import glob
import json
import multiprocessing
import os
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from servers import openai_server, server_env
from titan_rl_ext.rl.weight_sync import WeightPusher, checksum, serialize

pytestmark = pytest.mark.slow

TOKEN = "titan-reliability-token-9d41e7"  # checked to never appear in the server log
ROUTE = "/titan/v1/weights"
VERSION_FIELD = "titan_weight_version"
SPANS_FIELD = "titan_weight_spans"
MAX_MODEL_LEN = 512
STAGING_PREFIX = "titan-weights-"  # tempfile prefix of the server's push staging files

# the inputs tried, by kind (printed at the end of the tests that try them)
TRIED: collections.Counter[str] = collections.Counter()


@dataclass
class Server:
    base: str
    port: int
    pid: int  # the API server process; the engine core is its child
    model: str
    log: Path
    pusher: WeightPusher
    reference: dict[str, torch.Tensor]  # the checkpoint's titan state dict (what the server starts with)
    trainer: Any  # a titan Decoder on the trainer side (weights loaded per check)


@pytest.fixture(scope="module")
def server(tiny_ckpt: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from titan_rl_ext.models.hf import load_hf_model

    model_dir = tiny_ckpt("qwen3_5", layout="vlm")
    log_path = tmp_path_factory.mktemp("reliability_server") / "server.log"
    env = server_env(TITAN_SWAP_TOKEN=TOKEN, TITAN_BATCH_INVARIANT="1")
    with openai_server(model_dir, log_path, MAX_MODEL_LEN, ["--enable-prefix-caching"], env) as srv:
        model, _ = load_hf_model(model_dir, dtype=torch.float32)  # while the server boots
        model.eval()
        ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
        srv.wait_ready()
        yield Server(srv.base, srv.port, srv.proc.pid, str(model_dir), log_path, WeightPusher([srv.base], TOKEN),
                     ref, model)


# -- helpers -----------------------------------------------------------------------------------------------
def _auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _version(s: Server) -> int:
    import requests

    return requests.get(f"{s.base}{ROUTE}/version", timeout=30).json()["version"]


def _push_raw(s: Server, body: bytes, version: int | str, headers: dict[str, str] | None = None, **kw: Any) -> Any:
    import requests

    return requests.post(f"{s.base}{ROUTE}", params={"version": str(version)}, data=body,
                         headers={**_auth(), **(headers or {})}, timeout=120, **kw)


def _greedy(s: Server, prompt: list[int], max_tokens: int = 16) -> tuple[list[int], list[float]]:
    import requests

    body = {"model": s.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_token_ids": True}
    r = requests.post(f"{s.base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert len(c["token_ids"]) == max_tokens
    return c["token_ids"], c["logprobs"]["token_logprobs"]


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def _scaled(ref: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    """The k-th weight version of a test: every tensor scaled by 1 + k/100 (k = 0: the checkpoint)."""
    return {n: t * (1 + 0.01 * k) for n, t in ref.items()}


def _reset(s: Server) -> int:
    """Push the checkpoint's weights as a new version (tests share the server); returns that version."""
    v = _version(s) + 1
    s.pusher.push(s.reference, v)
    assert s.pusher.checksums() == checksum(s.reference)
    return v


def _wait_for(cond: Callable[[], Any], what: str, timeout_s: float = 60.0, every_s: float = 0.005) -> Any:
    """Poll ``cond`` until it returns something truthy (returned); fail naming ``what`` after the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(every_s)


# -- process inspection (/proc, psutil: a vLLM dependency) -------------------------------------------------
def _server_procs(pid: int) -> list[Any]:
    import psutil

    p = psutil.Process(pid)
    return [p, *p.children(recursive=True)]


def _rss(pid: int) -> int:
    """Resident memory of the API server and all its children (engine core), bytes."""
    import psutil

    total = 0
    for p in _server_procs(pid):
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def _staging_fds(pid: int) -> list[tuple[str, int]]:
    """(path, current size) of every push staging file the server processes hold open (deleted or not)."""
    out = []
    for p in _server_procs(pid):
        fd_dir = f"/proc/{p.pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
                if STAGING_PREFIX in target:
                    out.append((target, os.stat(f"{fd_dir}/{fd}").st_size))
            except OSError:  # closed meanwhile
                continue
    return out


def _staging_files() -> dict[str, int]:
    """Staging files on disk where the server puts them (/dev/shm, else the temp dir): path -> bytes."""
    out = {}
    for d in {"/dev/shm", tempfile.gettempdir()}:
        for path in glob.glob(os.path.join(d, f"{STAGING_PREFIX}*")):
            try:
                out[path] = os.path.getsize(path)
            except OSError:
                continue
    return out


def _server_conns_from(pid: int, server_port: int, client_port: int) -> list[str]:
    """TCP states of server-side sockets still open for a client's connection (CLOSE_WAIT = never closed)."""
    out = []
    for p in _server_procs(pid):
        try:
            conns = p.net_connections(kind="tcp")
        except Exception:  # noqa: BLE001 - gone meanwhile
            continue
        out += [c.status for c in conns if c.laddr and c.raddr and c.laddr.port == server_port
                and c.raddr.port == client_port]
    return out


# -- 1. pushers killed mid-push ----------------------------------------------------------------------------
# A separate process: headers with the right Content-Length, the first `cut` bytes of the body, then it
# reports its local port and blocks until the test kills it. The token travels in the environment.
_PUSHER = r"""
import os, socket, sys
host, port, path, version, cut = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
body = open(path, "rb").read()
s = socket.create_connection((host, port))
head = (f"POST /titan/v1/weights?version={version}&mode=keep HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Authorization: Bearer {os.environ['PUSH_TOKEN']}\r\nContent-Type: application/octet-stream\r\n"
        f"Content-Length: {len(body)}\r\n\r\n").encode()
s.sendall(head + body[:cut])
print(s.getsockname()[1], flush=True)
sys.stdin.read()  # killed here
"""
# fractions of the body sent before the kill: about half (3x), the first byte, all but the last byte
FAULT_CUTS = (0.5, 0.5, 0.5, 1e-9, 1.0 - 1e-9)


def _start_pusher(s: Server, payload: Path, version: int, cut: int) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", _PUSHER, "127.0.0.1", str(s.port), str(payload), str(version),
                             str(cut)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PUSH_TOKEN": TOKEN})
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line.strip().isdigit(), f"pusher failed: {line!r}"
    return proc, int(line)


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


def _tagged(sd: dict[str, torch.Tensor], nonce: str) -> bytes:
    """A valid payload whose header carries ``nonce`` (safetensors metadata): its staging file is ours."""
    from safetensors.torch import save

    return save({n: t.detach().contiguous().clone() for n, t in sd.items()}, metadata={"reliability_test": nonce})


def _ours(nonce: str) -> dict[str, int]:
    """Staging files on disk holding one of our payloads (the nonce is in the first bytes): path -> bytes."""
    out = {}
    for path, size in _staging_files().items():
        try:
            with open(path, "rb") as f:
                if nonce.encode() in f.read(1 << 16):
                    out[path] = size
        except OSError:
            continue
    return out


def test_pushers_killed_mid_push_leave_no_trace(server: Server, tmp_path: Path) -> None:
    import uuid

    import requests

    v = _reset(server)
    old_sums = checksum(server.reference)
    probe = [5, 17, 99, 3, 250, 42]
    before_gen = _greedy(server, probe)
    nonce = uuid.uuid4().hex
    new, newer = _scaled(server.reference, 3), _scaled(server.reference, 4)
    payload = _tagged(new, nonce)
    (tmp_path / "new.safetensors").write_bytes(payload)
    (tmp_path / "newer.safetensors").write_bytes(_tagged(newer, nonce))
    # the push of _reset and the completion above brought the allocators to their steady state
    rss_before = _rss(server.pid)

    staged: list[str] = []
    faults_log_from = len(server.log.read_bytes())
    for frac in FAULT_CUTS:
        cut = max(1, min(len(payload) - 1, round(frac * len(payload))))
        proc, client_port = _start_pusher(server, tmp_path / "new.safetensors", v + 1, cut)
        try:
            # mid-push: the server holds a staging file with the bytes sent (less one write buffer at most)
            fds = _wait_for(lambda: [(p, n) for p, n in _staging_fds(server.pid) if n >= cut - 65536],
                            "the server to stage the partial body")
        finally:
            _kill(proc)
        assert len(fds) == 1, fds
        path = fds[0][0].removesuffix(" (deleted)")
        staged.append(path)
        _wait_for(lambda: not _staging_fds(server.pid) and not os.path.exists(path),
                  "the staging file to be closed and removed")
        _wait_for(lambda: not _server_conns_from(server.pid, server.port, client_port),
                  "the server to close the dead pusher's connection")

    # each abort is one warning line naming the cause, not an error with a traceback
    fault_log = server.log.read_bytes()[faults_log_from:].decode(errors="replace")
    assert fault_log.count(f"titan weight push v{v + 1} rejected: the client disconnected") == len(FAULT_CUTS), fault_log[-3000:]
    assert "Traceback" not in fault_log, fault_log[-3000:]

    # nothing changed, still serving, and the version the dead pushers used is still free
    assert _version(server) == v
    assert server.pusher.checksums() == old_sums
    assert _greedy(server, probe) == before_gen
    (res,) = server.pusher.push(new, v + 1)
    assert res["version"] == v + 1 == _version(server)
    assert server.pusher.checksums() == checksum(new)
    assert _greedy(server, probe)[1] != before_gen[1]  # the new weights are live

    # killed right after the whole body was sent: the push is applied entirely or not at all
    log_from = len(server.log.read_bytes())
    proc, client_port = _start_pusher(server, tmp_path / "newer.safetensors", v + 2, len(payload))
    _kill(proc)
    outcome = _wait_for(lambda: _push_outcome(server, log_from, v + 2), "the server to finish the orphaned push")
    _wait_for(lambda: not _staging_fds(server.pid), "the staging file to be closed")
    now = _version(server)
    assert (now, server.pusher.checksums()) in ((v + 1, checksum(new)), (v + 2, checksum(newer))), (now, outcome)
    assert (now == v + 2) == (outcome == "swapped"), (now, outcome)
    _wait_for(lambda: not _server_conns_from(server.pid, server.port, client_port),
              "the server to close the dead pusher's connection")

    # nothing left behind: no staging file of ours on disk or open, memory back to where it was
    leftover = {**{p: os.path.getsize(p) for p in staged if os.path.exists(p)}, **_ours(nonce)}
    assert not _staging_fds(server.pid)
    _greedy(server, probe)  # the same requests as before the first measurement
    rss_after = _rss(server.pid)
    # Bound max(64 MiB, 2 x payload): the RSS of the two CPython + torch processes (~3 GiB, the KV cache
    # included) moves by a few MiB between identical requests (allocator arenas and caches, code paths
    # first run by the error handling), so a tight bound would be flaky; for a real model, 2 x payload
    # is one retained copy of the body plus its read buffer. With this 1 MB payload the bound only
    # catches gross growth; the bodies themselves are accounted for exactly by the file and fd checks.
    bound = max(64 << 20, 2 * len(payload))
    TRIED["push: killed pusher (mid-body)"] += len(FAULT_CUTS)
    TRIED["push: killed pusher (after the whole body)"] += 1
    print(f"\nkilled pushers: {len(FAULT_CUTS)} mid-body (cut at {[round(f, 3) for f in FAULT_CUTS]} of "
          f"{len(payload)} B) + 1 after the whole body ({outcome}, version now {now}); staging files seen "
          f"{len(staged)}, left behind {len(leftover)} ({sum(leftover.values())} B); server RSS before "
          f"{rss_before / 2**20:.1f} MiB, after {rss_after / 2**20:.1f} MiB (delta "
          f"{(rss_after - rss_before) / 2**20:+.2f} MiB, bound {bound / 2**20:.0f} MiB)")
    assert not leftover, leftover
    assert rss_after - rss_before <= bound, (rss_before, rss_after)
    assert TOKEN not in server.log.read_text()  # not even in the tracebacks of the failed pushes
    assert requests.get(f"{server.base}/health", timeout=30).status_code == 200


def _push_outcome(s: Server, log_from: int, version: int) -> str | None:
    """How the server ended a push, from the lines it logged after byte ``log_from`` of its log."""
    text = s.log.read_bytes()[log_from:].decode(errors="replace")
    if f"titan weights v{version} swapped" in text:
        return "swapped"
    return next((o for o in ("rejected", "failed") if f"titan weight push v{version} {o}" in text), None)


# -- 2. load: 64 streams across 6 swaps --------------------------------------------------------------------
LOAD_REQUESTS = 64
# The shortest stream; request i asks for LOAD_TOKENS + _extra_tokens(i). A stream must outlive a push's
# latency (up to ~12 s on a loaded 2-core CI machine) for the swap to land inside it.
LOAD_TOKENS = 256
SWAP_MODES = ("recompute", "keep", "recompute", "keep", "recompute", "recompute")
TOKENS_BETWEEN_SWAPS = 6  # per request on average, tagged with the current version, before the next swap
# A swap the server reports as landing with no request in flight (on a loaded machine the API server can
# fall so far behind the engine that every stream the engine holds has ended before the client starts the
# next ones) changed no sample's history; its mode is pushed again, up to this many extra times in all.
IDLE_SWAP_RETRIES = 4
SPOT_CHECK = LOAD_REQUESTS  # requests recomputed by the trainer (~3 s)


def _push_from_child(pusher: WeightPusher, payload: bytes, version: int, mode: str) -> list[dict[str, Any]]:
    """Runs in a child process, so the push does not wait for this process's GIL behind the SSE parsing
    of the streams."""
    return pusher.push_payload(payload, version, mode)


def _child_ready() -> int:
    return os.getpid()


def _replay_request(model: Any, weights: dict[int, dict[str, torch.Tensor]], modes: dict[int, str],
                    prompt: list[int], tokens: list[int], versions: list[int]) -> tuple[list[float], list[bool]]:
    """The logprob of each sampled token as the engine computed it, replayed with the titan inference-state
    path (call under BI): the step that sampled token ``t`` ran on the weights of version ``versions[t]``
    and processed position ``len(prompt) + t - 1``. A "recompute" swap since the previous token means the
    engine recomputed the whole context with the new weights in that step; after a "keep" swap it went on
    with the KV/GDN state computed by the old weights. Runs of tokens of one version are one chunk (BI:
    a chunk equals its tokens one at a time). Also returns, per token, whether its context mixes versions."""
    from titan_rl_ext.models.common.batch import SeqBatch
    from titan_rl_ext.rl.logprobs import logprobs_from_logits

    x, n_prompt, n = prompt + tokens, len(prompt), len(tokens)
    out: list[float] = []
    mixed: list[bool] = []
    states, done, context_versions = None, 0, set()
    t = 0
    while t < n:
        v = versions[t]
        u = t
        while u + 1 < n and versions[u + 1] == v:
            u += 1
        if t == 0 or any(modes.get(w) == "recompute" for w in range(versions[t - 1] + 1, v + 1)):
            states, done, context_versions = model.init_states(1), 0, set()
        model.load_state_dict(weights[v])
        context_versions.add(v)
        end = n_prompt + u  # positions done..end-1 now; position n_prompt + k - 1 predicts token k
        batch = SeqBatch.from_lengths([end - done], start_positions=[done])
        h, states = model.hidden(torch.tensor(x[done:end]), batch, states)
        lp = logprobs_from_logits(model.logits(h, fp32=True))
        for k in range(t, u + 1):
            out.append(lp[n_prompt + k - 1 - done, tokens[k]].item())
            mixed.append(len(context_versions) > 1)
        done, t = end, u + 1
    return out, mixed


@dataclass
class Stream:
    prompt: list[int]
    status: int
    chunks: list[dict[str, Any]]
    done: bool  # [DONE] received
    error: str = ""
    max_tokens: int = 0
    streamed: bool = True
    n: int = 1  # choices


def _extra_tokens(i: int) -> int:
    # Staggered lengths: streams started together must not all end together, or a swap can land in the
    # gap between one wave of streams and the next, straddled by none.
    return (i * 37) % 64


def _kind(i: int) -> tuple[bool, int]:
    """(streamed, n) of load request ``i``: most stream one choice; every 8th is answered whole (its spans
    come in the JSON body), and every 8th, shifted, streams two choices (``n=2``: two engine requests)."""
    return (i % 8 != 5), (2 if i % 8 == 2 else 1)


async def _stream_one(s: Server, client: Any, prompt: list[int], max_tokens: int,
                      on_chunk: Callable[[int, bool, int], None], streamed: bool = True, n: int = 1) -> Stream:
    from titan_rl_ext.rl.sse import parse_sse_line, sse_lines

    body = {"model": s.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True,
            "stream": streamed, "n": n, "logprobs": 0, "return_tokens_as_token_ids": True, "return_token_ids": True}
    out = Stream(prompt, 0, [], False, max_tokens=max_tokens, streamed=streamed, n=n)
    try:
        if not streamed:  # one JSON body: counted as started now, its tokens when it ends
            on_chunk(0, True, -1)
            r = await client.post(f"{s.base}/v1/completions", json=body)
            out.status = r.status_code
            if r.status_code != 200:
                out.error = r.text[:2000]
                return out
            item = r.json()
            out.chunks.append(item)
            out.done = True
            on_chunk(sum(len(c.get("token_ids") or ()) for c in item.get("choices") or ()), False, -1)
            return out
        async with client.stream("POST", f"{s.base}/v1/completions", json=body) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = (await r.aread()).decode(errors="replace")[:2000]
                return out
            async for line in sse_lines(r.aiter_bytes()):
                item = parse_sse_line(line)
                if item is None:
                    continue
                if not isinstance(item, dict):  # the terminator
                    out.done = True
                    break
                out.chunks.append(item)
                k = sum(len(c.get("token_ids") or ()) for c in item.get("choices") or ())
                on_chunk(k, len(out.chunks) == 1, item.get(VERSION_FIELD, -1))
    except Exception as e:  # noqa: BLE001 - reported by the test
        out.error = f"{type(e).__name__}: {e}"
    return out


def test_streams_survive_swaps_under_load(server: Server) -> None:
    import httpx

    from titan_rl_ext.kernels.batch_invariant import batch_invariant
    from titan_rl_ext.models.common.batch import SeqBatch
    from titan_rl_ext.rl.logprobs import token_logprobs
    from titan_rl_ext.rl.rollout import StreamAccumulator

    v0 = _reset(server)
    weights = {v0: server.reference}
    modes: dict[int, str] = {}
    progress = {"started": 0, "tokens": 0, "finished": 0}
    cond = threading.Condition()
    swaps_done = threading.Event()
    swap_errors: list[BaseException] = []
    swap_results: list[dict[str, Any]] = []
    in_flight: dict[int, int] = {}  # version -> requests holding tokens when it landed (the server's count)

    tokens_of: collections.Counter[int] = collections.Counter()  # version -> tokens received with that tag

    def on_chunk(n_tokens: int, first: bool, version: int) -> None:
        with cond:
            progress["tokens"] += n_tokens
            tokens_of[version] += n_tokens
            progress["started"] += first
            cond.notify_all()

    def swapper() -> None:
        try:
            with cond:  # every request is streaming before the first swap (or some failed: reported below)
                cond.wait_for(lambda: LOAD_REQUESTS in (progress["started"], progress["finished"]), timeout=300)
            v, retries = v0, IDLE_SWAP_RETRIES
            for mode in SWAP_MODES:
                while True:
                    with cond:  # counted by tag: on a busy machine the clients read tokens of older versions late
                        cond.wait_for(lambda: tokens_of[v] >= LOAD_REQUESTS * TOKENS_BETWEEN_SWAPS, timeout=120)
                    v += 1
                    sd = _scaled(server.reference, v - v0)
                    weights[v], modes[v] = sd, mode
                    got = pusher.submit(_push_from_child, server.pusher, serialize(sd), v, mode).result()
                    swap_results.extend(got)
                    in_flight[v] = got[0]["in_flight"]
                    if in_flight[v] or not retries:
                        break
                    retries -= 1
        except BaseException as e:  # noqa: BLE001 - surfaced below
            swap_errors.append(e)
        finally:
            swaps_done.set()

    async def one(client: Any, prompt: list[int], max_tokens: int, streamed: bool, n: int) -> Stream:
        st = await _stream_one(server, client, prompt, max_tokens, on_chunk, streamed, n)
        with cond:
            progress["finished"] += 1
            cond.notify_all()
        return st

    async def run_all() -> list[Stream]:
        """LOAD_REQUESTS streams at all times until the last swap has landed: a finished stream is replaced
        by a new one. On a loaded 2-core machine a push can reach the endpoint seconds after it was sent
        (the API server is busy streaming), so a fixed set of streams could end before the last swap."""
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=LOAD_REQUESTS)
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=30.0), limits=limits) as client:
            tasks: list[asyncio.Task[Stream]] = []

            def launch() -> None:
                i = len(tasks)
                tasks.append(asyncio.create_task(one(client, _prompt(8 + i % 17, seed=1000 + i),
                                                     LOAD_TOKENS + _extra_tokens(i), *_kind(i))))

            for _ in range(LOAD_REQUESTS):
                launch()
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if not swaps_done.is_set():
                    for _ in done:
                        launch()
                        pending.add(tasks[-1])
            return [t.result() for t in tasks]

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pusher:
        pusher.submit(_child_ready).result()  # the child has imported this module before the load starts
        th = threading.Thread(target=swapper)
        t0 = time.perf_counter()
        th.start()
        streams = asyncio.run(run_all())
        th.join(timeout=300)
        gen_s = time.perf_counter() - t0
    assert not swap_errors, swap_errors
    final = v0 + len(swap_results)
    assert len(swap_results) >= len(SWAP_MODES) and _version(server) == final and sorted(in_flight) == list(range(v0 + 1, final + 1))

    # nothing failed or got lost; every chunk is tagged; versions only move forward
    failed = [(i, st.status, st.error) for i, st in enumerate(streams) if st.status != 200 or st.error or not st.done]
    assert not failed, failed[:5]
    gens, prompts, kinds = [], [], []  # one entry per choice
    chunk_tags = chunk_tag_errors = 0
    for st in streams:
        last = [ch for c in st.chunks for ch in c.get("choices") or () if ch.get("finish_reason") is not None]
        # the engine core's counts, not the API server's clock: the versions come as spans with each last chunk
        assert len(last) == st.n and all(isinstance(ch.get(SPANS_FIELD), list) for ch in last), last
        acc = StreamAccumulator()
        for c in st.chunks:
            acc.feed(c)  # raises on an in-stream error event, and on spans that do not tile the tokens
        choices = acc.results()
        assert len(choices) == st.n
        if st.streamed:
            assert all(VERSION_FIELD in c for c in st.chunks), [c for c in st.chunks if VERSION_FIELD not in c][:2]
            sent = [0] * st.n  # each chunk's tag is its last token's version, as the spans give it
            for c in st.chunks:
                expect = None
                for ch in c.get("choices") or ():
                    k = int(ch.get("index", 0))
                    sent[k] += len(ch.get("token_ids") or ())
                    if ch.get("token_ids"):
                        expect = choices[k].versions[sent[k] - 1]
                if expect is not None:
                    chunk_tags += 1
                    chunk_tag_errors += c[VERSION_FIELD] != expect
        for g in choices:
            assert len(g.token_ids) == st.max_tokens and g.finish_reason == "length", (len(g.token_ids), g.finish_reason)
            assert all(a <= b for a, b in zip(g.versions, g.versions[1:])), g.versions
            assert set(g.versions) <= set(weights), set(g.versions)
            gens.append(g)
            prompts.append(st.prompt)
            kinds.append("whole" if not st.streamed else f"n={st.n}")
    straddling = [g for g in gens if len(set(g.versions)) > 1]
    assert straddling, "no request straddled a swap"
    late = sorted(set(range(v0, final + 1)) - {v for g in gens for v in g.versions})
    assert not late, f"versions {late} produced no token: those swaps landed after every stream had ended"
    # Spot check: replay requests with the trainer's model (BI, inference-state path) exactly as the engine
    # computed them, and compare every token's logprob bit for bit. The requests straddling each swap come
    # first, then those that saw the most versions.
    spot: list[int] = []
    for v in range(v0 + 1, final + 1):
        spot += [i for i, g in enumerate(gens) if g.versions[0] < v <= g.versions[-1] and i not in spot][:1]
    for kind in ("whole", "n=2"):  # a straddling choice of a non-streamed request, and of a two-choice stream
        spot += [i for i, g in enumerate(gens) if kinds[i] == kind and len(set(g.versions)) > 1 and i not in spot][:2]
    by_versions = sorted(range(len(gens)), key=lambda i: (-len(set(gens[i].versions)), i))
    spot += [i for i in by_versions if i not in spot][:SPOT_CHECK - len(spot)]
    t1 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # next to a busy server, 2 OpenMP threads on these 2 cores crawl
    try:
        with torch.no_grad(), batch_invariant():
            replayed = {i: _replay_request(server.trainer, weights, modes, prompts[i], gens[i].token_ids,
                                           gens[i].versions) for i in spot}
            # what the final weights alone give: a token tagged with a wrong version would show
            server.trainer.load_state_dict(weights[final])
            final_lp = {}
            for k in range(0, len(spot), 4):
                group = spot[k:k + 4]
                seqs = [prompts[i] + gens[i].token_ids for i in group]
                batch = SeqBatch.from_lengths([len(x) for x in seqs])
                lp_T = token_logprobs(server.trainer, torch.tensor([t for x in seqs for t in x]), batch)
                for i, e in zip(group, batch.cu_seqlens[1:].tolist()):
                    final_lp[i] = lp_T[e - len(gens[i].token_ids):e].tolist()
    finally:
        torch.set_num_threads(threads)
    check_s = time.perf_counter() - t1
    checked = after_swap = on_mixed_kv = compared = distinguishable = 0
    straddled = collections.Counter()  # swap version -> checked tokens after it, in requests started before it
    mismatches = []
    for i in spot:
        g, (ours, mixed) = gens[i], replayed[i]
        for t, (tag, lp) in enumerate(zip(g.versions, g.logprobs)):
            checked += 1
            after_swap += tag != g.versions[0]
            on_mixed_kv += mixed[t]
            for v in range(g.versions[0] + 1, tag + 1):
                straddled[v] += 1
            if tag != final:
                compared += 1
                distinguishable += final_lp[i][t] != ours[t]
            if lp != ours[t]:
                mismatches.append((i, t, tag - v0, lp, ours[t]))
    n_spot = sum(len(gens[i].token_ids) for i in spot)
    per_version = collections.Counter(v - v0 for g in gens for v in g.versions)
    print(f"\nload: {len(streams)} streams x {LOAD_TOKENS}..{LOAD_TOKENS + 63} tokens, {LOAD_REQUESTS} at all times, {final - v0} swaps "
          f"{[modes[v] for v in range(v0 + 1, final + 1)]} in {gen_s:.1f} s, requests in flight at each "
          f"{[in_flight[v] for v in range(v0 + 1, final + 1)]}; straddling requests {len(straddling)}, versions per request "
          f"{min(len(set(g.versions)) for g in gens)}..{max(len(set(g.versions)) for g in gens)}, tokens per "
          f"version {dict(sorted(per_version.items()))}; swap pauses "
          f"{[round(r['swap_seconds'] * 1e3) for r in swap_results]} ms; exact replay of {len(spot)} requests: "
          f"{checked}/{n_spot} tokens checked ({after_swap} after a swap inside their request, {on_mixed_kv} on KV "
          f"of several versions after a 'keep' swap), "
          f"{len(mismatches)} mismatches (tokens whose tag is not the version that produced them), "
          f"{distinguishable}/{compared} differ under the final version; chunk tags {chunk_tags}, "
          f"{chunk_tag_errors} disagree with the spans; checked choices by kind "
          f"{dict(collections.Counter(kinds[i] for i in spot))}; trainer check {check_s:.1f} s")
    assert checked == n_spot
    # every swap that landed with requests in flight is checked across, and both modes were
    crossed = [v for v in range(v0 + 1, final + 1) if in_flight[v]]
    assert all(straddled[v] for v in crossed), (straddled, in_flight)
    assert {modes[v] for v in crossed} == set(SWAP_MODES), (modes, in_flight)
    assert on_mixed_kv > 0  # "keep" swaps really continued on the old weights' KV, token for token
    assert compared and distinguishable > 0.9 * compared  # a mistagged token would show
    assert not mismatches, mismatches[:5]
    assert chunk_tags and not chunk_tag_errors
    for kind in ("whole", "n=2"):  # the spans hold for non-streamed answers and for each of n choices too
        assert any(kinds[i] == kind and len(set(gens[i].versions)) > 1 for i in spot), f"no {kind} choice straddled a swap"


# -- 3a. bad requests to the OpenAI routes -----------------------------------------------------------------
_IMAGE = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQ"
          "AAAABJRU5ErkJggg==")


def _bad_openai_requests(model: str) -> list[tuple[str, str, Any, dict[str, str] | None, str]]:
    """(kind, path, JSON body or raw bytes, headers, text the error message must contain)."""
    comp = {"model": model, "prompt": [5, 6, 7], "max_tokens": 4}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    js = {"Content-Type": "application/json"}
    C, H = "/v1/completions", "/v1/chat/completions"

    def image_chat(url: str, **extra: Any) -> dict[str, Any]:
        content = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]
        return {**chat, "messages": [{"role": "user", "content": content}], **extra}

    return [
        ("malformed JSON", C, b'{"model": "m", "prompt": [1, 2', js, "JSON decode error"),
        ("malformed JSON", C, b"not json at all", js, "JSON decode error"),
        ("malformed JSON", C, b"\xff\xfe\x00\x01", js, "JSON decode error"),
        ("malformed JSON", H, b'{"model": "m", "messages": [}', js, "JSON decode error"),
        ("malformed JSON", C, b"", js, "Field required"),
        ("wrong types", C, {**comp, "max_tokens": "lots"}, None, "max_tokens"),
        ("wrong types", C, {**comp, "temperature": "hot"}, None, "temperature"),
        ("wrong types", C, {**comp, "prompt": 12345}, None, "prompt"),
        ("wrong types", C, {**comp, "prompt": [5.5, 6]}, None, "prompt"),
        ("wrong types", C, {**comp, "stream": "maybe"}, None, "stream"),
        ("wrong types", C, {**comp, "logprobs": "yes"}, None, "logprobs"),
        ("wrong types", C, [5, 6, 7], None, "dictionary"),
        ("wrong types", H, {**chat, "messages": "hello"}, None, "messages"),
        ("wrong types", C, b'{"model": "m", "prompt": [5]}', {"Content-Type": "text/plain"}, "Media Type"),
        ("token id >= vocab", C, {**comp, "prompt": [5, 6, 512]}, None, "Token id 512 is out of vocabulary"),
        ("token id >= vocab", C, {**comp, "prompt": [5, 6, 10**6]}, None, "out of vocabulary"),
        ("token id >= vocab", C, {**comp, "prompt": [[5, 6], [7, 600]]}, None, "Token id 600"),
        ("token id >= vocab", C, {**comp, "prompt": [5, -1]}, None, "greater than or equal to 0"),
        ("token id >= vocab", C, {**comp, "logit_bias": {"999999": 5}}, None, "logit_bias"),
        ("token id >= vocab", C, {**comp, "allowed_token_ids": [5, 99999]}, None, "allowed_token_ids"),
        ("token id >= vocab", C, {**comp, "stop_token_ids": [99999]}, None, "stop_token_ids"),
        ("enormous max_tokens", C, {**comp, "max_tokens": 10**9}, None, "max_tokens"),
        ("enormous max_tokens", C, {**comp, "max_tokens": 2**64 + 1}, None, "max_tokens"),
        ("negative max_tokens", C, {**comp, "max_tokens": -5}, None, "max_tokens"),
        ("enormous max_tokens", H, {**chat, "max_tokens": 10**9}, None, "max_tokens"),
        ("enormous max_tokens", H, {**chat, "max_completion_tokens": 10**9}, None, "max_completion_tokens"),
        ("enormous n / logprobs", C, {**comp, "n": 10**6}, None, "n must be at most"),
        ("enormous n / logprobs", C, {**comp, "logprobs": 10**6}, None, "logprobs"),
        ("prompt over max_model_len", C, {**comp, "prompt": [5] * (MAX_MODEL_LEN + 10)}, None,
         "maximum context length"),
        ("non-finite sampling params", C, json.dumps(comp)[:-1].encode() + b', "temperature": NaN}', js, "finite"),
        ("non-finite sampling params", C, json.dumps(comp)[:-1].encode() + b', "top_p": Infinity}', js, "top_p"),
        ("image input to the text model", H, image_chat(_IMAGE), None, "not a multimodal model"),
        ("image input to the text model", H, image_chat(_IMAGE, stream=True), None, "not a multimodal model"),
        ("image input to the text model", H, image_chat("http://127.0.0.1:1/cat.png"), None, "not a multimodal model"),
        ("unknown model", C, {**comp, "model": "no-such-model"}, None, "does not exist"),
    ]


def test_bad_openai_requests_get_a_clear_4xx_and_the_engine_stays_up(server: Server) -> None:
    import requests

    _reset(server)
    engine_pids = sorted(p.pid for p in _server_procs(server.pid))
    prompt = _prompt(12, seed=7)
    before = _greedy(server, prompt)
    tried: collections.Counter[str] = collections.Counter()
    for kind, path, body, headers, expect in _bad_openai_requests(server.model):
        kw = {"data": body} if isinstance(body, bytes) else {"json": body}
        r = requests.post(f"{server.base}{path}", headers=headers, timeout=120, **kw)
        assert 400 <= r.status_code < 500, (kind, body if isinstance(body, bytes) else str(body)[:200], r.status_code,
                                            r.text[:500])
        assert expect.lower() in r.text.lower(), (kind, expect, r.text[:500])
        tried[kind] += 1

    # A stream's parameters are checked before its response starts, but its prompt's token ids only
    # once it is generating (vLLM's design): 200 with a single in-band error event (code 400, naming the
    # token) and no choices.
    body = {"model": server.model, "prompt": [5, 6, 700], "max_tokens": 4, "stream": True}
    with requests.post(f"{server.base}/v1/completions", json=body, stream=True, timeout=120) as r:
        lines = [x for x in r.iter_lines() if x.startswith(b"data: ")]
    events = [json.loads(x[6:]) for x in lines if x != b"data: [DONE]"]
    assert 400 <= r.status_code < 500 or (
        r.status_code == 200 and len(events) == 1 and events[0]["error"]["code"] == 400
        and "Token id 700 is out of vocabulary" in events[0]["error"]["message"]), (r.status_code, lines)
    tried["token id >= vocab (stream, in-band 400)"] += 1

    assert requests.get(f"{server.base}/health", timeout=30).status_code == 200
    assert sorted(p.pid for p in _server_procs(server.pid)) == engine_pids  # no engine restart
    assert _greedy(server, prompt) == before  # same weights, BI: identical tokens and logprobs
    TRIED.update({f"openai: {k}": n for k, n in tried.items()})
    print(f"\nbad OpenAI requests, by kind ({sum(tried.values())}): {dict(tried)}")


# -- 3b. bad pushes not in test_weight_swap's BAD_CASES --------------------------------------------------------
def _st_parts(raw: bytes) -> tuple[dict[str, Any], bytes]:
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _st_build(header: dict[str, Any] | bytes, data: bytes) -> bytes:
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(hb)) + hb + data


def _bad_push_bodies(good: bytes) -> list[tuple[str, bytes, str]]:
    """(kind, body, text the 400's detail must contain): all unparseable as safetensors."""
    hdr, data = _st_parts(good)
    names = sorted(k for k in hdr if k != "__metadata__")
    first = names[0]

    def with_entry(name: str, **changes: Any) -> bytes:
        h = {k: (dict(v, **changes) if k == name else v) for k, v in hdr.items()}
        return _st_build(h, data)

    same_shape = next(n for n in names[1:] if hdr[n]["shape"] == hdr[first]["shape"]
                      and hdr[n]["dtype"] == hdr[first]["dtype"])
    noise = torch.randint(0, 256, (len(good),), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    return [
        ("zero-byte body", b"", "header too small"),
        ("header length claims 4 EiB", struct.pack("<Q", 1 << 62) + good[8:], "header too large"),
        ("header length past the end", struct.pack("<Q", len(good)) + good[8:], "invalid header length"),
        ("header claims huge tensor sizes", with_entry(first, shape=[10**12, 10**12]), "overflow"),
        ("header claims huge tensor sizes", with_entry(first, shape=[1 << 20, 1 << 10], data_offsets=[0, 4 << 30]),
         "invalid offset"),
        ("header claims huge tensor sizes", with_entry(first, data_offsets=[0, 10**15]), "offset"),
        ("two tensors on the same bytes", with_entry(same_shape, data_offsets=hdr[first]["data_offsets"]), "offset"),
        ("non-safetensors body of the right size", noise.numpy().tobytes(), "header too large"),
        ("non-safetensors body of the right size", b"\0" * len(good), "invalid JSON"),
        ("garbage header JSON", _st_build(b'{"a": [1, 2,' + b" " * 32, data), "invalid JSON"),
        ("garbage header JSON", _st_build(b"[1, 2, 3]", data), "invalid JSON"),
        ("garbage header JSON", _st_build(json.dumps(hdr).encode()[:-1] + b',"x":}', data), "invalid JSON"),
    ]


def test_bad_pushes_rejected_and_weights_unchanged(server: Server) -> None:
    import requests

    v = _reset(server)
    sums = checksum(server.reference)
    good = serialize(server.reference)
    tried: collections.Counter[str] = collections.Counter()

    def unchanged(version: int) -> None:
        assert _version(server) == version and server.pusher.checksums() == sums

    for kind, body, expect in _bad_push_bodies(good):
        r = _push_raw(server, body, v + 1)
        assert r.status_code == 400, (kind, r.status_code, r.text[:500])
        assert "not a valid safetensors file" in r.json()["detail"] and expect in r.json()["detail"], (kind, r.text)
        tried[kind] += 1
    # the safetensors body wrapped in a multipart form: not the raw file the route takes (refused by its label)
    r = requests.post(f"{server.base}{ROUTE}", params={"version": v + 1}, files={"w": ("w.safetensors", good)},
                      headers=_auth(), timeout=120)
    assert r.status_code == 415 and "multipart/form-data" in r.json()["detail"], r.text
    tried["multipart-wrapped payload"] += 1
    for bad in ("1.5", "abc", "", "0x10", "1_0", "+12", " 13 ", "\u0661\u0664", str(2**70), str(2**63)):
        r = _push_raw(server, good, bad)
        assert r.status_code == 400 and "version" in r.json()["detail"], (bad, r.text)
        tried["non-integer version"] += 1
    unchanged(v)

    # A duplicate tensor name in the header: a decoy entry (same bytes, I32) before the real one (F32).
    # The safetensors format disallows duplicates (two parsers may read different tensors: first vs last
    # entry wins). Refused, or -- if accepted -- the validator and the workers read the same tensor: the
    # real one (the decoy would be a 422 dtype mismatch), so the weights are exactly the payload's.
    hdr, data = _st_parts(good)
    name = sorted(k for k in hdr if k != "__metadata__" and hdr[k]["dtype"] == "F32")[0]
    decoy = json.dumps({name: dict(hdr[name], dtype="I32")})[1:-1].encode()  # same bytes, another dtype
    hb = json.dumps(hdr).encode()
    r = _push_raw(server, _st_build(b"{" + decoy + b"," + hb[1:], data), v + 1)
    assert r.status_code == 400 and "duplicate tensor names" in r.json()["detail"] and name in r.json()["detail"], r.text
    unchanged(v)
    tried["duplicate tensor name in header"] += 1

    # A valid payload labelled as another media type: refused (415) before reading it.
    for ctype in ("application/json", "application/x-www-form-urlencoded", "text/plain"):
        r = _push_raw(server, good, v + 1, headers={**_auth(), "Content-Type": ctype})
        assert r.status_code == 415 and "Content-Type" in r.json()["detail"], (ctype, r.text)
        unchanged(v)
        tried["valid payload, wrong Content-Type"] += 1

    # Replays: the exact bytes of an accepted push again, at its version and at an older one.
    new = _scaled(server.reference, 2)
    new_body = serialize(new)
    assert _push_raw(server, new_body, v + 1).status_code == 200
    sums = checksum(new)
    v += 1
    for old in (v, v - 1, 0, -1):
        r = _push_raw(server, new_body, old)
        assert r.status_code == 409 and "not greater than the current version" in r.json()["detail"], (old, r.text)
        tried["replayed / older version"] += 1
    unchanged(v)

    # Two pushes racing for the same version: one wins, the other gets 409, the live weights are the winner's.
    bodies = {"a": serialize(_scaled(server.reference, 5)), "b": serialize(_scaled(server.reference, 6))}
    results: dict[str, int] = {}
    barrier = threading.Barrier(2)

    def race(key: str) -> None:
        barrier.wait()
        results[key] = _push_raw(server, bodies[key], v + 1).status_code

    threads = [threading.Thread(target=race, args=(k,)) for k in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(results.values()) == [200, 409], results
    winner = next(k for k, st in results.items() if st == 200)
    sums = checksum(_scaled(server.reference, 5 if winner == "a" else 6))
    unchanged(v + 1)
    tried["concurrent pushes of one version"] += 2

    assert _greedy(server, [5, 6, 7], max_tokens=4)  # still serving
    TRIED.update({f"push: {k}": n for k, n in tried.items()})
    print(f"\nbad pushes, by kind ({sum(tried.values())}): {dict(tried)}")
    print(f"all inputs tried in this module so far, by kind: {dict(TRIED)}")
