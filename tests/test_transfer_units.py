"""The broadcast push's pieces without servers (issue 43): packed buckets, the groups' layout, bad input.

``wire.collective``'s packing must give back every tensor bit for bit (any dtype, empty and odd-sized ones) from
metadata alone; the transport's buckets and its relay topology (one lead per host, followers ranked after it);
the engine's init and update infos refuse what they cannot use with a message naming it; and two processes'
worth of groups on one store (the trainer's and a host's) carry a packed bucket through a lead to a follower;
``--rl.weight_transport_options`` is refused at the trainer's start when wrong and reaches the transport when right.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from titan_rl_ext.wire import collective


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 5, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16),
            "empty": torch.empty(0, 4), "c": torch.randint(0, 9, (3,), generator=g, dtype=torch.int64),
            "d": torch.randn(2, 3, generator=g).to(torch.float16)}


def test_pack_unpack_is_bit_exact_from_metadata() -> None:
    ts = _tensors()
    buf = collective.pack(list(ts.values()))
    spans, total = collective.packed_layout([t.dtype for t in ts.values()], [list(t.shape) for t in ts.values()])
    assert buf.dtype == torch.uint8 and buf.numel() == total
    assert all(off % collective.ALIGN_BYTES == 0 for off, _ in spans)
    back = collective.unpack(buf, [t.dtype for t in ts.values()], [list(t.shape) for t in ts.values()])
    for (name, t), u in zip(ts.items(), back):
        assert u.dtype == t.dtype and torch.equal(u, t), name
    with pytest.raises(ValueError, match="bytes"):
        collective.unpack(buf[:-1], [t.dtype for t in ts.values()], [list(t.shape) for t in ts.values()])


def test_buckets_and_relay_topology() -> None:
    from titan_rl_ext.rl.transports import make_transport
    from titan_rl_ext.rl.transports.vllm_transfer import Topology

    class FakeLink:
        transport_options = {"bucket_bytes": 64}

        def dev_post(self, *a: Any) -> Any: ...

        def boot_id(self, url: str) -> str: ...

    t = make_transport("titan_gloo_relay", FakeLink())  # type: ignore[arg-type]
    ts = _tensors()
    buckets = t.buckets(ts)
    assert [n for b in buckets for n in b.names] == list(ts)  # every tensor once, in order
    assert all(b.nbytes <= 64 or len(b.names) == 1 for b in buckets)
    assert all(b.info()["packed"] and b.info()["name_format"] == "titan" for b in buckets)

    urls = ["http://h1:1", "http://h2:1", "http://h1:2", "http://h1:3"]
    topo = t._topology_of({u: f"boot-{i}" for i, u in enumerate(urls)})
    assert topo.leads == ["http://h1:1", "http://h2:1"]
    assert topo.followers == {"http://h1:1": ["http://h1:2", "http://h1:3"], "http://h2:1": []}
    infos = topo.init_infos("10.0.0.1", 4000, "titan/x/1", 30.0)
    assert infos["http://h1:1"]["rank_offset"] == 1 and infos["http://h2:1"]["rank_offset"] == 2
    assert all(i.get("world_size") in (None, 3) for i in infos.values())  # trainer + 2 leads
    assert infos["http://h1:1"]["relay_rank"] == 0 and infos["http://h1:3"]["relay_rank"] == 2
    assert "relay_group" not in infos["http://h2:1"]  # alone on its host: a plain member
    flat = Topology({u: "b" for u in urls}, list(urls)).init_infos("a", 1, "p", 1.0)
    assert sorted(i["rank_offset"] for i in flat.values()) == [1, 2, 3, 4]

    with pytest.raises(ValueError, match="unknown transport options"):
        class Bad(FakeLink):
            transport_options = {"bucket_mb": 1}

        make_transport("titan_gloo", Bad())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dev_post"):
        make_transport("titan_gloo", object())  # type: ignore[arg-type]


def test_engine_infos_refuse_bad_input() -> None:
    pytest.importorskip("vllm")
    from vllm_titan_plugin.swap.transfer_engine import TitanGlooInitInfo, TitanGlooUpdateInfo

    ok = dict(master_address="127.0.0.1", master_port=4000, rank_offset=1, world_size=2)
    TitanGlooInitInfo(**ok)
    assert TitanGlooInitInfo(master_address="a", master_port=1, group_name="g", relay_group="h", relay_rank=1,
                             relay_size=2).follower
    for bad, match in [({"rank_offset": 0}, "rank_offset"), ({"world_size": 1}, "world_size"),
                       ({"relay_group": "h", "relay_size": 2}, "group_name"),
                       ({"group_name": "g", "relay_group": "h", "relay_size": 1}, "relay_size"),
                       ({"group_name": "g", "relay_group": "h", "relay_size": 2, "relay_rank": 2}, "relay_rank"),
                       ({"group_name": ""}, "group_name"), ({"timeout_s": 0}, "timeout_s")]:
        with pytest.raises(ValueError, match=match):
            TitanGlooInitInfo(**{**ok, **bad})
    TitanGlooUpdateInfo(names=["a"], dtype_names=["float32"], shapes=[[2]], packed=True, name_format="titan")
    with pytest.raises(ValueError, match="name_format"):
        TitanGlooUpdateInfo(names=["a"], dtype_names=["float32"], shapes=[[2]], name_format="megatron")
    with pytest.raises(ValueError, match="packed"):
        TitanGlooUpdateInfo(names=["a"], dtype_names=["float32"], shapes=[[2]], packed="yes")  # type: ignore[arg-type]


def test_lead_relays_a_packed_bucket_to_its_follower_on_one_store() -> None:
    """Trainer (rank 0) -> lead (trainer group rank 1, host group rank 0) -> follower (host group rank 1),
    every group on the trainer's one store; threads stand in for the processes."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from vllm_titan_plugin.swap import relay  # the engine side's fanout (imports vLLM through its package)

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20),
                     multi_tenant=True)
    ts = list(_tensors().values())
    dtypes, shapes = [t.dtype for t in ts], [list(t.shape) for t in ts]
    got: dict[str, Any] = {}

    def lead() -> None:
        client = collective.client_store("127.0.0.1", store.port, 20)
        net = collective.process_group(client, "run/1/net", 1, 2, "gloo", 20)
        host = relay.make_fanout(client, "run/1/host0", 0, 2, "gloo", 20)
        buf = torch.empty(collective.packed_layout(dtypes, shapes)[1], dtype=torch.uint8)
        net.broadcast(buf, 0).wait()
        host.pass_on(buf)
        got["lead"] = collective.unpack(buf, dtypes, shapes)

    def follower() -> None:
        client = collective.client_store("127.0.0.1", store.port, 20)
        host = relay.make_fanout(client, "run/1/host0", 1, 2, "gloo", 20)
        buf = torch.empty(collective.packed_layout(dtypes, shapes)[1], dtype=torch.uint8)
        host.take(buf)
        got["follower"] = collective.unpack(buf, dtypes, shapes)

    threads = [threading.Thread(target=fn) for fn in (lead, follower)]
    for th in threads:
        th.start()
    trainer = collective.process_group(store, "run/1/net", 0, 2, "gloo", 20)
    trainer.broadcast(collective.pack(ts), 0).wait()
    for th in threads:
        th.join(30)
    for who in ("lead", "follower"):
        assert all(torch.equal(a, b) for a, b in zip(got[who], ts)), who
    with pytest.raises(ValueError, match="backend"):
        collective.process_group(store, "x", 0, 1, "mpi", 1)


def test_transport_options_are_checked_at_start_up_and_reach_the_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--rl.weight_transport_options``: a bad key or value stops the trainer in ``__init__`` (before any model is
    built), naming it; good ones reach the ``titan_gloo`` transport the generator link builds (no server)."""
    from titan_rl_ext.rl import generator_link
    from titan_rl_ext.rl.config import RLConfig
    from titan_rl_ext.rl.generator_link import GeneratorLink
    from titan_rl_ext.rl.trainer import RLTrainer

    for transport, options, match in [
        ("titan_gloo", '{"prot": 29600}', r"unknown transport options \['prot'\]"),
        ("titan_gloo", '{"port": 70000}', "'port' must be an integer in"),
        ("titan_gloo", '{"port": true}', "'port' must be an integer in"),
        ("titan_gloo_relay", '{"engine_backend": "mpi"}', "'engine_backend' must be one of"),
        ("titan_gloo", '{"address": ""}', "'address' must be a host"),
        ("titan_gloo", '{"timeout_s": 0}', "'timeout_s' must be"),
        ("titan_gloo", '[1]', "must be a JSON object"),
        ("titan_gloo", '{port: 1}', "is not JSON"),
        ("safetensors", '{"port": 1}', "'safetensors' takes no options"),
        ("gloo", '{}', "unknown weight transport 'gloo'"),
    ]:
        rl = RLConfig(model_dir="unused", generator_urls=["http://127.0.0.1:1"], weight_transport=transport,
                      weight_transport_options=options)
        with pytest.raises(ValueError, match=match):
            RLTrainer(RLTrainer.Config(rl=rl))

    monkeypatch.setenv("TITAN_TEST_SWAP_TOKEN", "t")
    monkeypatch.setattr(GeneratorLink, "server_info", staticmethod(lambda url: {"version": 0, "boot_id": "b"}))
    monkeypatch.setattr(generator_link, "wait_healthy", lambda url, timeout_s: None)  # as if it answered /health
    monkeypatch.setattr(GeneratorLink, "set_batch_invariant", lambda self, enabled: None)
    rl = RLConfig(model_dir="unused", generator_urls=["http://10.1.2.3:8000"], swap_token_env="TITAN_TEST_SWAP_TOKEN",
                  weight_transport="titan_gloo_relay", weight_transport_options=json.dumps(
                      {"address": "10.0.0.5", "port": 29600, "engine_backend": "titan_nccl", "timeout_s": 7}))
    link = GeneratorLink(rl, Path("unused"))
    assert link.connect(False) == {"http://10.1.2.3:8000": (0, "b")}
    t = link.pusher.transport  # type: ignore[union-attr]
    assert type(t).__name__ == "TitanGlooRelayTransport"
    assert (t.address, t.port, t.backend, t.timeout_s, t.bucket_bytes) == ("10.0.0.5", 29600, "nccl", 7.0, 256 << 20)


def test_finish_query_carries_the_commit_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit's mode: our transport puts the push's ``mode``/``pause`` on each finish's (signed) query;
    the server's ``FinishQuery`` middleware hands that query to the wrapped finish, whose commit runs
    ``locked_swap`` with it; a bad mode or an unknown key is refused (400) before any swap, and the workers'
    update session is closed either way."""
    pytest.importorskip("vllm")
    import asyncio

    from titan_rl_ext.rl.transports import make_transport
    from vllm_titan_plugin.swap import transfer_commit
    from vllm_titan_plugin.swap.orchestrator import SwapDone
    from vllm_titan_plugin.swap.validate import PushRejected

    # the trainer's side: the finish carries the push's mode and pause, nothing else does
    class Link:
        transport_options: dict[str, Any] = {}
        calls: list[tuple[str, Any]] = []

        def dev_post(self, url: str, path: str, body: Any = None, boot: Any = None, params: Any = None) -> Any:
            self.calls.append((path, params))
            return {"url": url, "ok": True, "status": 200, "response": {}}

        def boot_id(self, url: str) -> str:
            return "b"

    link = Link()
    t = make_transport("titan_gloo", link)  # type: ignore[arg-type]
    results: dict[str, Any] = {}
    t._finish(["http://h:1"], {"http://h:1": "b"}, 7, 1, 8, {}, results, {"mode": "recompute", "pause": "1"})
    assert link.calls == [("/finish_weight_update", {"mode": "recompute", "pause": "1"})]
    assert results["http://h:1"]["response"]["mode"] == "recompute"

    # the server's side
    assert transfer_commit.parse_mode(None) == (True, False)  # a foreign trainer's finish: keep, no pause
    assert transfer_commit.parse_mode({"mode": "recompute", "pause": "1"}) == (False, True)
    for query, match in [({"mode": "recomp"}, "mode must be one of"), ({"pause": "yes"}, "'pause' must be 0 or 1"),
                         ({"mdoe": "recompute"}, r"got \['mdoe'\]")]:
        with pytest.raises(PushRejected, match=match) as e:
            transfer_commit.parse_mode(query)
        assert e.value.status == 400

    swaps: list[tuple[int, bool, bool]] = []

    async def fake_swap(state: Any, method: str, arg: Any, version: int, keep_cache: bool, pause: bool = False,
                        partial: bool = False) -> SwapDone:
        swaps.append((version, keep_cache, pause))
        return SwapDone(0.0, 0.0, 0, 0)

    class State:
        async def on_engine_loop(self, coro: Any) -> Any:
            return await coro

    class Engine:
        closed = 0

        async def collective_rpc(self, method: str) -> None:
            assert method == "finish_weight_update"
            self.closed += 1

    monkeypatch.setattr(transfer_commit, "locked_swap", fake_swap)
    engine = Engine()
    seen: list[Any] = []

    async def route(scope: Any, receive: Any, send: Any) -> None:  # stands in for vLLM's route
        seen.append(transfer_commit._FINISH_QUERY.get())
        if scope["path"] == "/finish_weight_update":
            await transfer_commit.commit(engine, State(), "9", transfer_commit._FINISH_QUERY.get())  # type: ignore

    app = transfer_commit.FinishQuery(route)
    scope = {"type": "http", "path": "/finish_weight_update", "query_string": b"mode=recompute&pause=1"}
    asyncio.run(app(scope, None, None))
    asyncio.run(app({**scope, "path": "/other", "query_string": b"mode=recompute"}, None, None))
    assert seen == [{"mode": "recompute", "pause": "1"}, None]  # only the finish route's query is passed down
    assert swaps == [(9, False, True)] and engine.closed == 1
    with pytest.raises(PushRejected, match="mode must be one of"):
        asyncio.run(app({**scope, "query_string": b"mode=fast"}, None, None))
    assert swaps == [(9, False, True)] and engine.closed == 2  # refused before the swap, session closed


# -- a spawned server's flags -------------------------------------------------------------------------------------
BASE_ARGS = ["--dtype", "float32", "--max-model-len", "512"]


def _spawned(transport: str, args: list[str],
             options: dict[str, Any] | None = None) -> tuple[list[str], dict[str, str]]:
    from titan_rl_ext.rl.config import RLConfig

    return RLConfig(model_dir="unused", spawn_server=True, weight_transport=transport, server_args=args,
                    weight_transport_options=json.dumps(options or {})).spawned_server()


def test_spawned_server_is_started_with_the_transports_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transport that pushes into a vLLM transfer engine gets a spawned server with that engine (the backend from
    the transport, ``titan_gloo``'s from its ``engine_backend``), the commit's extension and vLLM's dev routes; the
    HTTP transports' servers are started as the user wrote them; flags the user gave are kept, not doubled."""
    from titan_rl_ext.rl.transports import server_flags, vllm_ipc

    monkeypatch.setattr(vllm_ipc, "cuda_problem", lambda: None)  # as on a GPU host
    ext = [server_flags.EXTENSION_FLAG, server_flags.WORKER_EXTENSION]
    dev = {"VLLM_SERVER_DEV_MODE": "1"}
    for transport in ("safetensors", "cuda_ipc"):
        assert _spawned(transport, BASE_ARGS) == (BASE_ARGS, {})
    for transport, options, engine in [("titan_ipc", {"bucket_bytes": 1024}, "titan_ipc"),
                                       ("titan_gloo", {}, "titan_gloo"),
                                       ("titan_gloo", {"engine_backend": "titan_nccl"}, "titan_nccl"),
                                       ("titan_gloo_relay", {"engine_backend": "titan_nccl"}, "titan_nccl")]:
        args, env = _spawned(transport, BASE_ARGS, options)
        assert args == [*BASE_ARGS, "--weight-transfer-config", json.dumps({"backend": engine}), *ext], transport
        assert env == dev

    # the user's own flags, in each spelling vLLM's parser takes: kept as given, nothing appended twice
    for given in ([*BASE_ARGS, "--weight-transfer-config", '{"backend": "titan_ipc"}', *ext],
                  [*ext, "--weight_transfer_config={\"backend\": \"titan_ipc\"}", *BASE_ARGS],
                  [*BASE_ARGS, "--weight-transfer-config.backend", "titan_ipc", "--worker-extension-cls=my.Ext"]):
        assert _spawned("titan_ipc", given) == (given, dev)
    only_config = [*BASE_ARGS, "--weight-transfer-config", '{"backend": "titan_ipc"}']
    assert _spawned("titan_ipc", only_config)[0] == [*only_config, *ext]


def test_a_server_configured_for_another_engine_is_refused_at_start_up(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    """``rl.server_args`` naming another engine than the transport's stop the trainer in ``__init__`` (before any
    model is built or server spawned), naming both; a spawned server gets the flags and the environment."""
    from titan_rl_ext.rl import generator_server
    from titan_rl_ext.rl.config import RLConfig
    from titan_rl_ext.rl.generator_link import GeneratorLink
    from titan_rl_ext.rl.trainer import RLTrainer
    from titan_rl_ext.rl.transports import vllm_ipc

    monkeypatch.setattr(vllm_ipc, "cuda_problem", lambda: None)
    started: list[tuple[list[str], dict[str, str]]] = []

    class Server:
        def __init__(self, model_dir: str, log: Path, args: list[str], env: dict[str, str], **kw: Any) -> None:
            started.append((list(args), dict(env)))

    monkeypatch.setattr(generator_server, "GeneratorServer", Server)
    for transport, options, args, match in [
        ("titan_ipc", {}, ["--weight-transfer-config", '{"backend": "titan_gloo"}'],
         r"backend 'titan_gloo', but --rl.weight_transport titan_ipc pushes into the 'titan_ipc' engine"),
        ("titan_gloo", {"engine_backend": "titan_nccl"}, ["--weight-transfer-config.backend", "titan_gloo"],
         r"backend 'titan_gloo', but --rl.weight_transport titan_gloo pushes into the 'titan_nccl' engine"),
        ("titan_gloo", {}, ["--weight-transfer-config", "{}"], r"backend 'nccl'"),  # vLLM's default backend
        ("titan_ipc", {}, ["--weight-transfer-config", "{backend: x}"], r"--weight-transfer-config .* is not JSON"),
        ("titan_ipc", {}, ["--weight-transfer-config"], r"with no value"),
    ]:
        rl = RLConfig(model_dir="unused", spawn_server=True, weight_transport=transport, server_args=args,
                      weight_transport_options=json.dumps(options))
        with pytest.raises(ValueError, match=match):
            RLTrainer(RLTrainer.Config(rl=rl))
    # the HTTP transports leave a user's engine flags alone (the server may serve other trainers with them)
    assert _spawned("cuda_ipc", ["--weight-transfer-config", '{"backend": "titan_gloo"}'])[1] == {}
    assert started == []

    monkeypatch.setenv("TITAN_TEST_SWAP_TOKEN", "t")
    rl = RLConfig(model_dir="m", spawn_server=True, weight_transport="titan_ipc", server_args=BASE_ARGS,
                  swap_token_env="TITAN_TEST_SWAP_TOKEN")
    GeneratorLink(rl, tmp_path).spawn(batch_invariant=True)
    [(args, env)] = started
    assert args[:4] == BASE_ARGS and args[args.index("--weight-transfer-config") + 1] == '{"backend": "titan_ipc"}'
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["TITAN_SWAP_TOKEN"] == "t" and env["TITAN_BATCH_INVARIANT"] == "1"
    assert rl.server_args == BASE_ARGS  # the recipe's own list is not changed
