"""Shims that let torchtitan 0.3.0 run on this project's CPU environment (torch 2.13, no GPU).

Applied only by the torchtitan entry points (config registry, train), never on import of the models.

1. torchtitan calls ``torch.distributed.set_timeout`` (public from torch 2.14) after the first step;
   torch 2.13 has the same function as ``distributed_c10d._set_pg_timeout(timeout, group)``.
2. torchtitan picks its device at import time as ``_get_available_device_type() or "cuda"``, so a
   CPU-only torch ends up with ``"cuda"``; several modules copy that value when imported. Forcing
   ``"cpu"`` makes it build on CPU and pick gloo. Its memory monitor needs a few ``torch.cuda``-style
   functions that ``torch.cpu`` lacks, and its barrier needs an integer device id.
"""

from __future__ import annotations

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


def patch_torchtitan(force_cpu: bool | None = None) -> None:
    """Idempotent. ``force_cpu=None``: force CPU when no CUDA device is available."""
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
