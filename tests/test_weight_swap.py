"""Weight push + in-place swap (``vllm_titan_plugin.swap``, ``titan_rl_ext.rl.weight_sync``).

One real OpenAI API server (``python -m vllm.entrypoints.openai.api_server --model-impl titan``, tiny
Qwen3.5, fp32, prefix caching on) serves the whole module with ``TITAN_SWAP_TOKEN`` set and vLLM's own
API key (``VLLM_API_KEY``, as ``--api-key``) on its OpenAI routes; the tests
share it, so each one reads the current weight version and checksums instead of assuming them. The
"routes off" check builds vLLM's app without an engine in a subprocess (no second server).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from servers import openai_server, server_env
from titan_rl_ext.rl.weight_sync import WeightPusher, WeightPushError, checksum, serialize

pytestmark = pytest.mark.slow

TOKEN = "titan-test-token-5f3c9a"  # checked to never appear in the server log
API_KEY = "vllm-api-key-81d2"  # vLLM's --api-key (guards /v1/...): a different secret from the push token
KEY = {"Authorization": f"Bearer {API_KEY}"}
ROUTE = "/titan/v1/weights"
SALT_PROMPT_LEN = 300  # > one prefix-cache block (256 tokens for the tiny hybrid model in align mode)
# A stream long enough (~5 s on these CPUs) that the push lands mid-generation even when the client
# sees the chunks late (on 2 busy cores the API server can deliver a second's worth in one burst).
STREAM_TOKENS = 1000


@dataclass
class Server:
    base: str
    port: int
    model: str
    log: Path
    pusher: WeightPusher
    reference: dict[str, torch.Tensor]  # the checkpoint's titan state dict (what the server starts with)


@pytest.fixture(scope="module")
def server(tiny_ckpt: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from titan_rl_ext.models.hf import load_hf_model

    model_dir = tiny_ckpt("qwen3_5", layout="vlm")
    log_path = tmp_path_factory.mktemp("swap_server") / "server.log"
    extra = ["--enable-prefix-caching", "--enable-prompt-tokens-details"]
    with openai_server(model_dir, log_path, 1024, extra, server_env(TITAN_SWAP_TOKEN=TOKEN, VLLM_API_KEY=API_KEY,
                                                                 TITAN_SWAP_PORT="0")) as srv:
        srv.wait_ready()
        model, _ = load_hf_model(model_dir)
        ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
        yield Server(srv.base, srv.port, str(model_dir), log_path, WeightPusher([srv.base], TOKEN), ref)


# -- helpers -----------------------------------------------------------------------------------------------
def _auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _version(s: Server) -> int:
    import requests

    return requests.get(f"{s.base}{ROUTE}/version", timeout=10).json()["version"]


def _push_raw(s: Server, body: bytes, version: int, headers: dict[str, str] | None = None, **params: str) -> Any:
    import requests

    return requests.post(f"{s.base}{ROUTE}", params={"version": str(version), **params}, data=body,
                         headers=_auth() if headers is None else headers, timeout=120)


def _complete(s: Server, prompt: list[int] | list[list[int]], max_tokens: int = 16, **extra: Any) -> Any:
    import requests

    body = {"model": s.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, **extra}
    r = requests.post(f"{s.base}/v1/completions", json=body, headers=KEY, timeout=120)
    assert r.status_code == 200, r.text
    return r


def _greedy(s: Server, prompts: list[list[int]]) -> list[tuple[list[str], list[float]]]:
    """Greedy tokens and their logprobs, 32 per prompt (one batched request)."""
    choices = sorted(_complete(s, prompts, max_tokens=32).json()["choices"], key=lambda c: c["index"])
    return [(c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]) for c in choices]


def _cached(r: Any) -> int:
    return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


# -- routes off without the token --------------------------------------------------------------------------
_OFF_CHECK = r"""
import sys
import vllm.entrypoints.launchers.api_server.entry as entry
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
from starlette.testclient import TestClient
args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", sys.argv[1]])  # loads the plugins
client = TestClient(entry.build_app(args, ("generate",), None))
print("STATUS", client.get("/titan/v1/weights/version").status_code, client.post("/titan/v1/weights?version=1").status_code)
"""


def test_routes_absent_without_token(tiny_ckpt: Any) -> None:
    """vLLM's own app builder (no engine needed for routing) with the plugin loaded, env var unset."""
    env = {k: v for k, v in server_env().items() if k != "TITAN_SWAP_TOKEN"}
    r = subprocess.run([sys.executable, "-c", _OFF_CHECK, str(tiny_ckpt("qwen3_5", layout="vlm"))],
                       capture_output=True, text=True, timeout=300, env=env)
    assert "STATUS 404 404" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


# -- auth, version ordering --------------------------------------------------------------------------------
def test_auth_and_version_conflict(server: Server) -> None:
    import requests

    body = serialize(server.reference)
    v = _version(server)
    assert _push_raw(server, body, v + 1, headers={}).status_code == 401
    assert _push_raw(server, body, v + 1, headers={"Authorization": "Basic abc"}).status_code == 401
    assert _push_raw(server, body, v + 1, headers=_auth("wrong")).status_code == 403
    assert requests.get(f"{server.base}{ROUTE}/checksums", timeout=10).status_code == 401
    assert requests.get(f"{server.base}{ROUTE}/checksums", headers=_auth("wrong"), timeout=10).status_code == 403
    r = requests.post(f"{server.base}{ROUTE}", data=body, headers=_auth(), timeout=60)  # no version
    assert r.status_code == 400, r.text
    assert _push_raw(server, body, v + 1, mode="sideways").status_code == 400
    r = _push_raw(server, body, v)  # not strictly greater
    assert r.status_code == 409, r.text
    assert _push_raw(server, body, v - 1).status_code == 409
    assert _version(server) == v
    # the version route also says which recurrent GDN kernel the server runs (the trainer checks it before BI)
    from titan_rl_ext.kernels.gdn import recurrent_kernel

    doc = requests.get(f"{server.base}{ROUTE}/version", timeout=10).json()
    assert doc["gdn_recurrent"] == recurrent_kernel(), doc  # the server inherits this process's setting


# -- rejected pushes leave the weights alone ---------------------------------------------------------------
def _bad_payload(ref: dict[str, torch.Tensor], case: str) -> tuple[dict[str, torch.Tensor] | bytes, str | None]:
    """(a state dict the pusher serialises, or raw bytes; a tensor name the error must mention)."""
    sd = {k: v.clone() for k, v in ref.items()}
    if case == "wrong_name":
        sd["layers.0.attention_norm.wieght"] = sd.pop("layers.0.attention_norm.weight")
        return sd, "layers.0.attention_norm.wieght"
    if case == "missing":
        del sd["norm.weight"]
        return sd, "norm.weight"
    if case == "extra":
        sd["layers.0.bonus.weight"] = torch.zeros(3)
        return sd, "layers.0.bonus.weight"
    if case == "wrong_shape":
        sd["tok_embeddings.weight"] = sd["tok_embeddings.weight"][:-1]
        return sd, "tok_embeddings.weight"
    if case == "wrong_dtype":
        sd["layers.1.attention.wqkv.weight"] = sd["layers.1.attention.wqkv.weight"].to(torch.bfloat16)
        return sd, "layers.1.attention.wqkv.weight"
    if case == "nan":
        sd["layers.2.feed_forward.w13.weight"][3, 5] = float("nan")
        return sd, "layers.2.feed_forward.w13.weight"
    if case == "inf":
        sd["layers.0.linear_attn.A_log"][0] = float("inf")
        return sd, "layers.0.linear_attn.A_log"
    if case == "truncated":
        return serialize(sd)[:-1000], None
    if case == "garbage":
        return b"\x80\x04 this is not a safetensors file", None
    if case == "corrupt_header":
        raw = bytearray(serialize(sd))
        raw[8] = ord("x")  # the JSON header no longer parses
        return bytes(raw), None
    raise AssertionError(case)


BAD_CASES = {
    "wrong_name": 422, "missing": 422, "extra": 422, "wrong_shape": 422, "wrong_dtype": 422, "nan": 422,
    "inf": 422, "truncated": 400, "garbage": 400, "corrupt_header": 400,
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_push_rejected_and_weights_unchanged(server: Server, case: str) -> None:
    before, v = server.pusher.checksums(), _version(server)
    payload, name = _bad_payload(server.reference, case)
    if isinstance(payload, bytes):
        r = _push_raw(server, payload, v + 1)
        status, detail = r.status_code, r.json().get("detail", r.text)
    else:  # through the trainer-side client, which must raise naming the server and the status
        with pytest.raises(WeightPushError, match=f"HTTP {BAD_CASES[case]}") as exc:
            server.pusher.push(payload, v + 1)
        status, detail = exc.value.results[0]["status"], exc.value.results[0]["error"]["detail"]
    assert status == BAD_CASES[case], detail
    if name is not None:
        assert name in detail, detail
    assert server.pusher.checksums() == before
    assert _version(server) == v
    _complete(server, [5, 6, 7], max_tokens=4)  # still serving


def _fake_manifest(reference: dict[str, torch.Tensor], drop: str | None = None,
                   forge: tuple[str, Any] | None = None) -> dict[str, Any]:
    """A structurally valid CUDA IPC manifest (the handles are never opened on a CPU server); ``forge``
    = (field, value) overwrites one field of the first tensor's entry."""
    from titan_rl_ext.wire.cuda_ipc import FORMAT

    tensors = {
        n: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "stride": list(t.contiguous().stride()), "offset": 0,
            "device_uuid": "GPU-none", "handle": "b:", "storage_bytes": t.numel() * t.element_size(),
            "storage_offset_bytes": 0,
            "ref_counter_handle": None, "ref_counter_offset": 0, "event_handle": None, "event_sync_required": False}
        for n, t in reference.items() if n != drop}
    if forge is not None:
        tensors[sorted(tensors)[0]][forge[0]] = forge[1]
    return {"format": FORMAT, "tensors": tensors}


def test_cuda_ipc_transport_checked_and_refused_on_cpu(server: Server) -> None:
    """transport=cuda_ipc: the manifest's names/shapes/dtypes are checked like a safetensors payload; on a
    CPU generator a well-formed manifest is refused (400, naming the reason); nothing changes."""
    before, v = server.pusher.checksums(), _version(server)
    name = sorted(server.reference)[0]
    cases = [
        (b"{not json", 400, "invalid CUDA IPC manifest"),
        (json.dumps({"format": "other", "tensors": {}}).encode(), 400, "format"),
        (json.dumps(_fake_manifest(server.reference, drop=name)).encode(), 422, name),
        (json.dumps(_fake_manifest(server.reference)).encode(), 400, "needs a generator on CUDA"),
    ]
    # forged views: what torch's rebuild would trust (a view reaching past its storage reads memory the
    # sender never shared) is refused before any handle is opened, naming the field
    first = sorted(server.reference)[0]
    contiguous = list(server.reference[first].contiguous().stride())
    for field, value in (("stride", [x + 1 for x in contiguous]), ("offset", 7),
                         ("storage_bytes", 2), ("storage_bytes", 1 << 40), ("storage_offset_bytes", -64),
                         ("ref_counter_offset", "0"), ("handle", "raw-bytes"), ("event_sync_required", 1)):
        cases.append((json.dumps(_fake_manifest(server.reference, forge=(field, value))).encode(), 400, field))
    for body, status, needle in cases:
        r = _push_raw(server, body, v + 1, transport="cuda_ipc")
        assert r.status_code == status, r.text
        assert needle in r.json()["detail"], r.text
    assert _push_raw(server, b"", v + 1, transport="carrier-pigeon").status_code == 400
    assert server.pusher.checksums() == before and _version(server) == v
    _complete(server, [5, 6, 7], max_tokens=4)


def test_oversized_push_refused_before_reading(server: Server) -> None:
    v, before = _version(server), server.pusher.checksums()
    # Content-Length over the bound: answered from the headers, no body ever sent.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("POST", f"{ROUTE}?version={v + 1}")
    conn.putheader("Authorization", f"Bearer {TOKEN}")
    conn.putheader("Content-Length", str(10**12))
    conn.endheaders()
    r = conn.getresponse()
    assert r.status == 413, r.read()
    conn.close()
    # Chunked upload (no length): refused once the stream passes 2x model bytes + 1 MiB (~3.2 MB here).
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("POST", f"{ROUTE}?version={v + 1}")
    conn.putheader("Authorization", f"Bearer {TOKEN}")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    chunk = b"\0" * 65536
    for _ in range(64):
        conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    conn.send(b"0\r\n\r\n")
    r = conn.getresponse()
    assert r.status == 413, r.read()
    conn.close()
    assert server.pusher.checksums() == before and _version(server) == v


# -- a good push -------------------------------------------------------------------------------------------
def test_good_push_swaps_bit_exact(server: Server) -> None:
    prompts = [[5, 17, 99, 3, 250, 42], _prompt(40, seed=1), _prompt(90, seed=2)]
    new = {k: v * 1.01 for k, v in server.reference.items()}
    # start from the checkpoint's weights (an earlier test may have left others)
    server.pusher.push(server.reference, _version(server) + 1)
    assert server.pusher.checksums() == checksum(server.reference)
    before = _greedy(server, prompts)

    v = _version(server) + 1
    wall0, t0 = time.time(), time.perf_counter()
    (res,) = server.pusher.push(new, v)
    client_s = time.perf_counter() - t0
    assert res["version"] == v and res["num_tensors"] == len(new)
    # the phases the answer reports happened inside the client's round trip, on the same host's clock
    assert wall0 <= res["entered_unix"] <= wall0 + client_s, (wall0, res["entered_unix"], client_s)
    phases = [res[k] for k in ("receive_seconds", "validate_seconds", "hop_seconds", "swap_seconds")]
    assert all(x >= 0 for x in phases) and sum(phases) <= client_s, (phases, client_s)
    assert res["in_flight"] == 0  # no request was running: the swap straddles none
    assert _version(server) == v
    assert server.pusher.checksums() == checksum(new)  # bit for bit
    r = _complete(server, prompts[0])
    assert r.headers["x-titan-weight-version"] == str(v)
    after = _greedy(server, prompts)
    assert any(t1 != t0 for (t0, _), (t1, _) in zip(before, after)), "greedy output unchanged by the new weights"
    assert all(l1[0] != l0[0] for (_, l0), (_, l1) in zip(before, after))
    print(f"\nswap latency (CPU, {res['num_tensors']} tensors, {res['bytes'] / 1e6:.2f} MB): "
          f"paused {res['swap_seconds'] * 1e3:.1f} ms, validate {res['validate_seconds'] * 1e3:.1f} ms, "
          f"client round trip incl. serialisation {client_s * 1e3:.1f} ms")


# -- swaps under a streaming request -----------------------------------------------------------------------
def _stream_across_push(server: Server, mode: str, delay_s: float,
                        max_tokens: int = STREAM_TOKENS) -> tuple[list[dict[str, Any]], int, dict[str, Any]]:
    """Stream one completion and push the next version ``delay_s`` after sending the request; returns the
    chunks, the old version and the push's answer.

    The stream and the push share one event loop: with the stream read in a thread, the pushing thread
    was starved of the GIL for the whole stream on a loaded 2-core machine (the reader drops and retakes
    the GIL at every socket read). The push does not wait for the first chunk either: on a loaded machine
    the engine can finish the request before the API server has sent the client its first chunk.
    """
    import httpx

    from titan_rl_ext.rl.sse import DONE, parse_sse_line, sse_lines

    old = _version(server)
    payload = serialize(server.reference)
    target = server.pusher.push_url(server.base)  # the weights listener, as WeightPusher sends
    body = {"model": server.model, "prompt": [5, 6, 7, 8], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    async def read(client: httpx.AsyncClient) -> list[dict[str, Any]]:
        chunks: list[dict[str, Any]] = []
        async with client.stream("POST", f"{server.base}/v1/completions", json=body, headers=KEY) as r:
            assert r.status_code == 200, await r.aread()
            async for line in sse_lines(r.aiter_bytes()):
                item = parse_sse_line(line)
                if item is DONE:
                    break
                if isinstance(item, dict):
                    chunks.append(item)
        return chunks

    async def run() -> tuple[list[dict[str, Any]], Any]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
            reader = asyncio.create_task(read(client))
            await asyncio.sleep(delay_s)
            res = await client.post(f"{target}{ROUTE}", params={"version": str(old + 1), "mode": mode},
                                    content=payload, headers={**_auth(), "Content-Type": "application/octet-stream"})
            return await reader, res

    chunks, res = asyncio.run(run())
    assert res.status_code == 200, res.text
    return chunks, old, res.json()


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_swap_during_streaming_request(server: Server, mode: str) -> None:
    """Pushes while a 1000-token request streams. Every try: the server's in-flight count agrees with the
    tags (a request it counted carries both versions, in order; one it did not carries one), and the
    request completes. A try whose push landed inside the request also checks where the tags change.

    Whether a push lands inside the request is not up to the test: the push can beat the request to the
    engine, and while one stream runs the push route was entered only when the stream had ended, in every
    try of some runs (CI and here, from a thread, an event loop or another process alike; the swap itself
    took 4 ms). The load test (``tests/test_reliability.py``) requires swaps inside requests of both modes.
    """
    tries: list[str] = []
    for delay in (0.2, 0.6, 0.05, 1.5):
        wall0 = time.time()
        chunks, old, res = _stream_across_push(server, mode, delay)
        versions = [c["titan_weight_version"] for c in chunks if c.get("choices")]  # not the usage chunk
        assert versions and all(a <= b for a, b in zip(versions, versions[1:])), versions
        assert set(versions) <= {old, old + 1}, set(versions)
        crossed = versions[0] == old and versions[-1] == old + 1
        assert bool(res["in_flight"]) == crossed, (res["in_flight"], versions[:1], versions[-1:])
        usage = [c["usage"] for c in chunks if c.get("usage")]
        assert usage and usage[-1]["completion_tokens"] == STREAM_TOKENS  # the request completed
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
        assert finish[-1] == "length"
        n_old = versions.count(old)
        tries.append(f"pushed {delay:.2f} s after the request, route entered {res['entered_unix'] - wall0:.2f} s after "
                     f"the try began, in flight {res['in_flight']}: {n_old} chunks tagged v{old}, "
                     f"{len(versions) - n_old} tagged v{old + 1}")
        if crossed:
            assert res["in_flight"] == 1
            break
    print(f"\n{mode}: {'; '.join(tries)}")


# -- prefix cache salted per version -----------------------------------------------------------------------
def test_prefix_cache_salted_per_version(server: Server) -> None:
    prompt = _prompt(SALT_PROMPT_LEN, seed=11)
    _complete(server, prompt, max_tokens=2)
    assert _cached(_complete(server, prompt, max_tokens=2)) > 0  # repeat within one version hits
    own = _prompt(SALT_PROMPT_LEN, seed=12)
    _complete(server, own, max_tokens=2, cache_salt="client-salt")
    # Same weights pushed as a new version: the KV a prefix would reuse is identical, so only the salt
    # can prevent the hit; ``keep`` mode does not reset the prefix cache.
    server.pusher.push(server.reference, _version(server) + 1)
    assert _cached(_complete(server, prompt, max_tokens=2)) == 0  # no reuse across versions
    assert _cached(_complete(server, prompt, max_tokens=2)) > 0  # the new version caches again
    assert _cached(_complete(server, own, max_tokens=2, cache_salt="client-salt")) > 0  # client salt kept


def test_chat_completion_carries_version(server: Server) -> None:
    import requests

    body = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = requests.post(f"{server.base}/v1/chat/completions", json=body, headers=KEY, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-titan-weight-version"] == str(_version(server))
    with requests.post(f"{server.base}/v1/chat/completions", json={**body, "stream": True}, stream=True, headers=KEY,
                       timeout=60) as r:
        data = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith(b"data: {")]
    assert data and all(c["titan_weight_version"] == _version(server) for c in data)


def test_sse_annotation_splices_a_valid_field() -> None:
    """A chunk's tag goes into every JSON ``data:`` line of an SSE event without re-serialising it (the
    chunks that finish no choice); other lines (``[DONE]``, comments, event names) are untouched."""
    from types import SimpleNamespace

    from titan_rl_ext.wire.protocol import VERSION_FIELD
    from vllm_titan_plugin.swap.tagging import RequestVersions, _Annotator

    def _annotate_event(event: bytes, version: int) -> bytes:
        async def send(msg: Any) -> None:
            raise AssertionError("not sent")
        return _Annotator(send, SimpleNamespace(version=version), RequestVersions())._event(event)

    cases = {
        b'data: {"id":"c","choices":[{"text":"}{","index":0}]}': {"id": "c", "choices": [{"text": "}{", "index": 0}]},
        b"data: {}": {},
        b'data:  { "a" : 1 } ': {"a": 1},
        b'event: error\ndata: {"error":{"code":400}}': {"error": {"code": 400}},
    }
    for event, obj in cases.items():
        lines = _annotate_event(event, 12).split(b"\n")
        data = [json.loads(x[5:]) for x in lines if x.startswith(b"data:")]
        assert data == [{VERSION_FIELD: 12, **obj}], (event, lines)
        assert [x for x in lines if not x.startswith(b"data:")] == [x for x in event.split(b"\n") if not x.startswith(b"data:")]
    assert _annotate_event(b"data: [DONE]", 3) == b"data: [DONE]"
    assert _annotate_event(b": keep-alive", 3) == b": keep-alive"


def _raw_post(server: Server, path: str, headers: dict[str, str], timeout: float = 5.0) -> str:
    """Send only the request head of a POST announcing a 1 GB body (no body follows); the status line of the
    answer, or "" if none came within ``timeout`` (the server is waiting for the body)."""
    import socket

    head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": "x", "Content-Type": "application/json",
                                                  "Content-Length": str(1 << 30), **headers}.items())
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\n{head}\r\n".encode())
        try:
            return sock.recv(4096).decode(errors="replace").split("\r\n")[0]
        except TimeoutError:
            return ""


def test_api_key_checked_before_any_body_is_read(server: Server) -> None:
    """vLLM's --api-key check runs before the version middleware buffers a body: a request without the key
    (or with the push token instead) announcing 1 GB is answered 401 at once, not left reading."""
    t0 = time.time()
    for headers in ({}, _auth(), {"Authorization": "Bearer nope"}):
        assert " 401 " in _raw_post(server, "/v1/completions", headers) + " ", headers
    assert time.time() - t0 < 10
    _complete(server, [5, 6, 7], max_tokens=2)  # with the key: served


def test_untagged_generation_routes_refused(server: Server) -> None:
    """Routes that would run the model without a version salt or tags answer 501 while pushes are on."""
    import requests

    for path in ("/v1/responses", "/inference/v1/generate", "/invocations"):
        r = requests.post(f"{server.base}{path}", json={"model": server.model, "input": "hi"}, headers=KEY, timeout=30)
        assert r.status_code == 501 and "not version-tagged" in r.json()["detail"], (path, r.status_code, r.text)


def test_token_goes_only_to_this_boots_listener(server: Server) -> None:
    """A pusher that cached a listener which now answers with another boot id (the server restarted and
    another process holds the old port) discovers the server's listener again: the stale one never sees
    the token, and the push lands."""
    import http.server
    import threading

    seen: list[str | None] = []

    class Stranger(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            seen.append(self.headers.get("Authorization"))
            body = json.dumps({"version": 0, "boot_id": "someone-else"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args: Any) -> None:
            pass

    stranger = http.server.HTTPServer(("127.0.0.1", 0), Stranger)
    threading.Thread(target=stranger.serve_forever, daemon=True).start()
    try:
        pusher = WeightPusher([server.base], TOKEN)
        real = pusher.push_url(server.base)
        assert real != server.base  # the listener was asked for (TITAN_SWAP_PORT=0) and verified
        boot = pusher._push_urls[server.base][0]
        pusher._push_urls[server.base] = (boot, f"http://127.0.0.1:{stranger.server_port}")  # as after a restart
        pusher.push(server.reference, _version(server) + 1)
        assert pusher._push_urls[server.base] == (boot, real)
        assert seen and all(h is None for h in seen), seen  # asked who it is, never given the token
    finally:
        stranger.shutdown()


def test_token_never_logged(server: Server) -> None:
    assert TOKEN not in server.log.read_text()


def test_batch_invariance_switch_on_the_generator(server: Server) -> None:
    """BI as a debug switch: auth required, flips the engine's kernels, the server keeps serving."""
    import requests

    url = f"{server.base}/titan/v1/batch_invariant"
    assert requests.post(url, params={"enabled": "1"}, timeout=30).status_code == 401
    assert requests.post(url, params={"enabled": "maybe"}, headers=_auth(), timeout=30).status_code == 400
    prompt = {"model": server.model, "prompt": [5, 6, 7, 8, 9], "max_tokens": 6, "temperature": 0.0,
              "logprobs": 0, "ignore_eos": True}
    outs = {}
    for enabled in (True, False, True):
        server.pusher.set_batch_invariant(enabled)
        r = requests.post(f"{server.base}/v1/completions", json=prompt, headers=KEY, timeout=120)
        assert r.status_code == 200, r.text
        outs.setdefault(enabled, []).append(r.json()["choices"][0]["logprobs"]["token_logprobs"])
    assert outs[True][0] == outs[True][1]  # BI results reproduce exactly after switching back
    # and the switch really changes the kernels: other summation orders, other low bits
    assert outs[True][0] != outs[False][0], (outs[True][0], outs[False][0])
    server.pusher.set_batch_invariant(False)


def test_signed_push_cannot_be_replayed(server: Server) -> None:
    """The project's pusher signs every request (``wire.signing``) instead of sending the token. A captured
    signed push works once: sent again, or with its signature under another ``version``, or signed for
    another boot of the server, it is refused before its body is read and the version stays. (A ``Bearer``
    header, the token itself, would authorise any later push: the server takes it unless started with
    ``TITAN_SWAP_SIGNED_ONLY=1``; the control below shows what a captured one allows.)"""
    import requests

    from titan_rl_ext.wire import signing

    doc = requests.get(f"{server.base}{ROUTE}/version", timeout=10).json()
    v, boot = doc["version"], doc["boot_id"]
    body = serialize(server.reference)
    params = {"version": str(v + 1), "mode": "keep"}
    signed = {"Authorization": signing.authorization(TOKEN, "POST", ROUTE, params, boot)}
    assert TOKEN not in signed["Authorization"]
    r = requests.post(f"{server.base}{ROUTE}", params=params, data=body, headers=signed, timeout=120)
    assert r.status_code == 200, r.text
    again = requests.post(f"{server.base}{ROUTE}", params=params, data=body, headers=signed, timeout=60)
    assert again.status_code == 401 and "replayed" in again.json()["detail"], again.text
    later = {"version": str(v + 2), "mode": "keep"}
    moved = requests.post(f"{server.base}{ROUTE}", params=later, data=body, headers=signed, timeout=60)
    assert moved.status_code == 403, moved.text
    other_boot = {"Authorization": signing.authorization(TOKEN, "POST", ROUTE, later, "another-boot")}
    r = requests.post(f"{server.base}{ROUTE}", params=later, data=body, headers=other_boot, timeout=60)
    assert r.status_code == 403, r.text
    assert _version(server) == v + 1
    # the control: a captured Bearer header authorises a later version too
    r = requests.post(f"{server.base}{ROUTE}", params=later, data=body, headers=_auth(), timeout=120)
    assert r.status_code == 200 and _version(server) == v + 2, r.text
