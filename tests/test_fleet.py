"""A fleet of real generators that never half-updates, and salts taken when a request is scheduled (issue 16).

Three vLLM OpenAI servers (``--model-impl titan``, tiny Qwen3.5, fp32, BI, prefix caching), each behind a
small fault-injecting HTTP proxy of this module, form one ``GeneratorFleet``. Faults, one per push:

| fault                          | expected outcome                                                  |
|--------------------------------|-------------------------------------------------------------------|
| a server answers the push 503  | out of the pool; the others serve v; no sample from it            |
| a server answers slowly (1 s)  | in the pool at v once it answered                                 |
| a server killed mid-swap       | out of the pool; its address is restarted later                   |
| a pooled server restarted      | its first sample is refused (new boot id), it leaves the pool     |
| the next push                  | every server, restarted ones included, serves it and is back in   |

Every admitted sample is replayed by the trainer's model at the versions its tokens are tagged with and
must give the generator's logprobs bit for bit (BI): no sample trained on carries another version than
its tag says. The last test checks the prefill-time salt: a request that reached the engine before a
``keep`` swap but is scheduled after it must not reuse prefix blocks computed with the old weights.
"""

from __future__ import annotations

import asyncio
import http.client
import http.server
import json
import signal
import socketserver
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from servers import kill_group, one_core, server_env
from titan_rl_ext.rl.fleet import FleetClient, GeneratorFleet
from titan_rl_ext.rl.generator_server import GeneratorServer
from titan_rl_ext.rl.rollout import Generation, GeneratorClient, SamplingConfig
from titan_rl_ext.rl.weight_sync import WeightPusher

pytestmark = pytest.mark.slow

TOKEN = "titan-fleet-token-73be20"
MAX_MODEL_LEN = 512
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enable-prefix-caching",
               "--enable-prompt-tokens-details"]
SAMPLING = SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=12, extra={"ignore_eos": True})
HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "upgrade", "te"}


# -- a fault-injecting proxy ----------------------------------------------------------------------------
@dataclass
class Proxy:
    """Forwards everything to ``upstream``; ``fault`` acts on weight pushes only: ``"503"`` answers
    without forwarding, ``"slow"`` waits ``delay_s`` first, ``"kill"`` freezes the server's engine core
    (``on_freeze``), forwards the whole push -- the API server reads and checks it and starts the swap,
    which cannot finish -- records the server's own version route (``mid_swap``), then kills the server
    (its whole process group) and drops the connection, as a dead server would. The version
    route's ``push_port`` is removed, so pushes come through here. ``stall_completions``: that many
    completion requests wait ``delay_s`` before they are forwarded (a slow request; the server is fine)."""

    upstream_port: int
    fault: str | None = None
    delay_s: float = 1.0  # a push of the tiny model takes a fraction of that: slow, and a short wait
    on_kill: Any = None
    on_freeze: Any = None
    mid_swap: dict[str, Any] = field(default_factory=dict)  # the version route while the swap hung
    pushes: list[float] = field(default_factory=list)  # seconds each push took through the proxy
    stall_completions: int = 0
    stalled_forwarded: threading.Event = field(default_factory=threading.Event)  # a stalled one went on, answered
    port: int = 0

    def start(self) -> Proxy:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def _forward(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n) if n else b""
                is_push = self.command == "POST" and self.path.startswith("/titan/v1/weights?")
                t0 = time.perf_counter()
                stalled = self.path.startswith("/v1/completions") and proxy.stall_completions > 0
                if stalled:
                    proxy.stall_completions -= 1
                    time.sleep(proxy.delay_s)
                if is_push and proxy.fault == "503":
                    return self._reply(503, b'{"detail": "injected: service unavailable"}', "application/json")
                if is_push and proxy.fault == "slow":
                    time.sleep(proxy.delay_s)
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=300)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                if is_push and proxy.fault == "kill":
                    proxy.on_freeze()
                    conn.request(self.command, self.path, body=body, headers=headers)  # all of it arrives
                    time.sleep(1.0)  # the API server reads, checks and hands the swap to the frozen engine
                    side = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=10)
                    side.request("GET", "/titan/v1/weights/version")
                    proxy.mid_swap = json.loads(side.getresponse().read())
                    proxy.on_kill()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                conn.request(self.command, self.path, body=body, headers=headers)
                r = conn.getresponse()
                data = r.read()
                if self.path.startswith("/titan/v1/weights/version") and r.status == 200:
                    doc = json.loads(data)
                    doc.pop("push_port", None)
                    data = json.dumps(doc).encode()
                if is_push:  # recorded before the answer leaves: the pusher may read it as soon as it has one
                    proxy.pushes.append(time.perf_counter() - t0)
                try:
                    self._reply(r.status, data, r.getheader("content-type", ""),
                                [(k, v) for k, v in r.getheaders() if k.lower() not in HOP | {"content-type"}])
                finally:
                    conn.close()
                    if stalled:  # the server ran it to the end, whether or not the client still listens
                        proxy.stalled_forwarded.set()

            def _reply(self, status: int, data: bytes, ctype: str, headers: list[tuple[str, str]] = ()) -> None:
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                if ctype:
                    self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _forward

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True

        srv = Server(("127.0.0.1", 0), Handler)
        self.port = srv.server_address[1]
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


# -- three servers ----------------------------------------------------------------------------------------
@dataclass
class Fleet:
    model_dir: Path
    log_dir: Path
    servers: list[GeneratorServer]
    proxies: list[Proxy]
    fleet: GeneratorFleet
    reference: dict[str, torch.Tensor]
    trainer: Any
    spares: dict[int, GeneratorServer]  # server i's restart, booted with the fleet (``restart``)
    weights: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def restart(self, *idx: int) -> None:
        """Kill servers ``idx`` (those alive) and put a fresh one behind each one's proxy: a new process with the
        checkpoint's weights (version 0) and a boot id of its own, at the address the fleet knows (the proxy's).
        The fresh ones were started with the fleet (``fl``), their boots (~30 s of CPU each) side by side with the
        first three's, instead of the test waiting here for two more boots."""
        for i in idx:
            kill_group(self.servers[i])
            self.servers[i] = self.spares.pop(i)  # in place before the wait: the fixture's teardown kills it
            self.servers[i].wait_ready()
            self.proxies[i].upstream_port = self.servers[i].port


def _env(i: int) -> dict[str, str]:
    """Server ``i``'s: the three take turns of the cores (``one_core``)."""
    return server_env(TITAN_SWAP_TOKEN=TOKEN, TITAN_BATCH_INVARIANT="1", VLLM_SERVER_DEV_MODE="1", **one_core(i))


def _freeze_engine(srv: GeneratorServer) -> None:
    """SIGSTOP the API server's child processes (the engine core, its workers): a swap sent now hangs."""
    import psutil

    for child in psutil.Process(srv.proc.pid).children(recursive=True):
        child.send_signal(signal.SIGSTOP)


@pytest.fixture(scope="module")
def fl(tiny_ckpt: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    import requests

    from titan_rl_ext.models.hf import load_hf_model

    model_dir = tiny_ckpt("qwen3_5", layout="vlm")
    log_dir = tmp_path_factory.mktemp("fleet")
    servers = [GeneratorServer(model_dir, log_dir / f"server{i}.log", SERVER_ARGS, _env(i)) for i in range(3)]
    spares = {i: GeneratorServer(model_dir, log_dir / f"server{i}-restart.log", SERVER_ARGS, _env(i)) for i in (0, 2)}
    try:
        model, _ = load_hf_model(model_dir, dtype=torch.float32)  # while the servers boot
        model.eval()
        ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for s in servers:
            s.wait_ready()
        proxies = [Proxy(s.port).start() for s in servers]
        fleet = GeneratorFleet(WeightPusher([p.url for p in proxies], TOKEN, timeout_s=120))
        for p in proxies:  # a fresh run: every server holds the checkpoint (version 0)
            doc = requests.get(f"{p.url}/titan/v1/weights/version", timeout=30).json()
            assert doc["version"] == 0 and "push_port" not in doc
            fleet.verify(p.url, 0, doc["boot_id"])
        f = Fleet(model_dir, log_dir, servers, proxies, fleet, ref, model, dict(spares), {0: ref})
        proxies[0].on_kill = lambda: kill_group(f.servers[0])
        proxies[0].on_freeze = lambda: _freeze_engine(f.servers[0])
        yield f
    finally:
        for s in [*servers, *spares.values()]:  # a spare put in service is in both
            kill_group(s)


def _scaled(ref: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    return {n: t * (1 + 0.01 * k) for n, t in ref.items()}


def _push(f: Fleet, version: int) -> Any:
    f.weights[version] = _scaled(f.reference, version)
    return f.fleet.push(f.weights[version], version)


def _prompt(i: int) -> list[int]:
    g = torch.Generator().manual_seed(4000 + i)
    return torch.randint(3, 512, (6 + i % 9,), generator=g).tolist()


def _sample(f: Fleet, n: int, seed: int) -> list[tuple[list[int], Generation]]:
    async def run() -> list[tuple[list[int], Generation]]:
        clients = {p.url: GeneratorClient(p.url, str(f.model_dir)) for p in f.proxies}
        client = FleetClient(f.fleet, clients, wait_s=60)
        try:
            prompts = [_prompt(seed + i) for i in range(n)]
            gens = []
            for p in prompts:  # one at a time: the round robin visits every live member in turn
                gens.append(await client.generate(p, SAMPLING))
            return list(zip(prompts, gens))
        finally:
            for c in clients.values():
                await c.aclose()

    return asyncio.run(run())


ADMITTED: list[tuple[list[int], Generation]] = []


def _admitted(f: Fleet, n: int, seed: int, live: set[str]) -> list[Generation]:
    got = _sample(f, n, seed)
    for _, g in got:
        assert g.server in live, (g.server, live)
        assert len(g.token_ids) == SAMPLING.max_tokens and len(g.versions) == len(g.token_ids)
    ADMITTED.extend(got)
    return [g for _, g in got]


# -- the fault matrix ---------------------------------------------------------------------------------
def test_fleet_push_outcomes_under_faults(fl: Fleet) -> None:
    import requests

    urls = [p.url for p in fl.proxies]
    a, b, c = urls
    matrix: list[tuple[str, str]] = []

    out = _push(fl, 1)
    assert sorted(out.live) == sorted(urls) and not out.out
    assert {v for g in _admitted(fl, 6, 0, set(urls)) for v in g.versions} <= {0, 1}
    matrix.append(("no fault", f"live {len(out.live)}/3"))

    # 503 on b, slow answer from c: a and c serve v2, b is out and still serves v1, no sample from b
    fl.proxies[1].fault, fl.proxies[2].fault = "503", "slow"
    out = _push(fl, 2)
    fl.proxies[1].fault = fl.proxies[2].fault = None
    assert sorted(out.live) == sorted([a, c]) and list(out.out) == [b] and "503" in out.out[b], out
    assert fl.proxies[2].pushes[-1] >= fl.proxies[2].delay_s and out.seconds >= fl.proxies[2].delay_s
    assert requests.get(f"{b}/titan/v1/weights/version", timeout=30).json()["version"] == 1
    m = out.metrics()
    assert (m["fleet/live"], m["fleet/out"], m["swap/post_s"]) == (2.0, 1.0, out.seconds), m
    # the servers' own phases of the push (the slowest live one's), each inside the whole round
    for phase in ("swap/server_receive_s", "swap/server_hop_s", "swap/server_swap_s"):
        assert 0.0 <= m[phase] <= m["swap/post_s"], (phase, m)
    gens = _admitted(fl, 8, 100, {a, c})
    assert {g.server for g in gens} == {a, c} and all(v == 2 for g in gens for v in g.versions)
    matrix += [("503 from b", "b out, still on v1; a, c serve v2"), ("c slow (1 s)", "c serves v2")]

    # a killed part-way through a swap (the push read, checked and handed to its engine, which never
    # finishes it): out; b comes back with the push that reaches it
    fl.proxies[0].fault = "kill"
    out = _push(fl, 3)
    fl.proxies[0].fault = None
    assert sorted(out.live) == sorted([b, c]) and list(out.out) == [a], out
    assert fl.proxies[0].mid_swap["version"] == 2, fl.proxies[0].mid_swap  # the swap had not committed
    assert fl.servers[0].proc.poll() is not None  # really dead
    gens = _admitted(fl, 6, 200, {b, c})
    assert {g.server for g in gens} == {b, c} and all(v == 3 for g in gens for v in g.versions)
    matrix += [("a killed mid-swap", "a out; b back in at v3")]

    # a restarts on its address (checkpoint weights, version 0): still out. c restarts while in the pool:
    # its first sample carries a new boot id and is refused, c leaves the pool, the retry goes to b
    fl.restart(0, 2)
    refused0 = fl.fleet.refused
    gens = _admitted(fl, 6, 300, {b})
    assert fl.fleet.refused == refused0 + 1 and fl.fleet.live() == [b], (fl.fleet.refused, fl.fleet.live())
    assert all(v == 3 for g in gens for v in g.versions)
    for u in (a, c):
        assert requests.get(f"{u}/titan/v1/weights/version", timeout=30).json()["version"] == 0
    matrix += [("a restarted", "stays out"), ("c restarted while pooled", "first sample refused, c out")]

    # the next push reaches everyone: the restarted servers learn the current version and are back
    out = _push(fl, 4)
    assert sorted(out.live) == sorted(urls) and not out.out
    gens = _admitted(fl, 9, 400, set(urls))
    assert {g.server for g in gens} == set(urls) and all(v == 4 for g in gens for v in g.versions)
    matrix += [("next push", "all three serve v4")]
    print("\nfleet fault matrix:\n" + "\n".join(f"  {k:28s} -> {v}" for k, v in matrix))


def test_every_admitted_sample_has_the_weights_its_tags_say(fl: Fleet) -> None:
    """Replay each admitted sample with the trainer's model at its tagged version (BI): bit-exact."""
    from titan_rl_ext.kernels.batch_invariant import batch_invariant
    from titan_rl_ext.models.common.batch import SeqBatch
    from titan_rl_ext.rl.logprobs import token_logprobs

    assert ADMITTED, "run with test_fleet_push_outcomes_under_faults"
    by_version: dict[int, list[tuple[list[int], Generation]]] = {}
    for prompt, g in ADMITTED:
        (v,) = set(g.versions)  # one push per round above, with no request in flight across it
        by_version.setdefault(v, []).append((prompt, g))
    checked = 0
    # one packed recompute per version, as the trainer recomputes a batch (BI: packing changes no bit)
    with torch.no_grad(), batch_invariant():
        for v, group in sorted(by_version.items()):
            fl.trainer.load_state_dict(fl.weights[v])
            seqs = [prompt + g.token_ids for prompt, g in group]
            lp = token_logprobs(fl.trainer, torch.tensor([t for s in seqs for t in s]),
                                SeqBatch.from_lengths([len(s) for s in seqs])).tolist()
            start = 0
            for (prompt, g), seq in zip(group, seqs):
                ours = lp[start + len(prompt):start + len(seq)]
                assert ours == g.logprobs, (g.server, v)
                checked += len(ours)
                start += len(seq)
    print(f"\n{len(ADMITTED)} admitted samples, {checked} tokens replayed bit-exact at their tagged versions")


# -- a slow request is not a dead server ------------------------------------------------------------------
def test_single_generator_survives_a_read_timeout(fl: Fleet) -> None:
    """Issue 23, risk 7: a run with one generator, whose request times out on the client (the proxy holds it
    3 s; the client reads for 1 s) while the server itself is fine. The server stays in the pool (the
    request failed, not the server), the retry goes to it and its sample is admitted, instead of an empty
    pool and a run that waits out ``wait_s`` and dies."""
    import requests

    proxy = fl.proxies[1]
    doc = requests.get(f"{proxy.url}/titan/v1/weights/version", timeout=30).json()
    fleet = GeneratorFleet(WeightPusher([proxy.url], TOKEN))
    fleet.verify(proxy.url, doc["version"], doc["boot_id"])

    async def run() -> Generation:
        client = GeneratorClient(proxy.url, str(fl.model_dir), timeout_s=1.0)
        try:
            return await FleetClient(fleet, {proxy.url: client}, wait_s=5).generate(_prompt(7000), SAMPLING)
        finally:
            await client.aclose()

    proxy.stall_completions, proxy.delay_s = 1, 3.0
    t0 = time.perf_counter()
    gen = asyncio.run(run())
    took = time.perf_counter() - t0
    assert proxy.stall_completions == 0, "the stalled request never reached the proxy"
    assert took >= 1.0 and gen.server == proxy.url and len(gen.token_ids) == SAMPLING.max_tokens
    assert set(gen.versions) == {doc["version"]} and fleet.live() == [proxy.url] and fleet.refused == 0
    # the abandoned request still reaches the server after its stall: let it finish before the next test
    # pauses this server's scheduler (it would wait there too)
    assert proxy.stalled_forwarded.wait(30)
    print(f"\nread timeout on the only generator: retried on it, admitted after {took:.1f} s, still in the pool")


# -- the prefill-time salt -------------------------------------------------------------------------------
def test_request_waiting_across_a_keep_swap_gets_the_new_salt(fl: Fleet) -> None:
    """Warm the prefix cache with prompt P on one server, pause its scheduler (the dev route: the request
    passes the API server, is salted with the current version and waits in the engine), push a new version
    with ``keep`` (it lands between two engine steps, the pause stays), and only then resume. It must not hit P's blocks from the old weights, and
    its logprobs must be what the new weights give from scratch."""
    import requests

    from titan_rl_ext.kernels.batch_invariant import batch_invariant
    from titan_rl_ext.models.common.batch import SeqBatch
    from titan_rl_ext.rl.logprobs import token_logprobs

    srv, url = fl.servers[1], fl.proxies[1].url
    base = srv.base
    version = requests.get(f"{base}/titan/v1/weights/version", timeout=30).json()["version"]
    prompt = _prompt(9000) * 40  # several full prefix-cache blocks
    prompt = prompt[:400]
    body = {"model": str(fl.model_dir), "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_token_ids": True}

    def complete() -> dict[str, Any]:
        r = requests.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    complete()
    warm = complete()
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the cache works for this prompt

    # vLLM's dev routes need the push token while pushes are on (without it: 401, nothing paused)
    assert requests.post(f"{base}/pause", params={"mode": "keep"}, timeout=60).status_code == 401
    assert requests.post(f"{base}/collective_rpc", json={"method": "titan_weight_checksums"}, timeout=60).status_code == 401
    assert requests.get(f"{base}/is_paused", timeout=60).status_code == 401
    dev = {"Authorization": f"Bearer {TOKEN}"}
    assert requests.get(f"{base}/is_paused", headers=dev, timeout=60).json()["is_paused"] is False
    r = requests.post(f"{base}/pause", params={"mode": "keep", "clear_cache": "false"}, headers=dev, timeout=60)
    assert r.status_code == 200, r.text
    waiting: dict[str, Any] = {}
    t = threading.Thread(target=lambda: waiting.update(complete()))
    t.start()
    time.sleep(3.0)  # through the API server and into the engine's waiting queue (it cannot be scheduled)
    assert not waiting, "the request ran while the scheduler was paused"
    new = version + 1
    fl.weights[new] = _scaled(fl.reference, new)
    (answer,) = WeightPusher([url], TOKEN).push(fl.weights[new], new, mode="keep")  # between two engine steps
    assert not waiting, "the request ran before the scheduler was resumed"
    # the engine core held it, waiting, salted for the old version, when the swap landed: re-salted there
    assert answer["resalted"] == 1, answer
    r = requests.post(f"{base}/resume", headers=dev, timeout=60)  # the operator's pause is left to the operator
    assert r.status_code == 200, r.text
    t.join(120)
    assert waiting, "the waiting request never finished"
    choice = waiting["choices"][0]
    assert choice["titan_weight_spans"] == [[new, 0, 4]], choice.get("titan_weight_spans")
    assert waiting["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, waiting["usage"]
    with torch.no_grad(), batch_invariant():
        fl.trainer.load_state_dict(fl.weights[new])
        seq = prompt + choice["token_ids"]
        lp = token_logprobs(fl.trainer, torch.tensor(seq), SeqBatch.from_lengths([len(seq)]))
    assert lp[-4:].tolist() == choice["logprobs"]["token_logprobs"]
    again = complete()  # and the new weights' blocks are cached under the new salt
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
