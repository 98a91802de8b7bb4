"""The vLLM OpenAI server for tests, started the way a user starts it (``rl.generator_server``)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator, Sequence
from pathlib import Path

from titan_rl_ext.rl.generator_server import GeneratorServer, free_port, server_env as _env

__all__ = ["float32_server", "free_port", "kill_group", "one_core", "openai_server", "server_cmd", "server_env"]


def server_cmd(model_dir: Path, port: int, max_model_len: int, extra: Sequence[str] = ()) -> list[str]:
    from titan_rl_ext.rl.generator_server import server_cmd as cmd

    return cmd(model_dir, port, ["--dtype", "float32", "--max-model-len", str(max_model_len), *extra])


def one_core(i: int) -> dict[str, str]:
    """Environment for the ``i``-th of several servers running side by side: its engine's one thread bound to a
    core of this machine in turn. vLLM's CPU worker binds every server to the same first core on its own, so
    servers side by side take turns on it while other cores idle; one thread either way (the same kernels, the
    same bits)."""
    cpus = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[i % len(cpus)])}


def server_env(**extra: str) -> dict[str, str]:
    return _env({"HF_HUB_OFFLINE": "1", **extra})


def float32_server(
    model_dir: Path, log_path: Path, max_model_len: int = 512, extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> GeneratorServer:
    """Starts a float32 server; call ``wait_ready()`` before using it and ``close()`` after."""
    return GeneratorServer(model_dir, log_path, ["--dtype", "float32", "--max-model-len", str(max_model_len), *extra_args],
                           env or server_env())


@contextlib.contextmanager
def openai_server(
    model_dir: Path, log_path: Path, max_model_len: int = 512, extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Iterator[GeneratorServer]:
    """Starts a float32 server (call ``wait_ready()`` before using it) and stops it on exit."""
    with float32_server(model_dir, log_path, max_model_len, extra_args, env) as server:
        yield server


def kill_group(srv: GeneratorServer) -> None:
    """SIGKILL a server's whole process group (the API server and its engine core) and reap it."""
    try:
        os.killpg(srv.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    srv.proc.wait()
