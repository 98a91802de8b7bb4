"""Starting the vLLM OpenAI server the way a user does, for tests (one place for every test file)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_cmd(model_dir: Path, port: int, max_model_len: int, extra: Sequence[str] = ()) -> list[str]:
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--model-impl", "titan", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", str(max_model_len), *extra,
    ]


def server_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # as a user runs it
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", **extra)
    return env


@dataclass
class RunningServer:
    base: str
    port: int
    proc: subprocess.Popen
    log_path: Path

    def wait_ready(self, timeout_s: float = 240) -> None:
        deadline = time.time() + timeout_s
        while True:
            assert self.proc.poll() is None, self.log_path.read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            assert time.time() < deadline, f"server not ready in {timeout_s} s"
            time.sleep(0.5)


@contextlib.contextmanager
def openai_server(
    model_dir: Path, log_path: Path, max_model_len: int = 512, extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Iterator[RunningServer]:
    """Starts the server (call ``wait_ready()`` before using it; boot takes ~25 s) and stops it on exit."""
    port = free_port()
    with log_path.open("w") as log:
        proc = subprocess.Popen(server_cmd(model_dir, port, max_model_len, extra_args), stdout=log,
                                stderr=subprocess.STDOUT, env=env or server_env(), start_new_session=True)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", port, proc, log_path)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
