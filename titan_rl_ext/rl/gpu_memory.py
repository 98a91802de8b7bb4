"""What the trainer's GPU holds, per side, for each step's record (``RUN_DIR/metrics.jsonl``):

- the trainer's caching allocator: its peak allocated and reserved bytes since the previous record (the first
  record's peak covers the start: model, kernel warm-up, the stale-gap model) and what it reserves now;
- the whole device (``cudaMemGetInfo``): used and total;
- per process, from NVML: this process (the allocator's pool plus its CUDA context and the libraries' workspaces)
  and the process tree of the generator this run spawned on the same machine (vLLM's API server and its engine
  core). Only where NVML names processes by this machine's pids: a container with its own pid namespace gets the
  host's pids, which match none of ours, and then these two are left out rather than guessed.

On a CPU, or where NVML cannot say, the keys are absent: nothing in a record is a number that was not measured.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["TRAINER_PEAK_ALLOCATED", "TRAINER_PEAK_RESERVED", "TRAINER_RESERVED", "DEVICE_USED", "DEVICE_TOTAL",
           "TRAINER_PROCESS", "GENERATOR_PROCESSES", "step_memory_metrics", "process_tree"]

logger = logging.getLogger(__name__)

GIB = 2**30
TRAINER_PEAK_ALLOCATED = "memory/trainer_peak_allocated_gib"
TRAINER_PEAK_RESERVED = "memory/trainer_peak_reserved_gib"
TRAINER_RESERVED = "memory/trainer_reserved_gib"
DEVICE_USED = "memory/device_used_gib"
DEVICE_TOTAL = "memory/device_total_gib"
TRAINER_PROCESS = "memory/trainer_process_gib"
GENERATOR_PROCESSES = "memory/generator_gib"


def _load_file(name: str, path: Path) -> Any | None:
    """The module in ``path``, registered as ``name`` before it runs (pynvml looks itself up in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 -- a copy that does not load: no per-process figures
        del sys.modules[name]
        logger.info("RL: %s does not load (%s)", path, e)
        return None
    return module


@functools.cache
def _nvml() -> Any | None:
    """NVML's bindings, initialised: nvidia-ml-py's ``pynvml``, else the copy vLLM vendors, loaded from its file --
    importing the ``vllm`` package in the trainer would run vLLM's start-up overrides of torch settings."""
    module: Any = None
    try:
        import pynvml

        module = pynvml
    except ImportError:
        spec = importlib.util.find_spec("vllm")  # a top-level spec: nothing of vLLM runs
        for root in (spec.submodule_search_locations or []) if spec is not None else []:
            path = Path(root) / "third_party" / "pynvml.py"
            if path.is_file():
                module = _load_file("_titan_vendored_pynvml", path)
                break
    if module is None:
        logger.info("RL: no NVML bindings (pynvml); per-process GPU memory is not recorded")
        return None
    try:
        module.nvmlInit()
    except Exception as e:  # noqa: BLE001 -- no driver library: the per-process figures are left out
        logger.info("RL: NVML does not start (%s); per-process GPU memory is not recorded", e)
        return None
    return module


def process_tree(pid: int, proc: Path = Path("/proc")) -> set[int]:
    """``pid`` and every live descendant of it, from ``/proc/<pid>/stat``'s parent pids."""
    parent: dict[int, int] = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # the command name (field 2) may hold spaces and parentheses: the fields after its last ')' are fixed
            fields = stat.read_text().rpartition(")")[2].split()
            parent[int(stat.parent.name)] = int(fields[1])
        except (OSError, ValueError, IndexError):
            continue  # a process that ended while being read
    tree, grew = {pid}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def _per_process(device: torch.device, generator_pid: int | None) -> dict[str, float]:
    nvml = _nvml()
    if nvml is None:
        return {}
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(device))
        used = {p.pid: p.usedGpuMemory for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    except Exception as e:  # noqa: BLE001 -- recorded as absent, never fatal to a step
        logger.debug("RL: NVML process list failed: %s", e)
        return {}
    me = used.get(os.getpid())
    if me is None:  # not listed (another pid namespace) or its usage not available (NVML_VALUE_NOT_AVAILABLE)
        return {}
    out = {TRAINER_PROCESS: me / GIB}
    if generator_pid is not None:
        theirs = [used[p] for p in process_tree(generator_pid) if p in used]
        if theirs and None not in theirs:
            out[GENERATOR_PROCESSES] = sum(theirs) / GIB
    return out


def step_memory_metrics(device: torch.device, generator_pid: int | None = None) -> dict[str, float]:
    """The step's memory figures (module docstring), in GiB; ``generator_pid``: the spawned generator's process,
    None when the generators are not this run's. Resets the allocator's peaks, so that the next call's peak is its
    own step's. Empty on a CPU."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    out = {TRAINER_PEAK_ALLOCATED: torch.cuda.max_memory_allocated(device) / GIB,
           TRAINER_PEAK_RESERVED: torch.cuda.max_memory_reserved(device) / GIB,
           TRAINER_RESERVED: torch.cuda.memory_reserved(device) / GIB,
           DEVICE_USED: (total - free) / GIB, DEVICE_TOTAL: total / GIB,
           **_per_process(device, generator_pid)}
    torch.cuda.reset_peak_memory_stats(device)
    return out
