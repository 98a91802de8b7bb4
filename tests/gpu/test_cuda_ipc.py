"""GPU: the CUDA IPC weight transport (``titan_rl_ext.wire.cuda_ipc``) between two processes.

The parent exports a state dict (bf16 and fp32, a non-contiguous view, tensors sharing one storage); a
child process opens the manifest, copies into its own parameters and reports checksums, which must equal
the parent's bit for bit. Skipped without CUDA. The push through a real vLLM server is in
``tests/gpu/run_vllm_e2e.sh``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

_CHILD = r"""
import json, sys, torch
from titan_rl_ext.wire.cuda_ipc import import_tensors
from titan_rl_ext.wire.weights import checksum
manifest = json.loads(sys.stdin.read())
opened = import_tensors(manifest)
mine = {n: torch.empty(t.shape, dtype=t.dtype, device="cuda") for n, t in opened.items()}
for n, p in mine.items():
    p.copy_(opened[n])
torch.cuda.synchronize()
del opened
print("CHECKSUMS " + json.dumps(checksum(mine)))
"""


def test_cuda_ipc_roundtrip_bit_exact() -> None:
    from titan_rl_ext.wire.cuda_ipc import export_tensors
    from titan_rl_ext.wire.weights import checksum

    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(256, 512, device="cuda", generator=g)
    sd = {
        "w_bf16": torch.randn(1024, 768, device="cuda", generator=g).to(torch.bfloat16),
        "a_log_fp32": torch.randn(32, device="cuda", generator=g),
        "transposed": base.t(),  # non-contiguous: exported as a contiguous copy
        "slice_a": base[:128],  # two views of one storage
        "slice_b": base[128:],
    }
    manifest, keep = export_tensors(sd)
    json.dumps(manifest)  # plain JSON
    r = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(manifest), capture_output=True, text=True,
                       timeout=300)
    line = next((l for l in r.stdout.splitlines() if l.startswith("CHECKSUMS ")), None)
    assert line is not None, r.stdout[-2000:] + r.stderr[-4000:]
    assert json.loads(line.removeprefix("CHECKSUMS ")) == checksum(sd)
    del keep


def test_cuda_ipc_refuses_cpu_tensors() -> None:
    from titan_rl_ext.wire.cuda_ipc import export_tensors

    with pytest.raises(ValueError, match="needs CUDA tensors; w is on cpu"):
        export_tensors({"w": torch.zeros(2)})


def test_cuda_ipc_forged_manifest_refused_before_opening() -> None:
    """A real manifest passes the checks; the same manifest with one tensor's view forged (stride, offset,
    storage size) is refused before any handle is opened, naming the field. (Opening happens in another
    process; the checks run first, so this process can exercise them on its own handles.)"""
    import copy

    from titan_rl_ext.wire.cuda_ipc import export_tensors, import_tensors, manifest_spec

    g = torch.Generator(device="cuda").manual_seed(1)
    base = torch.randn(64, 32, device="cuda", generator=g)
    manifest, keep = export_tensors({"good": torch.randn(16, 8, device="cuda", generator=g), "view": base[8:40]})
    assert set(manifest_spec(manifest)) == {"good", "view"}
    assert manifest["tensors"]["view"]["offset"] == 0  # a view is exported as its own storage
    for field, value in (("stride", [1, 32]), ("offset", 1), ("storage_bytes", 64 * 32 * 4 * 2)):
        forged = copy.deepcopy(manifest)
        forged["tensors"]["view"][field] = value
        with pytest.raises(ValueError, match=f"view: {field}"):
            import_tensors(forged)
    del keep
