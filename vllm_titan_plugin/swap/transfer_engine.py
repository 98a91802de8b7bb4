"""``titan_gloo``: a vLLM weight-transfer engine (``vllm/distributed/weight_transfer``) for titan servers on CPU
(``titan_nccl``: the same engine over NCCL on GPU; ``titan_ipc``: vLLM's ``ipc`` wire, CUDA IPC handles per
tensor from a trainer on the same host, staged and committed the same way).

A trainer that is not ours drives it with vLLM's own calls (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights`` with HF names, ``/finish_weight_update`` with a
``weight_version``); the tensors arrive by gloo broadcast from the trainer (rank 0). Unlike vLLM's engines,
which load each chunk into the live model as it arrives, this one only *stages* what it receives: the live
weights change in one step at the commit (``titan_commit_transfer``), which the API server runs through the
project's swap path (``swap.transfer_commit``), so the version tag, the re-salted prefix cache and the
all-or-none guarantee are the ones an HTTP push has. A transfer that dies midway leaves a staging area that
is never committed, and the old weights keep serving.

Enabled by the operator, in the server's command line (this module is what both flags name):

    --worker-extension-cls vllm_titan_plugin.swap.transfer_engine.TitanTransferExtension
    --weight-transfer-config '{"backend": "titan_gloo"}'     # or titan_nccl, titan_ipc

The extension is how the engine reaches vLLM's factory inside the worker process: vLLM imports the extension
class before it loads the model, and importing this module registers the engine. Imported only inside vLLM
processes (and tests that have vLLM), so vLLM is imported at module level.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from vllm_titan_plugin.swap import relay
from vllm_titan_plugin.swap.validate import ST_DTYPE, name_list, push_spec, spec_problems

logger = logging.getLogger("vllm.titan_plugin")

NAME = "titan_gloo"
IPC_NAME = "titan_ipc"  # vLLM's ``ipc`` wire (CUDA IPC handles per tensor), staged and committed as titan_gloo's
NCCL_NAME = "titan_nccl"  # the same engine on GPU: the trainer's group is NCCL, tensors land on the worker's device
TORCH_BACKEND = {NAME: relay.GLOO, NCCL_NAME: relay.NCCL}
NAME_FORMATS = ("hf", "titan")
COMMIT_METHOD = "titan_commit_transfer"
DEFAULT_TIMEOUT_S = 120.0
_DTYPES = {str(dt).removeprefix("torch."): dt for dt in ST_DTYPE}  # "float32" -> torch.float32, ...


@dataclass
class TitanGlooInitInfo(WeightTransferInitInfo):
    """The same fields as vLLM's NCCL engine: the trainer hosts the rendezvous store at
    ``master_address:master_port`` as rank 0; this worker joins as ``rank_offset + its rank``.

    Optional fields our trainer (``titan_rl_ext.rl.transports.vllm_transfer``) adds: ``group_name``, a key
    prefix on the trainer's store (it rebuilds groups on one store, so each build needs its own prefix); and
    the per-host relay (``swap.relay``): ``relay_group`` (prefix of this host's local group), ``relay_rank``
    (0: the lead, which is also in the trainer's group; >= 1: a follower, in the local group only) and
    ``relay_size`` (the host's engines)."""

    master_address: str
    master_port: int
    rank_offset: int = 0
    world_size: int = 0
    # per collective (rendezvous, each tensor's broadcast): a trainer that dies mid-transfer would otherwise
    # hold the worker -- and with it the engine core's loop, so generation -- for gloo's default 30 minutes
    timeout_s: float = DEFAULT_TIMEOUT_S
    group_name: str | None = None
    relay_group: str | None = None
    relay_rank: int = 0
    relay_size: int = 0

    @property
    def follower(self) -> bool:
        return self.relay_group is not None and self.relay_rank >= 1

    def __post_init__(self) -> None:
        if not isinstance(self.timeout_s, (int, float)) or not 0 < self.timeout_s <= 3600:
            raise ValueError(f"timeout_s must be a number of seconds in (0, 3600], got {self.timeout_s!r}")
        if not isinstance(self.master_port, int) or not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port number, got {self.master_port!r}")
        for name in ("group_name", "relay_group"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 200):
                raise ValueError(f"{name} must be a non-empty string of at most 200 characters, got {value!r}")
        if self.relay_group is not None:
            if self.group_name is None:
                raise ValueError("relay_group needs group_name (both groups live on the trainer's store)")
            if not isinstance(self.relay_size, int) or self.relay_size < 2:
                raise ValueError(f"relay_size must be >= 2 (the lead and a follower), got {self.relay_size!r}")
            if not isinstance(self.relay_rank, int) or not 0 <= self.relay_rank < self.relay_size:
                raise ValueError(f"relay_rank must be in [0, relay_size={self.relay_size}), got {self.relay_rank!r}")
        if self.follower:
            return  # not in the trainer's group: rank_offset and world_size are not used
        if not isinstance(self.rank_offset, int) or self.rank_offset < 1:
            raise ValueError(f"rank_offset must be >= 1 (rank 0 is the trainer), got {self.rank_offset!r}")
        if not isinstance(self.world_size, int) or self.world_size <= self.rank_offset:
            raise ValueError(f"world_size ({self.world_size!r}) must exceed rank_offset ({self.rank_offset})")


@dataclass
class TitanGlooUpdateInfo(WeightTransferUpdateInfo):
    """One chunk: the tensors the trainer broadcasts next, in this order (HF checkpoint names).

    Optional, from our trainer: ``packed`` (the chunk's tensors travel as one uint8 buffer laid out by
    ``collective.packed_layout``: one collective per chunk instead of one per tensor) and ``name_format``
    (``"titan"``: the names are the served model's own, no HF adapter in between)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool = False
    name_format: str = "hf"

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(f"names, dtype_names and shapes differ in length: {len(self.names)}, "
                             f"{len(self.dtype_names)}, {len(self.shapes)}")
        if bad := sorted({d for d in self.dtype_names if d not in _DTYPES}):
            raise ValueError(f"unknown dtype names {bad}; expected torch names such as 'float32', 'bfloat16'")
        if bad := [n for n, s in zip(self.names, self.shapes)
                   if not isinstance(s, list) or not all(isinstance(d, int) and d >= 0 for d in s)]:
            raise ValueError(f"shapes must be lists of non-negative integers: {name_list(bad)}")
        if self.name_format not in NAME_FORMATS:
            raise ValueError(f"name_format must be one of {NAME_FORMATS}, got {self.name_format!r}")
        if not isinstance(self.packed, bool):
            raise ValueError(f"packed must be true or false, got {self.packed!r}")


def _check_chunk(engine: Any, name: str, names: list[str], name_format: str) -> None:
    """A chunk joins the engine's staging only with the session's name format and no tensor twice."""
    if engine.staged_format not in (None, name_format):
        raise ValueError(f"{name}: one weight update mixes {engine.staged_format!r} and {name_format!r} names")
    if dup := [n for n in names if n in engine.staged] or [n for i, n in enumerate(names) if n in names[:i]]:
        raise ValueError(f"{name}: tensors sent twice in one weight update: {name_list(dup)}")
    engine.staged_format = name_format


class TitanGlooWeightTransferEngine(WeightTransferEngine[TitanGlooInitInfo, TitanGlooUpdateInfo]):
    init_info_cls = TitanGlooInitInfo
    update_info_cls = TitanGlooUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None  # the trainer's broadcast group (None on a relay follower)
        self.fanout: relay.LocalFanout | None = None  # this host's engines, when the trainer uses the relay
        self.lead = False  # in the trainer's group and rank 0 of a host group: passes every buffer on
        self.joined = False
        # name -> received tensor, since the last start_weight_update; only the commit reads it
        self.staged: dict[str, torch.Tensor] = {}
        self.staged_format: str | None = None  # "hf" or "titan": one per update session
        # the backend named in --weight-transfer-config picks the group: gloo into host memory (CPU), or NCCL
        # into the worker's device (GPU); the rest of the engine is the same code
        self.torch_backend = TORCH_BACKEND.get(getattr(config, "backend", NAME), relay.GLOO)
        self.device = torch.device(device) if self.torch_backend == relay.NCCL else torch.device("cpu")

    def init_transfer_engine(self, init_info: TitanGlooInitInfo) -> None:
        if self.joined:  # a second trainer (or a restarted one, or a rebuilt group) replaces the first
            self.shutdown()
        rank = init_info.rank_offset + self.parallel_config.rank
        if init_info.group_name is None:
            # a foreign trainer: vLLM's stateless group (rank 0 hosts the store; this worker only dials it)
            from datetime import timedelta

            from vllm.distributed.utils import stateless_init_torch_distributed_process_group

            self.group = stateless_init_torch_distributed_process_group(
                init_info.master_address, init_info.master_port, rank, init_info.world_size,
                backend=self.torch_backend, timeout=timedelta(seconds=init_info.timeout_s))
            self.joined = True
            return
        # our trainer: every group on its one store, each under its own prefix
        try:
            store = relay.client_store(init_info.master_address, init_info.master_port, init_info.timeout_s)
            if not init_info.follower:
                self.group = relay.process_group(store, init_info.group_name, rank, init_info.world_size,
                                                 self.torch_backend, init_info.timeout_s)
            if init_info.relay_group is not None:
                self.fanout = relay.make_fanout(store, init_info.relay_group, init_info.relay_rank,
                                                init_info.relay_size, self.torch_backend, init_info.timeout_s)
                self.lead = not init_info.follower
        except BaseException:
            self.shutdown()  # a half-joined lead (trainer's group, no host group) holds nothing past this
            raise
        self.joined = True

    def start_weight_update(self) -> None:
        self.staged, self.staged_format = {}, None  # what an earlier, never-committed transfer left is dropped here

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class ends with torch.accelerator.synchronize(), which raises on a CPU-only host
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _receive(self, buf: torch.Tensor) -> None:
        """One buffer from the trainer (directly, or through this host's lead), passed on if this is a lead."""
        if self.group is not None:
            # group-local root 0 (the trainer): torch.distributed.broadcast would translate a global rank
            self.group.broadcast(buf, 0).wait()
            if self.lead and self.fanout is not None:
                self.fanout.pass_on(buf)
        elif self.fanout is not None:
            self.fanout.take(buf)
        else:
            raise RuntimeError(f"{NAME}: no trainer group yet; call init_weight_transfer_engine first")

    def receive_weights(self, update_info: TitanGlooUpdateInfo) -> None:
        if not self.joined:
            raise RuntimeError(f"{NAME}: no trainer group yet; call init_weight_transfer_engine first")
        _check_chunk(self, NAME, update_info.names, update_info.name_format)
        dtypes = [_DTYPES[d] for d in update_info.dtype_names]
        if update_info.packed:
            _, total = relay.packed_layout(dtypes, update_info.shapes)
            buf = torch.empty(total, dtype=torch.uint8, device=self.device)
            self._receive(buf)
            self.staged.update(zip(update_info.names, relay.unpack(buf, dtypes, update_info.shapes)))
            return
        for name, dtype, shape in zip(update_info.names, dtypes, update_info.shapes):
            t = torch.empty(shape, dtype=dtype, device=self.device)
            self._receive(t)
            self.staged[name] = t

    def finish_weight_update(self) -> None:
        # the commit (titan_commit_transfer) has run, or been refused, before this: nothing staged survives
        self.staged, self.staged_format = {}, None

    def shutdown(self) -> None:
        self.staged, self.staged_format = {}, None
        group, self.group = self.group, None
        fanout, self.fanout = self.fanout, None
        self.lead = self.joined = False
        if fanout is not None:
            fanout.close()
        if group is not None:
            try:
                group.shutdown()
            except Exception as e:  # a trainer already gone: the group is dead either way
                logger.warning("titan: closing the %s group: %s", NAME, e)


@dataclass
class TitanIpcInitInfo(WeightTransferInitInfo):
    """vLLM's ``ipc`` init info: nothing to rendezvous. vLLM 0.32's trainer sends ``packed``; only unpacked
    transfers (one handle per tensor) are taken."""

    packed: bool = False

    def __post_init__(self) -> None:
        if self.packed is not False:
            raise ValueError(f"{IPC_NAME} takes unpacked transfers only (one handle per tensor): packed must be "
                             f"false, got {self.packed!r}")


@dataclass
class TitanIpcUpdateInfo(WeightTransferUpdateInfo):
    """vLLM's ``ipc`` update info (names, dtype names, shapes, one handle per tensor: ``ipc_handles``, a list of
    ``{gpu_uuid: rebuild_cuda_tensor args}``, or ``ipc_handles_pickled``, its base64 pickle, which like vLLM's
    engine needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``), or our ``ipc_manifest`` (``wire.cuda_ipc``'s JSON,
    no pickle); ``name_format`` as ``titan_gloo``'s."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    ipc_manifest: dict[str, Any] | None = None
    ipc_handles: list[dict[str, Any]] | None = None
    ipc_handles_pickled: str | None = None
    tensor_sizes: list[int] | None = None
    packed: bool = False
    name_format: str = "hf"

    def __post_init__(self) -> None:
        TitanGlooUpdateInfo.__post_init__(self)  # type: ignore[arg-type]  # the same names/dtypes/shapes checks
        if self.packed is not False or self.tensor_sizes is not None:
            raise ValueError(f"{IPC_NAME} takes unpacked transfers only (one handle per tensor)")
        given = [k for k in ("ipc_manifest", "ipc_handles", "ipc_handles_pickled") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"{IPC_NAME}: give exactly one of ipc_manifest, ipc_handles, ipc_handles_pickled; "
                             f"got {given or 'none'}")
        if self.ipc_handles_pickled is not None:
            import base64
            import pickle

            from vllm import envs

            if not envs.VLLM_ALLOW_INSECURE_SERIALIZATION:
                raise ValueError("Refusing to deserialize `ipc_handles_pickled` without "
                                 "VLLM_ALLOW_INSECURE_SERIALIZATION=1 (our trainer sends ipc_manifest instead)")
            self.ipc_handles = pickle.loads(base64.b64decode(self.ipc_handles_pickled))
            self.ipc_handles_pickled = None
        if self.ipc_manifest is not None:
            from titan_rl_ext.wire.cuda_ipc import manifest_spec

            if not isinstance(self.ipc_manifest, dict):
                raise ValueError(f"{IPC_NAME}: ipc_manifest must be an object, got {type(self.ipc_manifest).__name__}")
            spec = manifest_spec(self.ipc_manifest)
            want = {n: (_DTYPES[d], s) for n, d, s in zip(self.names, self.dtype_names, self.shapes)}
            # the staging is keyed by ``names``: a manifest opening other tensors, or the same ones with another
            # dtype or shape, would stage what the update info does not say
            if bad := sorted(n for n in set(spec) | set(want) if spec.get(n) != want.get(n)):
                raise ValueError(f"{IPC_NAME}: ipc_manifest does not match names/dtype_names/shapes for: "
                                 f"{name_list(bad)}")
        elif not isinstance(self.ipc_handles, list) or len(self.ipc_handles) != len(self.names):
            raise ValueError(f"{IPC_NAME}: ipc_handles must be a list with one entry per name")


class TitanIpcWeightTransferEngine(WeightTransferEngine[TitanIpcInitInfo, TitanIpcUpdateInfo]):
    """vLLM's ``ipc`` engine's wire, with ``titan_gloo``'s staging: each chunk's tensors are opened and copied
    into a staging area on the worker's GPU (the trainer may free them once ``update_weights`` answered: vLLM's
    own IPC trainers do), and only the commit (``titan_commit_transfer``) changes the live weights. Not a
    subclass of vLLM's ``IPCWeightTransferEngine``: that one loads each chunk into the live model as it arrives
    (no all-or-none), and vLLM 0.26's module imports ``ray`` at import time."""

    init_info_cls = TitanIpcInitInfo
    update_info_cls = TitanIpcUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.device = torch.device(device)
        self.joined = False
        self.staged: dict[str, torch.Tensor] = {}
        self.staged_format: str | None = None

    def init_transfer_engine(self, init_info: TitanIpcInitInfo) -> None:
        self.staged, self.staged_format = {}, None
        self.joined = True

    def start_weight_update(self) -> None:
        self.staged, self.staged_format = {}, None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":  # the copies are done before the trainer is told it may free its tensors
            torch.cuda.synchronize(self.device)

    def _opened(self, update_info: TitanIpcUpdateInfo) -> list[torch.Tensor]:
        if update_info.ipc_manifest is not None:
            from titan_rl_ext.wire.cuda_ipc import import_tensors

            views = import_tensors(update_info.ipc_manifest)
            return [views[n] for n in update_info.names]
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        # vLLM hands the worker "cuda:<n>"; a bare "cuda" is the current device
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        out = []
        for name, handle in zip(update_info.names, update_info.ipc_handles or []):
            if not isinstance(handle, dict) or uuid not in handle:
                raise ValueError(f"{IPC_NAME}: no IPC handle for this worker's GPU {uuid} in {name!r}")
            args = list(handle[uuid])
            args[6] = index  # reduce_tensor's device index, as this process numbers the GPU
            out.append(rebuild_cuda_tensor(*args))
        return out

    def receive_weights(self, update_info: TitanIpcUpdateInfo) -> None:
        if not self.joined:
            raise RuntimeError(f"{IPC_NAME}: call init_weight_transfer_engine first")
        _check_chunk(self, IPC_NAME, update_info.names, update_info.name_format)
        with torch.no_grad():
            # copies, not the opened views: the trainer frees or rewrites its tensors once this call answers;
            # staged only once the whole chunk is copied, so a handle that fails to open stages none of it
            chunk = {name: view.to(self.device, copy=True)
                     for name, view in zip(update_info.names, self._opened(update_info))}
        self.staged.update(chunk)

    def finish_weight_update(self) -> None:
        self.staged, self.staged_format = {}, None

    def shutdown(self) -> None:
        self.staged, self.staged_format = {}, None
        self.joined = False


def staged_commit(worker: Any) -> int | dict[str, Any]:
    """Inside a worker, between engine steps: the staged HF tensors -> titan names (the served model's
    adapter; our trainer sends titan names already) -> checked whole (names, shapes, dtypes, NaN/Inf) -> copied in place. Answers the tensor count,
    or ``{"problems": ...}`` with nothing copied; the staging is dropped either way."""
    from vllm_titan_plugin import compat
    from vllm_titan_plugin.swap.targets import TitanTarget, target_of

    engine = getattr(worker, "weight_transfer_engine", None)
    if not isinstance(engine, (TitanGlooWeightTransferEngine, TitanIpcWeightTransferEngine)):
        return {"problems": [f"this server's weight-transfer engine is {type(engine).__name__}, not {NAME},"
                             f" {NCCL_NAME} or {IPC_NAME}"],
                "tensors": [], "status": 409}
    staged, engine.staged = engine.staged, {}
    names_are, engine.staged_format = engine.staged_format, None
    if not staged:
        return {"problems": ["no tensors were received since start_weight_update"], "tensors": [], "status": 422}
    target = target_of(worker)
    if names_are == "titan":  # our trainer sends the served model's own names: no adapter in between
        return _checked_copy(target, staged)
    adapter = getattr(target, "adapter", None)
    if isinstance(target, TitanTarget):
        adapter = getattr(compat.worker_model(worker), "adapter", None)
    if adapter is None:
        return {"problems": ["the served model has no HF state-dict adapter"], "tensors": [], "status": 409}
    try:
        titan = adapter.from_hf(staged)
    except Exception as e:  # the adapter names what is missing or unexpected: a refusal, nothing copied
        return {"problems": [f"the HF tensors do not map onto the served model: {e}"], "tensors": [],
                "status": 422}
    return _checked_copy(target, titan)


def _checked_copy(target: Any, titan: dict[str, torch.Tensor]) -> int | dict[str, Any]:
    """Everything received checked (names, shapes, dtypes, NaN/Inf) before the first copy, against the whole
    model -- or, on a model serving LoRA adapters, against exactly its adapters when every name is an adapter's
    (``validate.push_spec``, as the HTTP intake does)."""
    got = {n: [ST_DTYPE.get(t.dtype, str(t.dtype)), list(t.shape)] for n, t in titan.items()}
    want = push_spec(target.spec(), got)
    if problems := spec_problems(want, got):
        return {"problems": problems, "tensors": [], "status": 422}
    nonfinite = [n for n, t in titan.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if nonfinite:
        return {"problems": [f"NaN/Inf in tensors: {name_list(nonfinite)}"], "tensors": nonfinite, "status": 422}
    with torch.no_grad():
        target.copy_in(titan.__getitem__, list(want))
    return len(want)


class TitanTransferExtension:
    """vLLM worker extension (``--worker-extension-cls``): the commit that the API server calls by name."""

    def titan_commit_transfer(self, _arg: Any = None) -> int | dict[str, Any]:
        return staged_commit(self)


def register() -> None:
    """Idempotent (vLLM's factory refuses a second registration of a name)."""
    engines: dict[str, type[WeightTransferEngine[Any, Any]]] = {n: TitanGlooWeightTransferEngine for n in TORCH_BACKEND}
    engines[IPC_NAME] = TitanIpcWeightTransferEngine
    for name, cls in engines.items():
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, cls)


register()
