"""torchtitan's own Trainer trains the titan models through their ModelSpec (CPU, gloo, 1 rank)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rl_runs import BackgroundRun, start_run

REPO = Path(__file__).resolve().parents[1]
RECIPES = ["qwen3_5_debug", "qwen3_5_moe_debug"]
STEPS = 8


@pytest.fixture(scope="module")
def train_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, BackgroundRun]]:
    """The collected recipes' runs, started at once: each is one single-threaded process, so side by side they
    fill the cores one leaves idle; the losses do not depend on timing."""
    wanted = [r for r in RECIPES if any(item.module is request.module and getattr(item, "callspec", None) is not None
                                        and item.callspec.params.get("recipe") == r for item in request.session.items)]
    runs: dict[str, BackgroundRun] = {}
    try:
        for recipe in wanted:
            d = tmp_path_factory.mktemp(recipe)
            env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                       HF_HOME=str(d / "hf"), TITAN_RL_CACHE=str(d / "cache"),
                       PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                   "-m", "torchtitan.train", "--module", "titan_rl_ext", "--config", recipe,
                   "--training.steps", str(STEPS)]
            runs[recipe] = start_run(cmd, d, env, 600)
        yield runs
    finally:
        for run in runs.values():
            run.stop()


def _losses(run: BackgroundRun) -> list[float]:
    status = run.wait()
    log = run.log.read_text(errors="replace")
    assert status == 0, log[-4000:]
    losses = [float(x) for x in re.findall(r"step:\s*\d+\s+loss:\s*([0-9.]+)", log)]
    assert len(losses) == STEPS, log[-4000:]
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_torchtitan_trainer_loss_goes_down(train_runs: dict[str, BackgroundRun], recipe: str) -> None:
    losses = _losses(train_runs[recipe])
    assert all(torch.isfinite(torch.tensor(losses)))
    # starts near ln(512) = 6.24 (uniform over the tiny vocabulary) and must learn the corpus
    assert 5.5 < losses[0] < 7.0, losses
    assert losses[-1] < losses[0] - 0.8, losses
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses


def test_model_spec_builds_titan_model_and_hf_adapter(tiny_ckpt) -> None:
    from titan_rl_ext.compat import patch_torchtitan

    patch_torchtitan()
    from titan_rl_ext.models.common.titan_protocol import TitanDecoder, batch_from_positions
    from titan_rl_ext.models.hf import read_safetensors
    from titan_rl_ext.models.qwen3_5 import model_registry

    spec = model_registry("qwen3_5-moe-debug")
    with torch.device("meta"):
        model = spec.model.build()
    assert isinstance(model, TitanDecoder)
    nparams, flops = spec.model.get_nparams_and_flops(model, 128)
    assert nparams == sum(p.numel() for p in model.parameters()) and flops > 0

    ckpt = tiny_ckpt("qwen3_5_moe")  # same dimensions as the moe-debug flavor, VLM layout
    adapter = spec.state_dict_adapter(spec.model, str(ckpt))
    hf_sd = read_safetensors(ckpt)
    sd = adapter.from_hf(hf_sd)
    assert set(sd) == set(model.state_dict())
    back = adapter.to_hf(sd)
    assert all(torch.equal(back[k], hf_sd[k]) for k in back)

    with pytest.raises(ValueError, match="unknown qwen3_5 flavor"):
        model_registry("qwen3_5-nope")

    # documents packed in a row (positions restart at 0) become separate sequences
    pos = torch.tensor([[0, 1, 2, 0, 1], [3, 4, 0, 1, 2]])
    b = batch_from_positions(pos)
    assert b.cu_seqlens.tolist() == [0, 3, 5, 7, 10]


_TORCH_2_11 = r"""
import sys
import torch.distributed.fsdp as fsdp

del fsdp.DataParallelMeshDims  # what torch 2.11's fsdp package lacks
try:
    import torchtitan.distributed.full_dtensor  # noqa: F401
    unshimmed = "imported"
except ImportError as e:
    unshimmed = f"ImportError: {e}"
for name in [m for m in sys.modules if m.startswith("torchtitan")]:
    del sys.modules[name]

from titan_rl_ext.compat import patch_torchtitan

patch_torchtitan(force_cpu=True)
import torchtitan.trainer  # noqa: F401,E402
import torchtitan.models.qwen3  # noqa: F401,E402
from torch.distributed.fsdp import DataParallelMeshDims  # noqa: E402

d = DataParallelMeshDims(shard=("dp_shard", "cp"), replicate="dp_replicate")
assert d.shard_names == ("dp_shard", "cp") and d.replicate_names == ("dp_replicate",), d
try:
    DataParallelMeshDims()
    raise SystemExit("a DataParallelMeshDims with neither dimension was accepted")
except ValueError:
    pass
print("UNSHIMMED", unshimmed)
print("SHIMMED OK")
"""


def test_torchtitan_imports_under_torch_2_11_names() -> None:
    """torch 2.11 (the GPU machine's) lacks ``torch.distributed.fsdp.DataParallelMeshDims``, which torchtitan
    0.3.0 imports at module level: without the shim ``torchtitan.trainer`` does not import there. Here the
    name is removed from this torch to stand for 2.11's; the shim must bring the imports back."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _TORCH_2_11], capture_output=True, text=True, timeout=300, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "UNSHIMMED ImportError" in out and "DataParallelMeshDims" in out, out[-3000:]  # the control
    assert "SHIMMED OK" in out
