"""Where the project keeps what it builds and downloads (tiny checkpoints, tokenizers, warm-ups, run outputs,
search indexes): ``TITAN_RL_CACHE``, else ``~/.cache/vllm-titan``. A module of its own so that the recipes and the
environments below them both read it without importing each other."""

from __future__ import annotations

from pathlib import Path

from titan_rl_ext import settings


def cache_dir() -> Path:
    return settings.RL_CACHE.get()
