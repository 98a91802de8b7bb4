"""The environment the trainer gives the vLLM server it spawns (titan_rl_ext.rl.generator_server)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from titan_rl_ext.rl.generator_server import free_port, server_env

# What vLLM's engine core does for its world of one: a tcp:// rendezvous on a free port it picked.
_RENDEZVOUS = r"""
import datetime, sys, torch.distributed as dist
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=5))
dist.destroy_process_group()
print("rendezvous ok")
"""

# what torchrun puts in a trainer's environment (torch/distributed/elastic/agent/server/local_elastic_agent.py)
_TORCHRUN_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "TORCHELASTIC_USE_AGENT_STORE": "True",
                 "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}


def _rendezvous(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _RENDEZVOUS, str(free_port())], env=env, capture_output=True,
                          text=True, timeout=120)


def test_spawned_server_env_drops_torchrun_and_its_agent_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun the trainer's environment makes a tcp:// rendezvous wait for an agent's store that
    is not there (vLLM's engine core hung so on the H200); the server's environment has none of it."""
    for k, v in _TORCHRUN_ENV.items():
        monkeypatch.setenv(k, v)
    env = server_env({"TITAN_SWAP_TOKEN": "t"})
    assert not [k for k in env if k in _TORCHRUN_ENV], sorted(k for k in env if k in _TORCHRUN_ENV)
    assert env["TITAN_SWAP_TOKEN"] == "t" and env["PATH"] == os.environ["PATH"]

    ok = _rendezvous(env)
    assert ok.returncode == 0 and "rendezvous ok" in ok.stdout, ok.stderr[-2000:]
    # the control: the trainer's own environment cannot do that rendezvous
    hung = _rendezvous(dict(os.environ))
    assert hung.returncode != 0 and "rendezvous ok" not in hung.stdout


def test_trainer_waits_for_a_booting_generator_then_names_a_dead_one() -> None:
    """``--rl.generator-urls`` of a server still booting: the trainer waits until ``/health`` answers 200 (a
    server that comes up after 1.5 s is waited for); a port where nothing comes up fails after the timeout with
    the address in the error."""
    import http.server
    import threading
    import time

    from titan_rl_ext.rl.generator_server import wait_healthy

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    port = free_port()
    httpd: list[http.server.HTTPServer] = []

    def boot() -> None:
        time.sleep(1.5)
        httpd.append(http.server.HTTPServer(("127.0.0.1", port), Health))
        httpd[0].serve_forever()

    threading.Thread(target=boot, daemon=True).start()
    t0 = time.monotonic()
    try:
        wait_healthy(f"http://127.0.0.1:{port}/", timeout_s=30)
        assert time.monotonic() - t0 >= 1.4  # it did wait for the boot
    finally:
        while not httpd:
            time.sleep(0.1)
        httpd[0].shutdown()
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TimeoutError, match=dead.replace(".", r"\.")):
        wait_healthy(dead, timeout_s=1.0)
