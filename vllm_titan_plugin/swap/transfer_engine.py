"""``titan_gloo``: a vLLM weight-transfer engine (``vllm/distributed/weight_transfer``) for titan servers on CPU.

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
    --weight-transfer-config '{"backend": "titan_gloo"}'

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

from vllm_titan_plugin.swap.validate import ST_DTYPE, name_list, spec_problems

logger = logging.getLogger("vllm.titan_plugin")

NAME = "titan_gloo"
COMMIT_METHOD = "titan_commit_transfer"
DEFAULT_TIMEOUT_S = 120.0
_DTYPES = {str(dt).removeprefix("torch."): dt for dt in ST_DTYPE}  # "float32" -> torch.float32, ...


@dataclass
class TitanGlooInitInfo(WeightTransferInitInfo):
    """The same fields as vLLM's NCCL engine: the trainer hosts the rendezvous store at
    ``master_address:master_port`` as rank 0; this worker joins as ``rank_offset + its rank``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    # per collective (rendezvous, each tensor's broadcast): a trainer that dies mid-transfer would otherwise
    # hold the worker -- and with it the engine core's loop, so generation -- for gloo's default 30 minutes
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if not isinstance(self.timeout_s, (int, float)) or not 0 < self.timeout_s <= 3600:
            raise ValueError(f"timeout_s must be a number of seconds in (0, 3600], got {self.timeout_s!r}")
        if not isinstance(self.master_port, int) or not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port number, got {self.master_port!r}")
        if not isinstance(self.rank_offset, int) or self.rank_offset < 1:
            raise ValueError(f"rank_offset must be >= 1 (rank 0 is the trainer), got {self.rank_offset!r}")
        if not isinstance(self.world_size, int) or self.world_size <= self.rank_offset:
            raise ValueError(f"world_size ({self.world_size!r}) must exceed rank_offset ({self.rank_offset})")


@dataclass
class TitanGlooUpdateInfo(WeightTransferUpdateInfo):
    """One chunk: the tensors the trainer broadcasts next, in this order (HF checkpoint names)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(f"names, dtype_names and shapes differ in length: {len(self.names)}, "
                             f"{len(self.dtype_names)}, {len(self.shapes)}")
        if bad := sorted({d for d in self.dtype_names if d not in _DTYPES}):
            raise ValueError(f"unknown dtype names {bad}; expected torch names such as 'float32', 'bfloat16'")
        if bad := [n for n, s in zip(self.names, self.shapes)
                   if not isinstance(s, list) or not all(isinstance(d, int) and d >= 0 for d in s)]:
            raise ValueError(f"shapes must be lists of non-negative integers: {name_list(bad)}")


class TitanGlooWeightTransferEngine(WeightTransferEngine[TitanGlooInitInfo, TitanGlooUpdateInfo]):
    init_info_cls = TitanGlooInitInfo
    update_info_cls = TitanGlooUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Any = None
        # HF name -> received tensor, since the last start_weight_update; only the commit reads it
        self.staged: dict[str, torch.Tensor] = {}

    def init_transfer_engine(self, init_info: TitanGlooInitInfo) -> None:
        from datetime import timedelta

        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        if self.group is not None:  # a second trainer (or a restarted one) replaces the first
            self.shutdown()
        # a group of its own: the worker's default group (if any) is untouched, and this worker only dials
        # the trainer's store (the trainer listens, as with vLLM's NCCL engine)
        self.group = stateless_init_torch_distributed_process_group(
            init_info.master_address, init_info.master_port, init_info.rank_offset + self.parallel_config.rank,
            init_info.world_size, backend="gloo", timeout=timedelta(seconds=init_info.timeout_s))

    def start_weight_update(self) -> None:
        self.staged = {}  # what an earlier, never-committed transfer left is dropped here

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class ends with torch.accelerator.synchronize(), which raises on a CPU-only host
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: TitanGlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError(f"{NAME}: no trainer group yet; call init_weight_transfer_engine first")
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
            if name in self.staged:
                raise ValueError(f"{NAME}: tensor {name!r} sent twice in one weight update")
            t = torch.empty(shape, dtype=_DTYPES[dtype_name], device="cpu")
            # group-local root 0 (the trainer): torch.distributed.broadcast would translate a global rank
            self.group.broadcast(t, 0).wait()
            self.staged[name] = t

    def finish_weight_update(self) -> None:
        # the commit (titan_commit_transfer) has run, or been refused, before this: nothing staged survives
        self.staged = {}

    def shutdown(self) -> None:
        self.staged = {}
        if self.group is not None:
            group, self.group = self.group, None
            try:
                group.shutdown()
            except Exception as e:  # a trainer already gone: the group is dead either way
                logger.warning("titan: closing the %s group: %s", NAME, e)


def staged_commit(worker: Any) -> int | dict[str, Any]:
    """Inside a worker, between engine steps: the staged HF tensors -> titan names (the served model's
    adapter) -> checked whole (names, shapes, dtypes, NaN/Inf) -> copied in place. Answers the tensor count,
    or ``{"problems": ...}`` with nothing copied; the staging is dropped either way."""
    from vllm_titan_plugin import compat
    from vllm_titan_plugin.swap.targets import TitanTarget, target_of

    engine = getattr(worker, "weight_transfer_engine", None)
    if not isinstance(engine, TitanGlooWeightTransferEngine):
        return {"problems": [f"this server's weight-transfer engine is {type(engine).__name__}, not {NAME}"],
                "tensors": [], "status": 409}
    staged, engine.staged = engine.staged, {}
    if not staged:
        return {"problems": ["no tensors were received since start_weight_update"], "tensors": [], "status": 422}
    target = target_of(worker)
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
    got = {n: [ST_DTYPE.get(t.dtype, str(t.dtype)), list(t.shape)] for n, t in titan.items()}
    if problems := spec_problems(target.spec(), got):
        return {"problems": problems, "tensors": [], "status": 422}
    nonfinite = [n for n, t in titan.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if nonfinite:
        return {"problems": [f"NaN/Inf in tensors: {name_list(nonfinite)}"], "tensors": nonfinite, "status": 422}
    with torch.no_grad():
        target.copy_in(titan.__getitem__)
    return len(titan)


class TitanTransferExtension:
    """vLLM worker extension (``--worker-extension-cls``): the commit that the API server calls by name."""

    def titan_commit_transfer(self, _arg: Any = None) -> int | dict[str, Any]:
        return staged_commit(self)


def register() -> None:
    """Idempotent (vLLM's factory refuses a second registration of a name)."""
    if NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(NAME, TitanGlooWeightTransferEngine)


register()
