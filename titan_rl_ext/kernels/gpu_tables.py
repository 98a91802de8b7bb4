"""Which entry of a per-GPU launch table serves a GPU.

The launch tables next to the kernels (``bi_gemm_tables.json``, ``conv_bwd_tables.json``) are measured on one GPU
and keyed by its ``torch.cuda.get_device_name``. GPUs cut from one die run one compiled kernel (Triton targets
the compute capability, and the machine code is the same), so a table measured on one of them gives the others
the same bits and close to the same speed: H100s and H200s are one GH100 die, so a table measured on either
serves both. A GPU with its own entry uses it; a GPU outside every family gets none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")

# the model names of each die as they appear as a word of the device name ("NVIDIA H100 80GB HBM3", "NVIDIA H200",
# "NVIDIA GH200 480GB", "NVIDIA H100 PCIe")
DIE_FAMILIES: tuple[frozenset[str], ...] = (frozenset({"H100", "H200", "GH200", "H800", "H20"}),)


def die_family(gpu_name: str) -> frozenset[str] | None:
    """The family whose model name is a word of ``gpu_name``, or None."""
    words = set(gpu_name.split())
    return next((fam for fam in DIE_FAMILIES if fam & words), None)


def table_entry(tables: Mapping[str, T], gpu_name: str) -> tuple[str, T] | None:
    """``(key, entry)`` of ``tables`` for ``gpu_name``: its own entry, else the first (by key) measured on a GPU
    of its die family, else None. ``""`` (CPU) gets None."""
    if not gpu_name:
        return None
    if gpu_name in tables:
        return gpu_name, tables[gpu_name]
    fam = die_family(gpu_name)
    if fam is None:
        return None
    for key in sorted(tables):
        if die_family(key) is fam:
            return key, tables[key]
    return None
