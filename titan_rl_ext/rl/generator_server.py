"""A local vLLM OpenAI server running ``--model-impl titan``, started the way a user starts it.

Used by the RL trainer when it spawns its own generator and by the tests. The child gets a clean
environment: torchrun's rank variables are dropped (vLLM would otherwise think it is part of the
trainer's process group), and so is every ``TORCHELASTIC_*`` variable: with
``TORCHELASTIC_USE_AGENT_STORE=True`` (torchrun sets it) torch's ``tcp://`` rendezvous connects as a client
to a store it expects the elastic agent to host, so vLLM's engine core waits forever on the free port it
picked for its own world of one (the symptom: the engine hangs right after logging ``world_size=1 rank=0``).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_cmd(model_dir: str | Path, port: int, extra_args: Sequence[str] = (), model_impl: str = "titan") -> list[str]:
    """``model_impl``: ``titan`` (the unified model), or ``auto`` for vLLM's native class (an RL baseline: it
    still takes every push, ``vllm_titan_plugin.swap.targets``)."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--model-impl", model_impl, "--host", "127.0.0.1", "--port", str(port), *extra_args]


def server_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _TORCHRUN_VARS and not k.startswith("TORCHELASTIC_") and k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # ignored on GPU builds
    env.update(extra or {})
    return env


def _healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base.rstrip('/')}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def wait_healthy(base: str, timeout_s: float) -> None:
    """Wait for a generator the run did not start (``--rl.generator-urls``) to answer ``/health``: a trainer and
    its ``vllm serve`` are often started together, and a boot takes minutes on a GPU. TimeoutError names the
    address after ``timeout_s``."""
    deadline = time.time() + timeout_s
    if _healthy(base):
        return
    logger.info("RL: waiting up to %.0f s for the generator at %s to answer /health", timeout_s, base)
    while not _healthy(base):
        if time.time() > deadline:
            raise TimeoutError(f"the generator at {base} did not answer /health within {timeout_s:.0f} s "
                               "(--rl.server-boot-timeout-s)")
        time.sleep(0.5)


class GeneratorServer:
    """Starts on construction; ``wait_ready()`` before use (a boot takes ~25 s on CPU); ``close()`` stops it."""

    def __init__(self, model_dir: str | Path, log_path: Path, extra_args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, port: int | None = None, model_impl: str = "titan") -> None:
        self.port = free_port() if port is None else port  # a given port: e.g. a restart at the same address
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("w") as log:
            self.proc = subprocess.Popen(server_cmd(model_dir, self.port, extra_args, model_impl), stdout=log,
                                         stderr=subprocess.STDOUT, env=server_env(env), start_new_session=True)
        logger.info("vLLM server pid %d at %s (log %s)", self.proc.pid, self.base, log_path)

    def wait_ready(self, timeout_s: float = 240) -> None:
        deadline = time.time() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({self.proc.returncode}):\n{self.log_path.read_text()[-4000:]}")
            if _healthy(self.base):
                return
            if time.time() > deadline:
                self.close()
                raise TimeoutError(f"vLLM server not ready in {timeout_s} s (log {self.log_path})")
            time.sleep(0.5)

    def exit_reason(self) -> str | None:
        """None while the server process runs; once it has exited, its exit code and the end of its log."""
        if self.proc.poll() is None:
            return None
        try:
            tail = self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            tail = ""
        return f"the vLLM server at {self.base} exited ({self.proc.returncode}); its log ({self.log_path}) ends:\n{tail}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> GeneratorServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
