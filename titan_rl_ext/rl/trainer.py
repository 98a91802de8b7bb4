"""RL post-training on torchtitan's ``Trainer``: rollouts from vLLM (``--model-impl titan``) instead of
the text dataloader, a policy-gradient loss from ``titan_rl_ext.rl.losses``, weights pushed back to
the generator(s) after the optimizer step.

    torchrun --standalone --nproc_per_node=1 -m titan_rl_ext.train --module titan_rl_ext.configs --config rl_tiny_cpu

One ``train_step`` (torchtitan's ``train()`` drives the loop, the checkpointer and the profiler):

1. take ``prompts_per_step`` groups of ``group_size`` rollouts from an ``OffPolicyWindow`` fed by
   producer tasks on a background asyncio thread (``offpolicy=0``: producers only generate with the
   weights being trained, i.e. synchronous on-policy RL; ``offpolicy=k``: at most k versions stale);
2. group advantages; forward, loss (DAPO by default) and backward, in loss chunks of whole samples
   (``rl/loss_chunks.py``); the forward's detached logprobs are the trainer's recompute for the
   ``bit_wise/*`` metrics against the generator's logprobs (exactly 0 under batch invariance on both sides);
3. grad clip, optimizer + LR scheduler step;
4. push the full titan state dict -- with LoRA (``rl.lora_rank``) the adapter tensors alone -- to every
   generator (``WeightPusher``) every ``push_every`` steps (and at the last step), bump the version, log
   metrics (``RUN_DIR/metrics.jsonl``, per-sample token versions in ``RUN_DIR/rollouts.jsonl``, and
   torchtitan's metrics processor).

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

LoRA (``rl.lora_rank > 0``): the model is built with adapters on ``rl.lora_targets`` and its base weights frozen, so
the optimizer holds the adapters alone (torchtitan builds it from the trainable parameters; FSDP shards frozen and
trainable parameters alike). A spawned generator is started with the same adapters (``--hf-overrides``: the titan
model's ``titan_lora`` setting), running generators must already serve them, and the base weights they serve must be
the trainer's (checked by checksum at start-up: an adapter-only run never pushes a base). Every push is the adapter
set alone, which the server takes all or none (``vllm_titan_plugin.swap.validate.push_spec``). Each of these steps
is a function of ``rl/lora_run.py``, which the trainer calls at the matching point.

Data parallelism (more than one rank): rank 0 generates, broadcasts the batch, every rank trains on
its share of the groups, the loss is normalised by the all-reduced token count, and rank 0 pushes
the gathered full state dict; ``bit_wise/*`` cover every rank's tokens. Tested with 2 CPU ranks (gloo,
FSDP2): ``tests/test_rl_train.py``.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torchtitan.distributed import utils as dist_utils
from torchtitan.trainer import Trainer

from titan_rl_ext.rl import cli, lora_run
from titan_rl_ext.rl.config import RLConfig
from titan_rl_ext.rl.generator_link import GeneratorLink
from titan_rl_ext.rl.phase_timer import PhaseTimer
from titan_rl_ext.rl.prompts import PromptCursor
from titan_rl_ext.rl.rollout_service import RolloutService
from titan_rl_ext.rl.stale_gap import StaleGap
from titan_rl_ext.rl.tasks import task_named

logger = logging.getLogger(__name__)

cli.install()  # before torchtitan parses the command line: recipes import this module to build their config

RL_STATE_KEY = "rl_version"
RL_PROMPTS_KEY = "rl_prompt_cursor"
ROLLOUTS_FILE = "rollouts.jsonl"
FINAL_CHECKSUMS_FILE = "final_checksums.json"



@dataclass
class _Rollouts:
    """The step's groups as every rank sees them, and this rank's share."""

    groups: list[list[Any]]
    staleness: list[int]
    dropped: int
    mixed: int
    cursor: PromptCursor
    mine: list[Any]
    spans: list[tuple[float, float]] = field(default_factory=list)
    """Rank 0: each group's generation span on the window's clock (``rl/generation_timeline.py``)."""

    @property
    def all_samples(self) -> list[Any]:
        return [s for g in self.groups for s in g]


def _full_state_dict(model: torch.nn.Module, only: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """The full (unsharded) titan state dict, or its entries whose names ``only`` accepts: the master weights;
    every rank must call it with the same ``only`` under FSDP (each entry is a collective)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in model.state_dict().items()
            if only is None or only(k)}


def _served_state_dict(model: torch.nn.Module, compute: torch.dtype | None,
                       only: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """The weights the trainer computes with (``precision.compute_view`` of the master weights): what it pushes,
    checksums against the generators and recomputes stale tokens with. Every rank must call it under FSDP."""
    from titan_rl_ext.models.common.precision import compute_view, fp32_param_names

    return compute_view(_full_state_dict(model, only), compute, fp32_param_names(model))


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
        if rl.loss_chunk_tokens < 0:
            raise ValueError(f"rl.loss_chunk_tokens must be >= 0 (0: one pass), got {rl.loss_chunk_tokens}")
        task = task_named(rl.task)  # an unknown name fails here, before any model is built
        rl.transport_options()  # so does an unknown transport or a bad option (not the first push, minutes later)
        if rl.spawn_server:
            rl.spawned_server()  # and server arguments that configure another transfer engine than the transport's
        self._lora = lora_run.setup_lora(config)  # a config the kernels cannot serve exactly fails here
        self._lora_base_kept = False  # LoRA: whether a push has gathered the frozen base once (``_push``)
        super().__init__(config)
        self.rl_task = task
        self.rl_version = 0
        self.prompt_cursor = PromptCursor()
        """The prompts the weights have been trained on (see ``PromptCursor``); checkpointed."""
        self.rl_loss = rl.loss.build()
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.run_dir = Path(rl.run_dir or Path(config.dump_folder) / "rl")
        from titan_rl_ext.models.common.titan_protocol import compute_dtype

        self._compute = compute_dtype(config.training)
        """Mixed precision: the dtype the forward computes in (None: the stored one), and so the dtype of what
        is pushed to the generators, who must serve it (``--dtype``)."""
        self._load_hf_weights(rl.model_dir)
        if self._lora is not None:
            lora_run.log_trainable(self._lora, self.model_parts[0])
        self._link: GeneratorLink | None = None  # rank 0: the generators (spawned server, pusher, fleet)
        self._service: RolloutService | None = None
        self._t_prev_end: float | None = None  # the last step's end (perf/trainer/tokens_per_second_full_step)
        self._phases = PhaseTimer(self.device)  # perf/trainer/<phase>/{host,device}_s
        self._stale = StaleGap(rl.stale_gap_versions, rl.model_dir, rl.stale_gap_device,
                               rl.loss_chunk_tokens, lora=self._lora)  # bit_wise_stale/*
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
        from torch.distributed.tensor import DTensor

        # LoRA: the base checkpoint has no adapters; they keep the fresh init torchtitan's init_weights gave them
        strict = self._lora is None
        if any(isinstance(p, DTensor) for p in model.parameters()):  # FSDP: more ranks, or mixed precision on one
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            result = set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, strict=strict))
        else:
            dtype = next(model.parameters()).dtype
            result = model.load_state_dict({k: v.to(dtype) if v.is_floating_point() and k != "rope.inv_freq" else v
                                            for k, v in sd.items()}, strict=strict)
        if not strict:
            lora_run.check_loaded(result, model_dir)
        logger.info("RL: loaded initial weights from %s", model_dir)

    def _start(self) -> None:
        """After the checkpoint load (``train()`` loads before the first step): generators, rollouts.

        Rank 0 talks to the generators. Comparing what they serve with the trainer's weights needs the full
        weights, and gathering sharded weights is collective: rank 0 broadcasts what it found, and every rank
        gathers (and pushes, when the generators serve other weights)."""
        rl = self.config.rl
        self._started = True
        if self.rank == 0:
            self._link = GeneratorLink(rl, self.run_dir)
            if rl.spawn_server:
                self._link.spawn(self._bi_at(self.step))
        if rl.warm_kernels:
            self._warm_kernels()  # every rank: a collective forward/backward under FSDP
        served = self._connect_generators() if self.rank == 0 else {}
        server_v = self._broadcast(max(v for v, _ in served.values()) if self.rank == 0 else 0)
        # Compare checksums before admitting any generator, a fresh run's too: version 0 on a server says
        # only that nobody pushed to it, not that it loaded the checkpoint this trainer starts from.
        from titan_rl_ext.rl.weight_sync import checksum

        sd = _served_state_dict(self.model_parts[0], self._compute)  # every rank: a collective gather under FSDP
        same = False
        problem = None
        if self.rank == 0:
            ours = checksum(sd)
            problem = None if self._lora is None else lora_run.generator_problem(
                self._lora, rl.model_dir, self._link.pusher, ours, served)
            same = problem is None and server_v == self.rl_version and all(self._link.serves(u, ours) for u in served)
        del sd
        if (problem := self._broadcast(problem)) is not None:
            raise ValueError(problem)
        if self._broadcast(same):
            logger.info("RL: generators already serve version %d (checksums match)", server_v)
            for u, (_, boot) in served.items():
                self._link.fleet.verify(u, server_v, boot)
        else:
            if server_v >= self.rl_version:
                if self.rank == 0:
                    logger.warning("RL: a generator at version %d holds other weights than the trainer's version %d "
                                   "(or cannot say: vLLM's native class); pushing them as version %d", server_v,
                                   self.rl_version, server_v + 1)
                self.rl_version = server_v + 1
            self._push(self.rl_version)  # every rank gathers, rank 0 pushes
        if self.rank != 0:
            return
        from transformers import AutoTokenizer

        if self.rl_version not in self._stale.history and self.world == 1:  # the weights the generators start on
            self._stale.remember(self.rl_version, _served_state_dict(self.model_parts[0], self._compute))
        tokenizer = AutoTokenizer.from_pretrained(rl.model_dir)
        if self.prompt_cursor != PromptCursor():
            logger.info("RL: prompt stream resumes at index %d (%d done ahead of it)", self.prompt_cursor.next,
                        len(self.prompt_cursor.done_ahead))
        self._service = RolloutService(rl, self._link.fleet, rl.served_model_name or rl.model_dir, tokenizer,
                                       self.rl_version, self.prompt_cursor, exited=self._link.exited)
        self._eval_items = self.rl_task.eval_items(rl, tokenizer) if rl.eval_every else []

    def _connect_generators(self) -> dict[str, tuple[int, str | None]]:
        """Rank 0: reach the generators (waiting for a spawned one) and open the metrics log; returns the
        version and boot id each generator serves."""
        from titan_rl_ext.rl.metrics import MetricsLogger

        self.run_dir.mkdir(parents=True, exist_ok=True)
        served = self._link.connect(self._bi_at(self.step))  # the first rollouts' setting
        self._mlog = MetricsLogger(self.run_dir, config={"rl": self.config.rl.to_dict()})
        return served

    def _warm_kernels(self) -> None:
        """Forward and backward of a synthetic batch shaped like a step's share, in its loss chunks
        (``rl.loss_chunk_tokens``), under the first step's kernel setting, while a spawned generator boots: on a
        fresh machine the trainer's Triton kernels compile and autotune here instead of after the generator is up
        (on a cold cache they are most of the BI arm's first step, and the generator's boot hid none of it:
        docs/gpu_runs.md §9, "The RL loop on the GPU"), and a step whose loss chunk does not fit in memory fails
        before any rollout. One chunk of each shape: the step's samples are all the same length here, so the
        other chunks would compile nothing and peak no higher. No weight changes: the gradients are dropped."""
        from titan_rl_ext.kernels.batch_invariant import batch_invariant
        from titan_rl_ext.models.common.batch import SeqBatch
        from titan_rl_ext.rl.logprobs import token_logprobs
        from titan_rl_ext.rl.loss_chunks import loss_chunks

        rl = self.config.rl
        t0 = time.perf_counter()
        model = self.model_parts[0]
        n = max(1, rl.prompts_per_step * rl.group_size // self.world)
        lens = [32 + rl.max_tokens] * n  # a prompt of a few dozen tokens and a full completion
        # the largest first, so a chunk that does not fit fails at once; every rank runs the same chunks (FSDP)
        shapes = sorted({hi - lo for lo, hi in loss_chunks(lens, rl.loss_chunk_tokens)}, reverse=True)
        g = torch.Generator().manual_seed(0)  # not the global generator: the run's randomness stays as it was
        with batch_invariant(self._bi_at(self.step)):
            for k in shapes:
                tokens_T = torch.randint(0, model.config.vocab_size, (k * lens[0],), generator=g).to(self.device)
                lp_T = token_logprobs(model, tokens_T, SeqBatch.from_lengths(lens[:k], device=self.device))
                lp_T[~lp_T.isnan()].sum().backward()
        self.optimizers.zero_grad(set_to_none=True)
        if self.rank == 0:
            logger.info("RL: kernels warmed in %.1f s (%d tokens: %d loss chunk(s), one of each size)%s",
                        time.perf_counter() - t0, sum(shapes) * lens[0], len(shapes),
                        " while the generator boots" if rl.spawn_server else "")

    def _bi_at(self, step: int) -> bool:
        rl = self.config.rl
        return rl.batch_invariant_from <= step < rl.batch_invariant_from + rl.batch_invariant_steps

    def _sync_generator_bi(self, enabled: bool) -> None:
        """Rank 0: switch the generators' batch invariance when it differs from what they run."""
        if self.rank == 0:
            self._link.set_batch_invariant(enabled)

    def _push(self, version: int) -> dict[str, float]:
        """All ranks gather the full state dict; rank 0 pushes it. Returns the push wall time and, on rank 0,
        where it went (with the fleet's ``swap/post_s`` and the servers' phases, ``FleetPush.metrics``)."""
        from titan_rl_ext.rl.metrics import SWAP_LATENCY_S

        t0 = time.perf_counter()
        # LoRA: once the stale-gap store holds the frozen base (the first full gather), a push gathers the adapters
        # alone -- a full gather of a 9B model would copy ~18 GB a step to send megabytes. Decided alike on every
        # rank (each entry of the gather is a collective).
        only = None
        if self._lora is not None and self._lora_base_kept:
            from titan_rl_ext.models.common.lora import is_lora_param

            only = is_lora_param
        sd = _served_state_dict(self.model_parts[0], self._compute, only)
        self._lora_base_kept = self._lora is not None
        t_gathered = time.perf_counter()
        if self.rank != 0:
            return {SWAP_LATENCY_S: time.perf_counter() - t0}
        payload = lora_run.push_payload(sd, self._lora)  # LoRA: the adapters alone
        self._link.push(payload, version)
        t_posted = time.perf_counter()
        self._stale.remember(version, sd)
        t_end = time.perf_counter()
        answers = self._link.last_push.responses.values() if self._link.last_push is not None else ()
        return {SWAP_LATENCY_S: t_end - t0, "swap/gather_s": t_gathered - t0, "swap/remember_s": t_end - t_posted,
                "swap/pushed_tensors": float(len(payload)),
                "swap/pushed_tensor_bytes": float(sum(t.numel() * t.element_size() for t in payload.values())),
                # what the servers say they received (body bytes: the tensors and the safetensors header)
                "swap/server_tensors": max((float(a.get("num_tensors", 0)) for a in answers), default=float("nan")),
                "swap/server_bytes": max((float(a.get("bytes", 0)) for a in answers), default=float("nan"))}

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

    def train_step(self, data_iterator: Any) -> None:
        from titan_rl_ext.kernels.batch_invariant import set_batch_invariant

        del data_iterator  # the text dataloader is built by torchtitan but never read
        if not self._started:
            self._start()
            self.rl_version = self._broadcast(self.rl_version)
        bi = self._bi_at(self.step)
        set_batch_invariant(bi)
        self._sync_generator_bi(bi)  # a no-op unless the setting was not switched at the last publish
        t = [time.perf_counter()]
        ro = self._take_rollouts()
        t.append(time.perf_counter())
        self._phases.start()
        packed, lp_re_T, loss, lmetrics = self._forward_backward(ro)
        self._phases.mark("fwd_bwd")
        bw = self._parity_metrics(ro, packed, lp_re_T)
        self._phases.mark("parity")
        grad_norm, lr_metrics = self._optimizer_step(ro)
        self._phases.mark("optim")
        t.append(time.perf_counter())
        push_m = self._push_and_publish()
        t.append(time.perf_counter())
        self._log_step(ro, bi, loss, lmetrics, grad_norm, lr_metrics, bw, push_m, t)
        last = self.step >= self.config.training.steps
        if last and self.config.rl.final_checksums:
            self._write_final_checksums()
        if last and self.config.rl.export_hf_dir:
            self._export_hf(self.config.rl.export_hf_dir)
        if last and self.config.rl.export_adapter_dir:
            self._export_adapter(self.config.rl.export_adapter_dir)

    def _take_rollouts(self) -> _Rollouts:
        """1. Rank 0 takes the step's groups and broadcasts them; each rank keeps its share."""
        batch, cursor = self._service.take(self.rl_version) if self.rank == 0 else (None, None)
        payload = None
        if self.rank == 0:
            payload = ([g.samples for g in batch.groups], list(batch.staleness), batch.dropped_stale,
                       sum(g.mixed_versions for g in batch.groups), cursor)
        # every rank checkpoints the same cursor (DCP keeps one copy of a replicated object)
        groups, staleness, dropped, mixed, cursor = self._broadcast(payload)
        mine = [s for i, g in enumerate(groups) if i % self.world == self.rank for s in g]
        if not mine:
            raise ValueError(f"prompts_per_step={len(groups)} leaves rank {self.rank} without groups")
        spans = [(g.started_at, g.finished_at) for g in batch.groups] if self.rank == 0 else []
        return _Rollouts(groups, staleness, dropped, mixed, cursor, mine, spans)

    def _parity_metrics(self, ro: _Rollouts, packed: Any, lp_re_T: torch.Tensor) -> dict[str, float]:
        """``bit_wise/*`` over tokens sampled with the weights being trained (older tokens differ because
        the policy moved), ``bit_wise_all/*`` over every loss token, ``bit_wise_stale/*`` (rank 0) over
        older versions recomputed with their own weights. Every rank's tokens count."""
        from titan_rl_ext.rl.metrics import bit_wise_metrics, gap_metrics
        from titan_rl_ext.rl.samples import exact_at_mask

        # whole turns only: the tail of a turn a swap split is at this version but was sampled over a cache
        # the older weights wrote (seen under CI load: a 4e-4 "fresh" gap)
        fresh_T = exact_at_mask(ro.mine, self.rl_version, device=self.device)
        # gather the (few thousand) compared logprobs before reducing
        gen_f, re_f = self._gather_cat(packed.gen_logprobs_T[fresh_T]), self._gather_cat(lp_re_T[fresh_T])
        gen_a = self._gather_cat(packed.gen_logprobs_T[packed.loss_mask_T])
        re_a = self._gather_cat(lp_re_T[packed.loss_mask_T])
        bw = gap_metrics(gen_f, re_f)  # NaN when there are no fresh tokens (a stale batch)
        bw.update({k.replace("bit_wise/", "bit_wise_all/"): v
                   for k, v in bit_wise_metrics(gen_a, re_a, torch.ones_like(gen_a, dtype=torch.bool)).items()})
        if self.rank == 0 and self.config.rl.stale_gap_versions > 0:
            bw.update(self._stale.metrics(ro.all_samples, self.rl_version,
                                          self._compute or next(self.model_parts[0].parameters()).dtype,
                                          self.device))
        return bw

    def _forward_backward(self, ro: _Rollouts) -> tuple[Any, torch.Tensor, torch.Tensor, dict[str, Any]]:
        """2. Advantages (over whole groups: a rank holds complete groups), then forward, loss and backward
        per loss chunk (``rl.loss_chunk_tokens``, ``rl/loss_chunks.py``). Returns the step's packed samples, the
        trainer's detached logprobs over them (its recompute for the parity metrics), the loss and its
        metrics."""
        from titan_rl_ext.rl.advantages import group_advantages
        from titan_rl_ext.rl.loss_chunks import forward_backward
        from titan_rl_ext.rl.samples import pack_samples

        rl = self.config.rl
        packed = pack_samples(ro.mine, device=self.device)
        adv_N = group_advantages(packed.rewards_N, group_ids_N=packed.group_ids_N, normalize_std=rl.normalize_adv_std)
        norm: dict[str, Any] = {}
        if self.rl_loss.config.aggregation == "token_mean":
            global_tokens = packed.loss_mask_T.sum()
            if self.world > 1:
                torch.distributed.all_reduce(global_tokens)
            norm["num_global_valid_tokens"] = global_tokens
        elif self.world > 1:
            norm["num_global_seqs"] = len(ro.all_samples)
        else:  # one rank: the samples with loss tokens, as a one-pass seq_mean counts them
            norm["num_global_seqs"] = max(1, sum(s.num_loss_tokens > 0 for s in ro.mine))
        self.optimizers.zero_grad(set_to_none=True)
        # partial sums over ranks; FSDP averages gradients, so scale back to a sum
        lp_T, loss, metrics = forward_backward(self.model_parts[0], packed, adv_N, self.rl_loss, norm,
                                               rl.loss_chunk_tokens, rl.old_logprobs, grad_scale=self.world)
        return packed, lp_T, loss, metrics

    def _optimizer_step(self, ro: _Rollouts) -> tuple[torch.Tensor, dict[str, Any]]:
        """3. Clip, optimizer and LR step; the weights become the next version."""
        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()], self.config.training.max_norm, foreach=True,
            pp_mesh=self.parallel_dims.get_optional_mesh("pp"), ep_enabled=self.parallel_dims.ep_enabled,
        )
        lr_metrics = self.lr_schedulers.get_metrics()
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        self.rl_version += 1
        self.prompt_cursor = ro.cursor
        return grad_norm, lr_metrics

    def _push_and_publish(self) -> dict[str, float]:
        """4. Every ``push_every`` steps (and at the last): push the new weights, switch the generators' BI
        setting for the next step, publish the version to the rollout window. Returns the push's metrics
        (``swap/latency_s`` NaN when this step does not push)."""
        from titan_rl_ext.rl.metrics import SWAP_LATENCY_S

        rl = self.config.rl
        if not (self.step % rl.push_every == 0 or self.step >= self.config.training.steps):
            return {SWAP_LATENCY_S: float("nan")}
        push_m = self._push(self.rl_version)
        if self.rank == 0:
            self._sync_generator_bi(self._bi_at(self.step + 1))  # the next step's groups come from here
            self._service.publish(self.rl_version)
        return push_m

    def _log_step(self, ro: _Rollouts, bi: bool, loss: torch.Tensor, lmetrics: dict[str, Any], grad_norm: torch.Tensor,
                  lr_metrics: dict[str, Any], bw: dict[str, float], push_m: dict[str, float], t: list[float]) -> None:
        """5. Metrics (``RUN_DIR/metrics.jsonl``, rollouts, torchtitan's processor) and the evaluation."""
        from titan_rl_ext.rl.advantages import zero_variance_groups
        from titan_rl_ext.rl import metrics as M
        from titan_rl_ext.rl.generation_timeline import step_timeline
        from titan_rl_ext.rl.gpu_memory import step_memory_metrics
        from titan_rl_ext.rl.metrics import loss_metrics, rollout_metrics

        rl = self.config.rl
        t_start, t_taken, t_trained, t_end = t
        # a full step runs from the last step's end (its push) to this one's: what the loop spent between
        # the two (the last step's logging and evaluation, torchtitan's own loop, a checkpoint) counts too
        t_prev = self._t_prev_end if self._t_prev_end is not None else t_start
        self._t_prev_end = t_end
        last = self.step >= self.config.training.steps
        loss_v = float(loss.detach())
        if self.world > 1:
            lt = torch.tensor([loss_v], device=self.device)
            torch.distributed.all_reduce(lt)
            loss_v = float(lt)
        groups, staleness, all_samples = ro.groups, ro.staleness, ro.all_samples
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
            "rollout/dropped_stale": ro.dropped,
            "rollout/mixed_version_groups": ro.mixed / len(groups),
            "rollout/token_version_min": min(versions, default=-1),
            "rollout/token_version_max": max(versions, default=-1),
            **(self._link.last_push.metrics() if self.rank == 0 and self._link.last_push is not None else {}),
            **push_m,
            M.TRAINER_BETWEEN_S: t_start - t_prev,
            M.TRAINER_WAIT_S: t_taken - t_start,
            M.TRAINER_STEP_S: t_trained - t_taken,
            **self._phases.metrics(),  # the step's phases: fwd_bwd, parity (incl. the stale-gap recompute), optim
            M.TOKENS_PER_SECOND_FULL_STEP: ntok / max(t_end - t_prev, 1e-9),
            "perf/trainer/tokens_per_second_train": ntok / max(t_trained - t_taken, 1e-9),
            **{f"lr/{k}": float(v) for k, v in lr_metrics.items()},
        }
        if self.rank == 0:
            metrics.update(step_timeline(ro.spans, t_prev, t_end, [s.num_loss_tokens for s in all_samples]))
            server = self._link.server if self._link is not None else None
            metrics.update(step_memory_metrics(self.device, server.proc.pid if server is not None else None))
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
                metrics[M.TOKENS_PER_SECOND_FULL_STEP], push_m[M.SWAP_LATENCY_S],
            )
        # torchtitan's console/TensorBoard logger
        if self.metrics_processor.should_log(self.step):
            self.metrics_processor.ntokens_since_last_log += ntok
            self.metrics_processor.data_loading_times.append(t_taken - t_start)
            scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k not in ("loss", "grad_norm")}
            self.metrics_processor.log(self.step, loss_v, loss_v, float(grad_norm), extra_metrics=scalars)

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

        sd = _served_state_dict(self.model_parts[0], self._compute)  # what the generators were given
        if self.rank != 0:
            return
        ours = checksum(sd)
        out: dict[str, Any] = {"step": self.step, "version": self.rl_version, "checksums": ours}
        try:
            theirs = self._link.checksums()
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

    def _export_adapter(self, out_dir: str) -> None:
        sd = _full_state_dict(self.model_parts[0])  # every rank gathers (FSDP); rank 0 writes
        if self.rank == 0:
            lora_run.export_adapter(sd, self._lora, self.model_config.arch,  # type: ignore[attr-defined]
                                    self.config.rl.model_dir, out_dir)
            logger.info("exported the LoRA adapter at step %d in PEFT's format: %s", self.step, out_dir)

    def close(self) -> None:
        if getattr(self, "_service", None) is not None:
            self._service.close()
            self._service = None
        if getattr(self, "_link", None) is not None:
            self._link.close()
            self._link = None
        if getattr(self, "_mlog", None) is not None:
            self._mlog.close()
            self._mlog = None
        super().close()
