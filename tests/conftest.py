from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``tiny_ckpt(arch, layout="vlm", tie=False, seed=0, **text_overrides)`` -> checkpoint dir (cached per session)."""
    from titan_rl_ext.tools.make_tiny import make_tiny

    cache: dict[tuple, Path] = {}

    def get(arch: str, layout: str = "vlm", tie: bool = False, seed: int = 0, **overrides: object) -> Path:
        key = (arch, layout, tie, seed, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            name = f"{arch}-{layout}-{'tied' if tie else 'untied'}-{seed}-{len(cache)}"
            cache[key] = make_tiny(arch, tmp_path_factory.mktemp(name), seed=seed, layout=layout, tie=tie, **overrides)
        return cache[key]

    return get
