"""Shims that let torchtitan 0.3.0 run on this project's CPU environment (torch 2.13, no GPU) and on the lent
GPU machine's torch 2.11.

Applied only by the torchtitan entry points (config registry, train, the upstream-model builder), never on
import of the project's own models.

1. torchtitan calls ``torch.distributed.set_timeout`` (public from torch 2.14) after the first step;
   torch 2.13 has the same function as ``distributed_c10d._set_pg_timeout(timeout, group)``.
2. torchtitan picks its device at import time as ``_get_available_device_type() or "cuda"``, so a
   CPU-only torch ends up with ``"cuda"``; several modules copy that value when imported. Forcing
   ``"cpu"`` makes it build on CPU and pick gloo. Its memory monitor needs a few ``torch.cuda``-style
   functions that ``torch.cpu`` lacks, and its barrier needs an integer device id.
3. torch < 2.13 lacks ``torch.distributed.fsdp.DataParallelMeshDims``, which torchtitan imports at module
   level (``distributed/full_dtensor.py``, ``distributed/fsdp.py``, so ``torchtitan.trainer`` and every
   ``torchtitan.models.*``). It is only *built* on the "full DTensor" FSDP path of torchtitan's own
   parallelisation, which also needs ``fully_shard(dp_mesh_dims=...)`` from torch >= 2.13 and which this
   project's ``parallelize_titan`` does not take; so a plain record with the same fields lets the imports
   through without pretending that path works (``fully_shard`` of 2.11 refuses the keyword). Every other
   torch >= 2.12 name torchtitan 0.3.0 uses sits on paths this project does not reach (flex-attention
   masks, varlen attention, MoE expert parallelism, pipelining, symmetric-memory FSDP): checked on a
   torch 2.11 install (docs/versions.md).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types

import torch
import torch.distributed as dist


class _CpuProperties:
    name = "cpu"

    @property
    def total_memory(self) -> int:
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return 0


def _cpu_device_module() -> types.ModuleType:
    mod = types.ModuleType("titan_rl_ext_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(mod, name, getattr(torch.cpu, name))
    mod.current_device = lambda: 0  # barrier(device_ids=[...]) accepts ints only
    mod.get_device_name = lambda device=None: "cpu"
    mod.get_device_properties = lambda device=None: _CpuProperties()
    mod.reset_peak_memory_stats = lambda device=None: None
    mod.empty_cache = lambda: None
    mod.memory_stats = lambda device=None: {}
    return mod


_CPU_MODULE = _cpu_device_module()


@dataclasses.dataclass(frozen=True)
class _DataParallelMeshDims:
    """Stand-in for torch >= 2.13's ``torch.distributed.fsdp.DataParallelMeshDims`` (shim 3): which mesh
    dimensions FSDP shards on and replicates over, each a name or a tuple of names."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims needs shard or replicate")

    @staticmethod
    def _names(dims: str | tuple[str, ...] | None) -> tuple[str, ...]:
        return () if dims is None else (dims,) if isinstance(dims, str) else tuple(dims)

    @property
    def shard_names(self) -> tuple[str, ...]:
        return self._names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return self._names(self.replicate)


def patch_torch_for_torchtitan() -> None:
    """Shim 3, idempotent: the torch names torchtitan 0.3.0 imports at module level. Call before importing
    any ``torchtitan`` module that reaches ``torchtitan.distributed``."""
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        _DataParallelMeshDims.__name__ = _DataParallelMeshDims.__qualname__ = "DataParallelMeshDims"
        fsdp.DataParallelMeshDims = _DataParallelMeshDims  # type: ignore[attr-defined]


def patch_torchtitan(force_cpu: bool | None = None) -> None:
    """Idempotent. ``force_cpu=None``: force CPU when no CUDA device is available."""
    patch_torch_for_torchtitan()
    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = _set_pg_timeout  # type: ignore[attr-defined]
    if force_cpu is None:
        force_cpu = not torch.cuda.is_available()
    if not force_cpu:
        return
    import torch._utils as torch_utils

    torch_utils._get_available_device_type = lambda: "cpu"
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("torchtitan"):
            continue
        if getattr(mod, "device_type", None) == "cuda":
            mod.device_type = "cpu"
        if getattr(mod, "device_module", None) in (torch.cuda, torch.cpu):
            mod.device_module = _CPU_MODULE
