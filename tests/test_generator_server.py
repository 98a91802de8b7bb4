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
