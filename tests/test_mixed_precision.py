"""Mixed precision in the trainer (fp32 master weights, bf16 compute through FSDP2) computes with exactly the
weights a bf16 generator serves: the same logprobs bit for bit, BI on and off, and what the trainer pushes
(``precision.compute_view``) equals the served model's state dict tensor for tensor. Qwen3.5's ``A_log`` stays
fp32 on both sides (an fp32 FSDP group in the trainer, ``GatedDeltaNet._apply`` in the served model).

One process with a one-rank gloo group (a subprocess: the default process group is per process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import copy, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from titan_rl_ext.kernels.batch_invariant import set_batch_invariant
from titan_rl_ext.models.common.batch import SeqBatch
from titan_rl_ext.models.common.precision import compute_view, fp32_param_names
from titan_rl_ext.models.common.titan_protocol import apply_fsdp
from titan_rl_ext.models.hf import load_hf_model

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
master, _ = load_hf_model(sys.argv[1], dtype=torch.float32)
served = copy.deepcopy(master).to(torch.bfloat16)  # what vLLM builds with --dtype bfloat16
a_logs = [n for n in fp32_param_names(master)]
assert a_logs and all(served.get_parameter(n).dtype == torch.float32 for n in a_logs), a_logs
control = copy.deepcopy(master)  # plain fp32: must differ from the served bf16 model
apply_fsdp(master, init_device_mesh("cpu", (1,)), torch.bfloat16)
assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in master.parameters())

g = torch.Generator().manual_seed(0)
lengths = [7, 12, 5]
tokens = torch.randint(3, 500, (sum(lengths),), generator=g)
targets = torch.randint(3, 500, (sum(lengths),), generator=g)
batch = SeqBatch.from_lengths(lengths)
for bi in (False, True):
    set_batch_invariant(bi)
    with torch.no_grad():
        ours = master.packed_token_logprobs(tokens, batch, targets)
        theirs = served.packed_token_logprobs(tokens, batch, targets)
        fp32 = control.packed_token_logprobs(tokens, batch, targets)
    assert torch.equal(ours, theirs), (bi, (ours - theirs).abs().max())
    assert not torch.equal(fp32, theirs), bi  # the control: fp32 compute gives other bits
    print("BI", bi, "equal; fp32 control max |diff|", float((fp32 - theirs).abs().max()))
set_batch_invariant(False)

full = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in master.state_dict().items()}
pushed = compute_view(full, torch.bfloat16, fp32_param_names(master))
ref = served.state_dict()
assert pushed.keys() == ref.keys()
bad = [k for k in ref if pushed[k].dtype != ref[k].dtype or not torch.equal(pushed[k], ref[k])]
assert not bad, bad[:5]

# training steps through it: fp32 master weights and fp32 gradients, A_log included
loss = -master.packed_token_logprobs(tokens, batch, targets).mean()
loss.backward()
assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in master.parameters())
print("MIXED PRECISION OK")
dist.destroy_process_group()
"""


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3"])
def test_fsdp_mixed_precision_computes_with_the_served_bf16_weights(tiny_ckpt, arch: str) -> None:
    ckpt = tiny_ckpt(arch, layout="text")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = _SCRIPT if arch == "qwen3_5" else _SCRIPT.replace("assert a_logs and", "assert not a_logs or")
    r = subprocess.run([sys.executable, "-c", script, str(ckpt)], capture_output=True, text=True, timeout=300, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "MIXED PRECISION OK" in out, out[-2000:]
