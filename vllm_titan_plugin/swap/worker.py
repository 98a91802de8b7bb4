"""Worker side of a swap: methods vLLM's workers gain (called by name through ``collective_rpc``).

The engine is paused while they run. Each re-checks names, shapes and dtypes before its first copy.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_titan_plugin import compat
from vllm_titan_plugin.swap.validate import ST_DTYPE, file_spec, manifest_spec, name_list, spec_problems


def _titan_params(worker: Any) -> dict[str, torch.nn.Parameter]:
    model = compat.worker_model(worker)
    get = getattr(model, "titan_parameters", None)
    if get is None:
        raise RuntimeError(f"weight push needs --model-impl titan (served model is {type(model).__name__})")
    return {name: p for name, (_, p) in get().items()}


def _spec_of(params: dict[str, torch.Tensor]) -> dict[str, list[Any]]:
    return {name: [ST_DTYPE[p.dtype], list(p.shape)] for name, p in params.items()}


def worker_weight_spec(worker: Any) -> dict[str, list[Any]]:
    """titan name -> [safetensors dtype, shape] of every parameter (JSON-friendly for the RPC reply)."""
    return _spec_of(_titan_params(worker))


@torch.no_grad()
def worker_load_weights(worker: Any, path: str) -> int | dict[str, Any]:
    """Copy every tensor of the safetensors file at ``path`` into the parameter of the same titan name, in
    place (the engine is paused). Names, shapes and dtypes are re-checked before the first copy: a mismatch
    answers ``{"problems": ...}`` with nothing copied. An exception raised once copying has begun reaches
    the route, which marks the server dirty (``routes._dirty_on_failure``)."""
    from safetensors import safe_open

    params = _titan_params(worker)
    with safe_open(path, framework="pt", device="cpu") as f:
        problems = spec_problems(_spec_of(params), file_spec(f))
        if problems:
            return {"problems": problems, "tensors": [], "status": 422}
        for name, p in params.items():
            p.copy_(f.get_tensor(name))
    return len(params)


@torch.no_grad()
def worker_load_weights_ipc(worker: Any, manifest: dict[str, Any]) -> dict[str, Any]:
    """Open the sender's CUDA IPC handles, check names/shapes/dtypes and finiteness of *every* tensor,
    then copy device to device. Returns ``{"num_tensors": n}`` or ``{"problems": [...], "tensors": [...]}``
    with nothing copied."""
    from titan_rl_ext.wire.cuda_ipc import import_tensors

    params = _titan_params(worker)
    if any(p.device.type != "cuda" for p in params.values()):
        return {"problems": ["transport=cuda_ipc needs a generator on CUDA; this one serves on "
                             f"{next(iter(params.values())).device.type} (use the default safetensors transport)"],
                "tensors": [], "status": 400}
    problems = spec_problems(_spec_of(params), manifest_spec(manifest))
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
        for name, p in params.items():
            p.copy_(tensors[name])
        torch.cuda.synchronize()  # the sender may free its tensors once we answer
    finally:
        del tensors
    return {"num_tensors": len(params)}


def worker_weight_checksums(worker: Any) -> dict[str, str]:
    from titan_rl_ext.wire.weights import tensor_checksum

    return {name: tensor_checksum(p) for name, p in _titan_params(worker).items()}


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
}
