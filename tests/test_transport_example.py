"""A new weight transport is one file: this one registers itself, and the pusher and the fleet push through
it by name with no other edit. It delivers into in-process "generators" (no server, no engine), and shows
the four steps a push runs: stage once, send to each generator, commit, or abort when sending raises."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch

from titan_rl_ext.rl.fleet import GeneratorFleet
from titan_rl_ext.rl.samples import Generation
from titan_rl_ext.rl.transports import register_transport, transport_names
from titan_rl_ext.rl.transports.base import Link, PushResult, Staged
from titan_rl_ext.rl.weight_sync import WeightPusher, WeightPushError

GENERATORS: dict[str, dict[str, Any]] = {}  # url -> what that in-process generator serves
LOG: list[str] = []


@register_transport("test_memory")
class MemoryTransport:
    """Hands every generator the staged tensors themselves; a generator whose URL says ``down`` refuses,
    one that says ``raise`` makes sending raise (an interrupted push)."""

    def __init__(self, link: Link) -> None:
        self.link = link  # unused: nothing goes over HTTP

    def stage(self, state_dict: Mapping[str, torch.Tensor]) -> Staged:
        LOG.append("stage")
        return Staged(b"", hold={k: v.detach().clone() for k, v in state_dict.items()})

    def send(self, staged: Staged, url: str, params: Mapping[str, str]) -> PushResult:
        if "raise" in url:
            raise RuntimeError("connection lost mid-push")
        if "down" in url:
            return {"url": url, "ok": False, "status": 503, "error": "down"}
        GENERATORS[url] = {"version": int(params["version"]), "weights": staged.hold}
        return {"url": url, "ok": True, "status": 200,
                "response": {"version": int(params["version"]), "boot_id": f"boot-{url}"}}

    def commit(self, staged: Staged) -> None:
        LOG.append("commit")
        staged.hold = None

    def abort(self, staged: Staged) -> None:
        LOG.append("abort")
        staged.hold = None


@pytest.fixture(autouse=True)
def _clean() -> None:
    GENERATORS.clear()
    LOG.clear()


def test_registered_by_its_own_file() -> None:
    assert {"safetensors", "cuda_ipc", "test_memory"} <= set(transport_names())


def test_fleet_pushes_through_it() -> None:
    urls = ["mem://a", "mem://b-down"]
    fleet = GeneratorFleet(WeightPusher(urls, "token", transport="test_memory"))
    weights = {"w": torch.arange(4.0)}
    outcome = fleet.push(weights, 3)
    assert LOG == ["stage", "commit"]
    assert outcome.live == ["mem://a"] and list(outcome.out) == ["mem://b-down"]
    assert GENERATORS["mem://a"]["version"] == 3 and torch.equal(GENERATORS["mem://a"]["weights"]["w"], weights["w"])
    sample = Generation(token_ids=[1], logprobs=[0.0], versions=[3], server="mem://a", boot_id="boot-mem://a")
    assert fleet.admit(sample) is None
    with pytest.raises(WeightPushError, match="no generator serves it"):
        GeneratorFleet(WeightPusher(["mem://down"], "token", transport="test_memory")).push(weights, 4)


def test_interrupted_push_aborts() -> None:
    pusher = WeightPusher(["mem://a", "mem://raise"], "token", transport="test_memory")
    with pytest.raises(RuntimeError, match="mid-push"):
        pusher.push({"w": torch.zeros(2)}, 1)
    assert LOG == ["stage", "abort"]


def test_unknown_transport_names_the_registered_ones() -> None:
    with pytest.raises(ValueError, match="registered: .*safetensors"):
        WeightPusher(["mem://a"], "token", transport="carrier_pigeon")
    with pytest.raises(ValueError, match="stages its own"):
        WeightPusher(["mem://a"], "token", transport="test_memory").push_payload(b"", 1)
