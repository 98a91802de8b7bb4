"""Where the project keeps what it builds and downloads (tiny checkpoints, tokenizers, warm-ups, run outputs,
search indexes): ``TITAN_RL_CACHE``, else ``~/.cache/vllm-titan``. A module of its own so that the recipes and the
environments below them both read it without importing each other."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("TITAN_RL_CACHE", Path.home() / ".cache" / "vllm-titan"))
