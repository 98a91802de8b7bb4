"""``titan_ipc`` without a GPU (issue 43): what of the CUDA IPC weight-transfer path runs on CPU.

CUDA IPC handles cannot be made or opened here, so the handles themselves are stood in for: the engine's
``_opened`` hands back CPU tensors, the trainer's ``export_tensors`` a manifest of the right shape. What is tested
is everything around them: the trainer's options and its refusal on a host without CUDA (at start-up, naming the
problem), the update info's refusals (exactly one kind of handles, unpacked only, a manifest that says what the
names say, no pickle without vLLM's opt-in), the engine's staging (copies, not the trainer's memory; one name
format and no tensor twice per update; nothing staged of a chunk that failed; start, finish and shutdown clear
it) and its hand-over to the commit, its place in vLLM's factory, and the trainer's call sequence against a
fake generator. The GPU run is ``tests/gpu/ipc_engine_swap.py``.
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import pytest
import torch

URL = "http://h:1"


def _manifest(tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """What ``wire.cuda_ipc.export_tensors`` sends for ``tensors``, with made-up handle bytes (valid to
    ``manifest_spec``; no GPU could open them)."""
    from titan_rl_ext.wire.cuda_ipc import FORMAT

    entries = {}
    for name, t in tensors.items():
        entries[name] = {
            "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "stride": list(t.contiguous().stride()) if t.dim() else [], "offset": 0, "device_uuid": "GPU-test",
            "handle": "b:" + base64.b64encode(name.encode()).decode(), "storage_bytes": t.numel() * t.element_size(),
            "storage_offset_bytes": 0, "ref_counter_handle": None, "ref_counter_offset": 0, "event_handle": None,
            "event_sync_required": False}
    return {"format": FORMAT, "tensors": entries}


def _meta(tensors: Mapping[str, torch.Tensor], **extra: Any) -> dict[str, Any]:
    return {"names": list(tensors), "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()], **extra}


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16),
            "i": torch.randint(0, 9, (2,), generator=g)}


# -- the trainer's options ---------------------------------------------------------------------------------------
def test_options_are_checked_and_a_host_without_cuda_is_refused_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from titan_rl_ext.rl.config import RLConfig
    from titan_rl_ext.rl.trainer import RLTrainer
    from titan_rl_ext.rl.transports import check_transport_options, make_transport, vllm_ipc

    check = vllm_ipc.check_option_values
    assert check({}) == {"bucket_bytes": 256 << 20, "timeout_s": 60.0}
    assert check({"bucket_bytes": 1024, "timeout_s": 5}) == {"bucket_bytes": 1024, "timeout_s": 5.0}
    for opts, match in [({"port": 1}, r"unknown transport options \['port'\]"),
                        ({"engine_backend": "titan_nccl"}, "unknown transport options"),
                        ({"bucket_bytes": 0}, "'bucket_bytes' must be an integer >= 1"),
                        ({"bucket_bytes": True}, "'bucket_bytes' must be an integer >= 1"),
                        ({"bucket_bytes": "1"}, "'bucket_bytes' must be an integer >= 1"),
                        ({"timeout_s": 0}, "'timeout_s' must be"), ([1], "must be a JSON object")]:
        with pytest.raises(ValueError, match=match):
            check(opts)  # type: ignore[arg-type]

    # no CUDA: refused by name, wherever the options are first read -- the trainer's start-up included
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cuda = r"titan_ipc needs CUDA on the trainer .* torch.cuda.is_available\(\) is False"
    with pytest.raises(ValueError, match=cuda):
        check_transport_options("titan_ipc", {})
    with pytest.raises(ValueError, match="'bucket_bytes' must be"):  # a bad value is named before the host
        check_transport_options("titan_ipc", {"bucket_bytes": -1})

    class Link:
        transport_options: dict[str, Any] = {"bucket_bytes": 64}

        def dev_post(self, *a: Any) -> Any: ...

        def boot_id(self, url: str) -> str: ...

    with pytest.raises(ValueError, match=cuda):
        make_transport("titan_ipc", Link())  # type: ignore[arg-type]
    rl = RLConfig(model_dir="unused", generator_urls=["http://127.0.0.1:1"], weight_transport="titan_ipc")
    with pytest.raises(ValueError, match=cuda):
        RLTrainer(RLTrainer.Config(rl=rl))

    monkeypatch.setattr(vllm_ipc, "cuda_problem", lambda: None)  # as on a GPU host
    t = make_transport("titan_ipc", Link())  # type: ignore[arg-type]
    assert (t.name, t.bucket_bytes, t.address, t.port) == ("titan_ipc", 64, None, 0)  # no store, no port


# -- the engine's update info ------------------------------------------------------------------------------------
def test_update_info_refuses_what_it_cannot_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    from vllm_titan_plugin.swap.transfer_engine import TitanIpcInitInfo, TitanIpcUpdateInfo

    ts = _tensors()
    assert TitanIpcInitInfo().packed is False  # vLLM 0.32's trainer sends {"packed": false}
    with pytest.raises(ValueError, match="unpacked transfers only"):
        TitanIpcInitInfo(packed=True)

    info = TitanIpcUpdateInfo(**_meta(ts, ipc_manifest=_manifest(ts), name_format="titan"))
    assert info.names == list(ts) and info.ipc_handles is None
    for extra, match in [
        ({}, "exactly one of ipc_manifest, ipc_handles, ipc_handles_pickled; got none"),
        ({"ipc_manifest": _manifest(ts), "ipc_handles": [{}] * 3}, r"exactly one .* got \['ipc_manifest', 'ipc_handles'\]"),
        ({"ipc_manifest": _manifest(ts), "packed": True}, "unpacked transfers only"),
        ({"ipc_handles": [{}], "tensor_sizes": [48]}, "unpacked transfers only"),
        ({"ipc_handles": [{}, {}]}, "one entry per name"),
        ({"ipc_manifest": _manifest(ts), "name_format": "megatron"}, "name_format"),
        ({"ipc_manifest": ["not", "an", "object"]}, "ipc_manifest must be an object"),
        ({"ipc_manifest": {**_manifest(ts), "format": "other/1"}}, "manifest format must be"),
        # the manifest opens what the names, dtypes and shapes do not say: refused, naming the tensors
        ({"ipc_manifest": _manifest({**ts, "w": torch.zeros(3, 4)})}, r"does not match .* for: w"),
        ({"ipc_manifest": _manifest({**ts, "w": ts["w"].double()})}, r"does not match .* for: w"),
        ({"ipc_manifest": _manifest({**ts, "extra": torch.zeros(1)})}, r"does not match .* for: extra"),
        ({"ipc_manifest": _manifest({"w": ts["w"]})}, r"does not match .* for: b, i"),
    ]:
        with pytest.raises(ValueError, match=match):
            TitanIpcUpdateInfo(**_meta(ts, **extra))
    with pytest.raises(ValueError, match="differ in length"):
        TitanIpcUpdateInfo(**{**_meta(ts, ipc_manifest=_manifest(ts)), "shapes": [[4, 3]]})

    # vLLM's own trainer's field: a pickle, so only with vLLM's opt-in (as vLLM's ipc engine)
    handles = [{"GPU-test": ("args", i)} for i in range(3)]
    pickled = base64.b64encode(pickle.dumps(handles)).decode()
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    with pytest.raises(ValueError, match="VLLM_ALLOW_INSECURE_SERIALIZATION=1"):
        TitanIpcUpdateInfo(**_meta(ts, ipc_handles_pickled=pickled))
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    info = TitanIpcUpdateInfo(**_meta(ts, ipc_handles_pickled=pickled))
    assert info.ipc_handles == handles and info.ipc_handles_pickled is None
    short = base64.b64encode(pickle.dumps(handles[:2])).decode()
    with pytest.raises(ValueError, match="one entry per name"):
        TitanIpcUpdateInfo(**_meta(ts, ipc_handles_pickled=short))


# -- the engine: staging, and its hand-over to the commit -------------------------------------------------------
def _engine(monkeypatch: pytest.MonkeyPatch, sources: dict[str, torch.Tensor]) -> Any:
    """A ``titan_ipc`` engine on CPU whose handles "open" to ``sources``' tensors themselves (the trainer's
    memory, as an opened handle is)."""
    from vllm_titan_plugin.swap.transfer_engine import TitanIpcWeightTransferEngine

    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(rank=0), model_config=None)
    engine = TitanIpcWeightTransferEngine(SimpleNamespace(backend="titan_ipc"), vllm_config, torch.device("cpu"),
                                          torch.nn.Linear(1, 1))

    def opened(info: Any) -> list[torch.Tensor]:
        return [sources[n] for n in info.names]

    monkeypatch.setattr(engine, "_opened", opened)
    return engine


def _chunk(tensors: Mapping[str, torch.Tensor], name_format: str = "titan") -> dict[str, Any]:
    return _meta(tensors, ipc_manifest=_manifest(tensors), name_format=name_format)


def test_engine_stages_copies_and_refuses_mixed_or_repeated_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    src = _tensors()
    sent = {k: v.clone() for k, v in src.items()}
    engine = _engine(monkeypatch, src)
    with pytest.raises(RuntimeError, match="call init_weight_transfer_engine first"):
        engine.update_weights(_chunk({"w": src["w"]}))
    engine.init_transfer_engine(engine.parse_init_info({"packed": False}))
    engine.start_weight_update()
    engine.update_weights(_chunk({"w": src["w"], "b": src["b"]}))
    engine.update_weights(_chunk({"i": src["i"]}))
    assert list(engine.staged) == ["w", "b", "i"] and engine.staged_format == "titan"
    # copies: the trainer may free or rewrite its tensors once update_weights has answered
    for t in src.values():
        t.add_(1)
    for n, t in engine.staged.items():
        assert t.dtype == sent[n].dtype and torch.equal(t, sent[n]), n
        assert t.data_ptr() != src[n].data_ptr(), n

    with pytest.raises(ValueError, match="mixes 'titan' and 'hf' names"):
        engine.update_weights(_chunk({"x": src["w"]}, name_format="hf"))
    with pytest.raises(ValueError, match="tensors sent twice in one weight update: w"):
        engine.update_weights(_chunk({"w": src["w"]}))
    with pytest.raises(ValueError, match="tensors sent twice"):  # twice within one chunk
        engine.receive_weights(engine.parse_update_info({
            "names": ["x", "x"], "dtype_names": ["float32"] * 2, "shapes": [[4, 3]] * 2,
            "ipc_manifest": _manifest({"x": src["w"]}), "name_format": "titan"}))
    assert list(engine.staged) == ["w", "b", "i"]  # the refused chunks staged nothing

    # a handle that fails to open part-way through a chunk: none of that chunk is staged
    def half_opened(info: Any) -> list[torch.Tensor]:
        raise ValueError("the sender's GPU GPU-test is not visible in this process")

    monkeypatch.setattr(engine, "_opened", half_opened)
    with pytest.raises(ValueError, match="not visible"):
        engine.update_weights(_chunk({"y": src["w"]}))
    assert "y" not in engine.staged

    engine.start_weight_update()  # an earlier, never-committed update is dropped here
    assert engine.staged == {} and engine.staged_format is None
    monkeypatch.setattr(engine, "_opened", lambda info: [src[n] for n in info.names])
    engine.update_weights(_chunk({"w": src["w"]}, name_format="hf"))  # a new session may use the other format
    engine.finish_weight_update()
    assert engine.staged == {} and engine.staged_format is None
    engine.update_weights(_chunk({"w": src["w"]}))
    engine.shutdown()
    assert engine.staged == {} and not engine.joined


def test_commit_takes_the_ipc_engines_staging(monkeypatch: pytest.MonkeyPatch) -> None:
    """``titan_commit_transfer`` reads the ``titan_ipc`` engine's staging as it reads ``titan_gloo``'s: our
    trainer's titan names go to the checked copy as staged, and the staging is gone afterwards."""
    pytest.importorskip("vllm")
    from vllm_titan_plugin.swap import targets, transfer_engine

    src = _tensors()
    engine = _engine(monkeypatch, src)
    worker = SimpleNamespace(weight_transfer_engine=engine)
    engine.init_transfer_engine(engine.parse_init_info({}))
    engine.start_weight_update()
    got = transfer_engine.staged_commit(worker)
    assert isinstance(got, dict) and got["status"] == 422 and "no tensors were received" in got["problems"][0]

    engine.update_weights(_chunk(src))
    copied: dict[str, torch.Tensor] = {}

    def checked_copy(target: Any, titan: dict[str, torch.Tensor]) -> int:
        assert target == "the served model"
        copied.update(titan)
        return len(titan)

    monkeypatch.setattr(targets, "target_of", lambda w: "the served model")
    monkeypatch.setattr(transfer_engine, "_checked_copy", checked_copy)
    assert transfer_engine.staged_commit(worker) == 3
    assert all(torch.equal(copied[n], src[n]) for n in src)
    assert engine.staged == {} and engine.staged_format is None

    other = transfer_engine.staged_commit(SimpleNamespace(weight_transfer_engine=object()))
    assert isinstance(other, dict) and other["status"] == 409 and "titan_ipc" in other["problems"][0]


def test_engine_is_registered_in_vllms_factory() -> None:
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from vllm_titan_plugin.swap import transfer_commit, transfer_engine

    transfer_engine.register()  # idempotent: a second registration of a name would raise in vLLM's factory
    assert WeightTransferEngineFactory._registry["titan_ipc"]() is transfer_engine.TitanIpcWeightTransferEngine
    assert WeightTransferEngineFactory._registry["titan_gloo"]() is transfer_engine.TitanGlooWeightTransferEngine
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(rank=0), model_config=None)
    engine = WeightTransferEngineFactory.create_engine(SimpleNamespace(backend="titan_ipc"), vllm_config,
                                                       torch.device("cpu"), torch.nn.Linear(1, 1))
    assert isinstance(engine, transfer_engine.TitanIpcWeightTransferEngine)
    # the API server's commit path names the engines without importing them: the two lists must agree
    assert set(transfer_commit.BACKENDS) == {*transfer_engine.TORCH_BACKEND, transfer_engine.IPC_NAME}


# -- the trainer's call sequence ---------------------------------------------------------------------------------
class FakeGenerator:
    """The pusher's link to one generator: records each call; ``refuse``: (path, nth call of it) answered 500."""

    transport_options: dict[str, Any] = {"bucket_bytes": 64}

    def __init__(self, refuse: tuple[str, int] | None = None) -> None:
        self.calls: list[tuple[str, Any, Any, Any]] = []
        self.boot = "boot-1"
        self.refuse = refuse

    def boot_id(self, url: str) -> str:
        return self.boot

    def dev_post(self, url: str, path: str, body: Any = None, boot: Any = None, params: Any = None) -> Any:
        self.calls.append((path, body, boot, params))
        if self.refuse is not None and (path, sum(c[0] == path for c in self.calls)) == self.refuse:
            return {"url": url, "ok": False, "status": 500, "error": "the worker refused"}
        return {"url": url, "ok": True, "status": 200, "response": {}}


@pytest.fixture
def ipc_trainer(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The trainer's CUDA calls on CPU: a GPU host to the option check; exports are fake manifests whose
    tensors are tracked until released; synchronize and ipc_collect counted."""
    from titan_rl_ext.rl.transports import vllm_ipc
    from titan_rl_ext.wire import cuda_ipc

    seen: dict[str, Any] = {"exported": [], "synchronize": 0, "ipc_collect": 0}

    def export_tensors(sd: Mapping[str, torch.Tensor]) -> tuple[dict[str, Any], list[torch.Tensor]]:
        seen["exported"].append(list(sd))
        return _manifest(sd), list(sd.values())

    monkeypatch.setattr(vllm_ipc, "cuda_problem", lambda: None)
    monkeypatch.setattr(cuda_ipc, "export_tensors", export_tensors)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: seen.__setitem__("synchronize", seen["synchronize"] + 1))
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: seen.__setitem__("ipc_collect", seen["ipc_collect"] + 1))
    return seen


def test_trainer_makes_vllms_calls_with_a_manifest_per_bucket(ipc_trainer: dict[str, Any]) -> None:
    from titan_rl_ext.rl.transports import make_transport

    gen = FakeGenerator()
    t = make_transport("titan_ipc", gen)  # type: ignore[arg-type]
    sd = _tensors()  # 48 + 10 + 16 bytes in 64-byte buckets: [w, b], [i]
    got = t.push_all([URL], sd, {"version": "3", "mode": "recompute"})  # type: ignore[attr-defined]
    assert got[0]["ok"] and got[0]["response"]["transport"] == "titan_ipc"
    assert got[0]["response"]["num_buckets"] == 2 and got[0]["response"]["version"] == 3
    paths = [c[0] for c in gen.calls]
    assert paths == ["/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/update_weights",
                     "/finish_weight_update"]
    assert gen.calls[0][1] == {"init_info": {}}  # nothing to rendezvous
    assert all(c[2] == "boot-1" for c in gen.calls)  # every call signed for the generator's boot
    assert gen.calls[-1][1:] == ({"weight_version": "3"}, "boot-1", {"mode": "recompute"})
    assert ipc_trainer["exported"] == [["w", "b"], ["i"]] and ipc_trainer["ipc_collect"] == 1
    assert ipc_trainer["synchronize"] == 2  # each bucket's bytes are written before its handles go out

    # what the trainer sends is what the engine takes (names, dtypes, shapes, the manifest; our titan names)
    pytest.importorskip("vllm")
    from vllm_titan_plugin.swap.transfer_engine import TitanIpcUpdateInfo

    for path, body, _, _ in gen.calls:
        if path == "/update_weights":
            info = TitanIpcUpdateInfo(**body["update_info"])
            assert info.name_format == "titan" and info.ipc_manifest is not None and not info.packed

    # the next version: no init while the generator's boot is the same; a new boot is initialised, signed for it
    gen.calls.clear()
    t.push_all([URL], sd, {"version": "4"})  # type: ignore[attr-defined]
    assert [c[0] for c in gen.calls][0] == "/start_weight_update"
    gen.boot, gen.calls = "boot-2", []
    t.push_all([URL], sd, {"version": "5"})  # type: ignore[attr-defined]
    assert gen.calls[0][0] == "/init_weight_transfer_engine" and all(c[2] == "boot-2" for c in gen.calls)


def test_a_refused_bucket_commits_nothing(ipc_trainer: dict[str, Any]) -> None:
    from titan_rl_ext.rl.transports import make_transport

    gen = FakeGenerator(refuse=("/update_weights", 2))
    t = make_transport("titan_ipc", gen)  # type: ignore[arg-type]
    got = t.push_all([URL], _tensors(), {"version": "7"})  # type: ignore[attr-defined]
    assert not got[0]["ok"] and "the worker refused" in str(got[0]["error"])
    finishes = [c[1] for c in gen.calls if c[0] == "/finish_weight_update"]
    assert finishes and all("weight_version" not in (b or {}) for b in finishes)  # the session closed, no commit
    assert ipc_trainer["ipc_collect"] == 1  # the exports are released on the failed push too
    # the failed push forgot the generator's init: the next one initialises it again
    gen.refuse, gen.calls = None, []
    assert t.push_all([URL], _tensors(), {"version": "7"})[0]["ok"]  # type: ignore[attr-defined]
    assert gen.calls[0][0] == "/init_weight_transfer_engine"
