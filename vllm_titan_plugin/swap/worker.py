"""Worker side of a swap: methods vLLM's workers gain (called by name through ``collective_rpc``).

The engine is paused while they run. Each re-checks names, shapes and dtypes before its first copy.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_titan_plugin import compat
from vllm_titan_plugin.swap.targets import target_of
from vllm_titan_plugin.swap.validate import file_spec, manifest_spec, name_list, push_spec, spec_problems


def worker_weight_spec(worker: Any) -> dict[str, list[Any]]:
    """titan name -> [safetensors dtype, shape] of every tensor a push carries (JSON-friendly for the RPC)."""
    return target_of(worker).spec()


@torch.no_grad()
def worker_load_weights(worker: Any, path: str) -> int | dict[str, Any]:
    """Copy every tensor of the safetensors file at ``path`` into the served model (``targets``): titan
    parameters in place, or through a native class's ``load_weights`` (the engine is paused). Names, shapes
    and dtypes are re-checked before the first copy: a mismatch answers ``{"problems": ...}`` with nothing
    copied. An exception raised once copying has begun reaches the route, which marks the server dirty
    (``orchestrator._dirty_on_failure``)."""
    from safetensors import safe_open

    target = target_of(worker)
    with safe_open(path, framework="pt", device="cpu") as f:
        got = file_spec(f)
        want = push_spec(target.spec(), got)  # the whole set, or exactly the adapters (an adapter-only push)
        problems = spec_problems(want, got)
        if problems:
            return {"problems": problems, "tensors": [], "status": 422}
        target.copy_in(f.get_tensor, list(want))
    return len(want)


@torch.no_grad()
def worker_load_weights_ipc(worker: Any, manifest: dict[str, Any]) -> dict[str, Any]:
    """Open the sender's CUDA IPC handles, check names/shapes/dtypes and finiteness of *every* tensor,
    then copy device to device. Returns ``{"num_tensors": n}`` or ``{"problems": [...], "tensors": [...]}``
    with nothing copied."""
    from titan_rl_ext.wire.cuda_ipc import import_tensors

    target = target_of(worker)
    if target.device.type != "cuda":
        return {"problems": ["transport=cuda_ipc needs a generator on CUDA; this one serves on "
                             f"{target.device.type} (use the default safetensors transport)"],
                "tensors": [], "status": 400}
    got = manifest_spec(manifest)
    want = push_spec(target.spec(), got)
    problems = spec_problems(want, got)
    if problems:
        return {"problems": problems, "tensors": [], "status": 422}
    try:
        tensors = import_tensors(manifest)
    except Exception as e:  # before any copy: a clean refusal, the weights are whole
        return {"problems": [f"could not open the CUDA IPC handles: {type(e).__name__}: {e}"], "tensors": [],
                "status": 422}
    try:
        nonfinite = [n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
        if nonfinite:
            return {"problems": [f"NaN/Inf in tensors: {name_list(nonfinite)}"], "tensors": nonfinite, "status": 422}
        target.copy_in(tensors.__getitem__, list(want))
        torch.cuda.synchronize()  # the sender may free its tensors once we answer
    finally:
        del tensors
    return {"num_tensors": len(want)}


def worker_synchronize_device(worker: Any) -> None:
    compat.synchronize_device(worker)


def worker_weight_checksums(worker: Any) -> dict[str, str]:
    return target_of(worker).checksums()


def worker_set_batch_invariant(worker: Any, enabled: bool) -> bool:
    """The batch-invariance switch inside a worker (the model's kernels read it on every call). CUDA
    graphs captured under the old setting replay its kernels, so a flip re-captures them."""
    from titan_rl_ext.kernels.batch_invariant import is_batch_invariant, set_batch_invariant
    from vllm_titan_plugin import graphs

    was = is_batch_invariant()
    set_batch_invariant(bool(enabled))
    if is_batch_invariant() != was:
        graphs.recapture(worker)
    return is_batch_invariant()




def first_refusal(results: list[Any]) -> dict[str, Any] | None:
    """The first worker answer of the form ``{"problems": [...], ...}`` (that worker copied nothing), if any."""
    return next((r for r in results if isinstance(r, dict) and r.get("problems")), None)


METHODS = {
    "titan_weight_spec": worker_weight_spec,
    "titan_load_weights": worker_load_weights,
    "titan_load_weights_ipc": worker_load_weights_ipc,
    "titan_weight_checksums": worker_weight_checksums,
    "titan_set_batch_invariant": worker_set_batch_invariant,
    "titan_synchronize_device": worker_synchronize_device,
}
