"""Checks of a pushed payload against the served parameters, before any weight changes.

Runs in the API-server process off its event loop (the weights listener's thread, or a worker thread),
and again in each worker right before the copy (``swap.worker``), so a mismatch never half-swaps a model.
"""

from __future__ import annotations

import json
from typing import Any

import torch

# safetensors dtype names (the header's "dtype" strings) of the torch dtypes a parameter can have.
ST_DTYPE: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_TORCH_DTYPE = {v: k for k, v in ST_DTYPE.items()}
_FLOAT_ST = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


class PushRejected(Exception):
    def __init__(self, status: int, message: str, tensors: list[str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.tensors = status, message, tensors or []


def manifest_spec(manifest: dict[str, Any]) -> dict[str, list[Any]]:
    """A CUDA IPC manifest's [safetensors dtype, shape] per name (``ValueError`` on a malformed one)."""
    from titan_rl_ext.wire import cuda_ipc

    return {n: [ST_DTYPE.get(dt, str(dt)), shape] for n, (dt, shape) in cuda_ipc.manifest_spec(manifest).items()}


def file_spec(f: Any) -> dict[str, list[Any]]:
    out = {}
    for name in f.keys():
        sl = f.get_slice(name)
        out[name] = [sl.get_dtype(), list(sl.get_shape())]
    return out


def name_list(names: list[str], limit: int = 20) -> str:
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def spec_problems(expected: dict[str, list[Any]], got: dict[str, list[Any]]) -> list[str]:
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    common = sorted(set(expected) & set(got))
    shape = [f"{n} {tuple(got[n][1])} != {tuple(expected[n][1])}" for n in common if got[n][1] != expected[n][1]]
    dtype = [f"{n} {got[n][0]} != {expected[n][0]}" for n in common if got[n][0] != expected[n][0]]
    problems = []
    if missing:
        problems.append(f"missing tensors: {name_list(missing)}")
    if extra:
        problems.append(f"unexpected tensors: {name_list(extra)}")
    if shape:
        problems.append(f"wrong shape: {name_list(shape)}")
    if dtype:
        problems.append(f"wrong dtype: {name_list(dtype)}")
    return problems


def check_spec(expected: dict[str, list[Any]], got: dict[str, list[Any]]) -> None:
    """``PushRejected(422)`` naming every missing, extra or mismatched tensor."""
    problems = spec_problems(expected, got)
    if problems:
        bad = sorted((set(expected) ^ set(got)) | {n for n in set(expected) & set(got) if got[n] != expected[n]})
        raise PushRejected(422, "; ".join(problems), bad)


def push_spec(expected: dict[str, list[Any]], got: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """The set a push must match exactly. A model serving LoRA adapters (``models.common.lora``) takes, besides
    the whole set, an adapter-only push: one whose every name is an adapter name is held to the whole adapter set,
    all or none -- a partial adapter is refused naming what it lacks, and the base weights never move."""
    from titan_rl_ext.models.common.lora import is_lora_param

    adapters = {n: v for n, v in expected.items() if is_lora_param(n)}
    if adapters and got and all(is_lora_param(n) for n in got):
        return adapters
    return expected


def check_push(expected: dict[str, list[Any]], got: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """``check_spec`` against ``push_spec``; returns the set the push carries. An adapter-only push's refusal
    says so."""
    want = push_spec(expected, got)
    if want is expected:
        check_spec(expected, got)
        return want
    try:
        check_spec(want, got)
    except PushRejected as e:
        raise PushRejected(e.status, f"adapter-only push (the served model's {len(want)} LoRA tensors, all or "
                                     f"none): {e.message}", e.tensors) from None
    return want


def _duplicate_names(path: str) -> list[str]:
    """Names that occur more than once in the safetensors header (``safe_open`` keeps the last one)."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")  # already bounded by safe_open
        header = fh.read(n)
    dups: set[str] = set()

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for k, _ in items:
            (dups if k in seen else seen).add(k)
        return dict(items)

    json.loads(header, object_pairs_hook=pairs)
    return sorted(dups)


def validate_payload(path: str, expected: dict[str, list[Any]]) -> int:
    """Raise ``PushRejected`` (400 unparseable, 422 mismatched or non-finite) or return the tensor count."""
    from safetensors import safe_open

    try:
        f = safe_open(path, framework="pt", device="cpu")
    except Exception as e:  # SafetensorError, OSError, ...: truncated or corrupted bytes
        raise PushRejected(400, f"payload is not a valid safetensors file: {e}") from None
    with f:
        try:
            got = file_spec(f)
        except Exception as e:
            raise PushRejected(400, f"payload is not a valid safetensors file: {e}") from None
        if dups := _duplicate_names(path):
            # the format forbids them, and two readers could pick different entries
            raise PushRejected(400, f"payload is not a valid safetensors file: duplicate tensor names: {name_list(dups)}", dups)
        check_push(expected, got)
        nonfinite = []
        for name, (dt, _) in got.items():
            if dt in _FLOAT_ST and not bool(torch.isfinite(f.get_tensor(name)).all()):
                nonfinite.append(name)
        if nonfinite:
            raise PushRejected(422, f"NaN/Inf in tensors: {name_list(nonfinite)}", nonfinite)
    return len(got)




def max_bytes(spec: dict[str, list[Any]]) -> int:
    """The largest payload a push may send: twice the model's bytes plus 1 MiB of header room."""
    model_bytes = 0
    for dt, shape in spec.values():
        n = 1
        for s in shape:
            n *= s
        model_bytes += n * torch.tensor([], dtype=_TORCH_DTYPE[dt]).element_size()
    return 2 * model_bytes + (1 << 20)
