"""Rank 0's link to the generators: the vLLM server a run spawns for itself, the weight pusher and the fleet
it feeds, the generators' batch-invariance setting, and the outcome of the last push.

The trainer (``rl/trainer.py``) decides *when* to push and what; this module holds *how* the generators are
reached. Only rank 0 has one: the other ranks take part in gathering the weights, never in talking to a server.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from titan_rl_ext import settings
from titan_rl_ext.kernels.batch_invariant import ENV_VAR as BI_ENV
from titan_rl_ext.rl.generator_server import wait_healthy
from titan_rl_ext.wire.protocol import GDN_RECURRENT_FIELD, SWAP_PORT_ENV, TOKEN_ENV, VERSION_ROUTE

if TYPE_CHECKING:
    from titan_rl_ext.rl.config import RLConfig
    from titan_rl_ext.rl.fleet import FleetPush, GeneratorFleet
    from titan_rl_ext.rl.weight_sync import WeightPusher

logger = logging.getLogger(__name__)


def check_recurrent_kernels(answers: dict[str, dict[str, Any]]) -> None:
    """Before BI steps: every generator runs the trainer's recurrent GDN kernel (``TITAN_GDN_RECURRENT``), or the
    run stops here naming the difference. A server too old to say passes (its BI gap will tell)."""
    from titan_rl_ext.kernels.gdn import RECURRENT_ENV, recurrent_kernel

    ours = recurrent_kernel()
    other = {u: a[GDN_RECURRENT_FIELD] for u, a in answers.items() if a.get(GDN_RECURRENT_FIELD) not in (None, ours)}
    if other:
        raise ValueError(f"{RECURRENT_ENV}: this trainer runs {ours!r}, but " + ", ".join(
            f"{u} runs {k!r}" for u, k in other.items()) + f"; batch-invariant parity needs the same kernel on both "
            f"sides: start the generators and the trainer with the same {RECURRENT_ENV}")


class GeneratorLink:
    def __init__(self, rl: RLConfig, run_dir: Path) -> None:
        self.rl, self.run_dir = rl, run_dir
        self.server: Any = None  # GeneratorServer when this run spawned one
        self._spawned_token = ""
        self.pusher: WeightPusher | None = None
        self.fleet: GeneratorFleet | None = None
        self.last_push: FleetPush | None = None
        self._bi: bool | None = None  # the setting the generators run

    def spawn(self, batch_invariant: bool) -> None:
        """Start the generator this run owns; it boots in the background until ``connect``."""
        from titan_rl_ext.rl.generator_server import GeneratorServer

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._spawned_token = settings.named(self.rl.swap_token_env) or secrets.token_hex(16)
        # what the weight transport needs of the server (a transfer engine's flags; ``RLConfig.spawned_server``)
        args, transport_env = self.rl.spawned_server()
        # the generator we start is ours: its weights listener (a free loopback port) is asked for here
        env = {**transport_env, TOKEN_ENV: self._spawned_token, SWAP_PORT_ENV: "0",
               BI_ENV: "1" if batch_invariant else "0"}
        self._bi = batch_invariant
        self.server = GeneratorServer(self.rl.model_dir, self.run_dir / "server.log", args, env,
                                      model_impl=self.rl.server_model_impl)

    def connect(self, batch_invariant: bool) -> dict[str, tuple[int, str | None]]:
        """Wait for a spawned generator, build the pusher and the fleet, set the generators' batch invariance
        for the first rollouts; the version and boot id each generator serves."""
        from titan_rl_ext.rl.fleet import GeneratorFleet
        from titan_rl_ext.rl.weight_sync import WeightPusher

        token = settings.named(self.rl.swap_token_env)
        urls = list(self.rl.generator_urls)
        for url in urls:  # servers started beside the trainer may still be booting
            wait_healthy(url, self.rl.server_boot_timeout_s)
        if self.server is not None:
            token = self._spawned_token
            self.server.wait_ready(self.rl.server_boot_timeout_s)
            urls.append(self.server.base)
        if not token:
            raise ValueError(f"set {self.rl.swap_token_env} to the generators' swap token")
        self.pusher = WeightPusher(urls, token, transport=self.rl.weight_transport,
                                   transport_options=self.rl.transport_options())
        self.fleet = GeneratorFleet(self.pusher)
        self.set_batch_invariant(batch_invariant)
        logging.getLogger("httpx").setLevel(logging.WARNING)
        answers = {u: self.server_info(u) for u in urls}
        if self.rl.batch_invariant_steps > 0:  # the kernel matters to BI parity only
            check_recurrent_kernels(answers)
        return {u: (int(a["version"]), a.get("boot_id")) for u, a in answers.items()}

    def exited(self, url: str) -> str | None:
        """Why the generator at ``url`` is gone for good: the server this run spawned there exited."""
        return self.server.exit_reason() if self.server is not None and self.server.base == url else None

    def serves(self, url: str, ours: dict[str, str]) -> bool:
        """Whether the generator at ``url`` holds exactly these weights (False where it cannot say: vLLM's
        native class has no per-tensor checksums under titan names, so it gets a push)."""
        assert self.pusher is not None, "connect first"
        try:
            return self.pusher.checksums(url) == ours
        except Exception as e:  # noqa: BLE001 - an unanswered comparison is a mismatch
            logger.info("RL: %s cannot compare checksums (%s); pushing", url, e)
            return False

    @staticmethod
    def server_info(url: str) -> dict[str, Any]:
        """A generator's answer on the version route: weight version, boot id, its GDN recurrent kernel, ..."""
        import requests

        r = requests.get(f"{url.rstrip('/')}{VERSION_ROUTE}", timeout=30)
        if r.status_code == 404:
            raise RuntimeError(f"{url} has no weight-swap endpoint: start it with TITAN_SWAP_TOKEN set")
        r.raise_for_status()
        return r.json()

    def set_batch_invariant(self, enabled: bool) -> None:
        """Switch the generators' batch invariance when it differs from what they run."""
        assert self.pusher is not None, "connect first"
        if enabled != self._bi:
            self.pusher.set_batch_invariant(enabled)
            self._bi = enabled

    def push(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Push to every generator; those that fail it leave the rollout pool until a later push reaches them."""
        assert self.fleet is not None, "connect first"
        self.last_push = self.fleet.push(state_dict, version, mode=self.rl.push_mode)

    def checksums(self) -> dict[str, str]:
        """The first generator's per-tensor checksums of what it serves."""
        assert self.pusher is not None, "connect first"
        return self.pusher.checksums()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
