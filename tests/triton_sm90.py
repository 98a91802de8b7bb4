"""Compile a Triton kernel launch for Hopper (sm_90) on a machine without a GPU.

The interpreter (``TRITON_INTERPRET=1``) checks a kernel's arithmetic on CPU but not that it compiles: it runs
the kernel body as Python, so what only the compiler refuses -- a global that is not a ``tl.constexpr``, a layout
or type the lowering rejects -- first shows on the lent GPU, in device time. Triton's wheel carries the
compiler and ``ptxas``, so the launch a wrapper makes can be compiled here for ``GPUTarget("cuda", 90, 32)``:
``record_launches`` runs the wrapper on CPU tensors with the kernels' launches captured instead of run, and
``compile_sm90`` compiles each captured launch to a cubin (signature from the arguments' dtypes and types).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

_PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int32: "*i32",
        torch.int64: "*i64", torch.int8: "*i8", torch.uint8: "*u8", torch.bool: "*i1", torch.float64: "*fp64"}
# launch keywords that are compile options, not kernel parameters
_NOT_OPTIONS = ("grid", "warmup")


@dataclass
class Launch:
    kernel: Any  # triton.JITFunction
    args: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def record_launches(*kernels: Any) -> Iterator[list[Launch]]:
    """Within the block, a launch of any of ``kernels`` is recorded (its arguments bound to its parameters)
    and not run."""
    launches: list[Launch] = []
    saved = []
    for k in kernels:
        def run(*args: Any, _k: Any = k, **kwargs: Any) -> None:
            names = [p.name for p in _k.params]
            bound = dict(zip(names, args))
            bound.update({n: v for n, v in kwargs.items() if n in names})
            options = {n: v for n, v in kwargs.items() if n not in names and n not in _NOT_OPTIONS}
            launches.append(Launch(_k, bound, options))
        saved.append((k, k.__dict__.get("run")))
        k.run = run
    try:
        yield launches
    finally:
        for k, old in saved:
            if old is None:
                del k.run
            else:
                k.run = old


def _arg_type(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return _PTR[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -(2**31) <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(v).__name__} {v!r}")


def compile_sm90(launch: Launch, **override: Any) -> Any:
    """The launch compiled for sm_90 (``override``: constexpr values or options to compile instead, e.g. the
    CUDA-only branch a CPU wrapper did not take). Returns the compiled kernel (``.asm["cubin"]``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = {p.name: p for p in launch.kernel.params}
    args = {**launch.args, **{k: v for k, v in override.items() if k in params}}
    options = {**launch.options, **{k: v for k, v in override.items() if k not in params}}
    signature, constexprs = {}, {}
    for name, p in params.items():
        if p.is_constexpr or args.get(name) is None:
            signature[name] = "constexpr"
            constexprs[name] = args.get(name, p.default if p.has_default else None)
        else:
            signature[name] = _arg_type(args[name])
    src = ASTSource(launch.kernel, signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
