"""LoRA adapters inside the titan layers: ``y = base(x) + (alpha / r) * B(A(x))`` on chosen projections.

The adapters live in the one model definition, so the trainer and an engine running this model compute them
with the same code. Every matmul of an adapter goes through ``ops.linear``, the op behind the
batch-invariance switch, and the order is fixed -- ``A`` then ``B`` then the scale then the add onto the base
output -- so in batch-invariant mode each token's adapter output is a function of that token's row alone, and
the bits the trainer gets for a token are the bits the generator gets. Reordering (e.g. scaling ``A`` first,
or merging ``B @ A`` into the base weight) is a different rounding: it would still agree with PEFT within fp32
tolerance but no longer with the other side bit for bit, so both sides must run this module, not a variant.

Targets are named as in HF / PEFT (``q_proj`` ... ``down_proj``). Titan merges projections that read one
input into one ``MergedLinear`` (``wqkv``, GDN's ``in_proj``, ``w13``); an adapter on one HF projection is an
adapter on that part's columns of the merged output, with its own ``A`` and ``B`` -- exactly PEFT's, so the
adapter's tensors map one to one onto PEFT's keys (``models.peft_adapter``).

Refused when the config is built or applied, with the reason: dropout (the generator cannot reproduce the
trainer's dropout mask, so the logprobs could not match), rank <= 0, an unknown target, a target that no
layer of the architecture has, MLP targets on MoE experts (not written yet).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from titan_rl_ext.kernels import ops

# HF module name (the PEFT target) -> (titan module path inside a block, part of a MergedLinear or None)
TARGETS: dict[str, tuple[str, int | None]] = {
    "q_proj": ("attention.wqkv", 0),
    "k_proj": ("attention.wqkv", 1),
    "v_proj": ("attention.wqkv", 2),
    "o_proj": ("attention.wo", None),
    "in_proj_qkv": ("linear_attn.in_proj", 0),
    "in_proj_z": ("linear_attn.in_proj", 1),
    "in_proj_b": ("linear_attn.in_proj", 2),
    "in_proj_a": ("linear_attn.in_proj", 3),
    "out_proj": ("linear_attn.out_proj", None),
    "gate_proj": ("feed_forward.w13", 0),
    "up_proj": ("feed_forward.w13", 1),
    "down_proj": ("feed_forward.w2", None),
}
_MLP_TARGETS = frozenset({"gate_proj", "up_proj", "down_proj"})
HYBRID_TARGETS = tuple(TARGETS)
"""Every projection a Qwen3.5 hybrid has (attention, GDN and MLP): the default adapter set of the LoRA recipes."""

HF_CONFIG_KEY = "titan_lora"
"""Key of the LoRA settings in a served model's HF config (``--hf-overrides '{"titan_lora": {...}}'``): how a vLLM
server learns which adapters its titan model carries (``LoRAConfig.to_hf`` / ``lora_from_hf_config``)."""
_HF_FIELDS = ("rank", "alpha", "targets", "dropout")


class LoRAConfigError(ValueError):
    """A LoRA configuration this model cannot run exactly. The message says why."""


@dataclass(frozen=True)
class LoRAConfig:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise LoRAConfigError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        if self.dropout != 0:
            raise LoRAConfigError(
                f"LoRA dropout {self.dropout} refused: the generator cannot reproduce the trainer's dropout mask, "
                "so trainer and generator logprobs could not match; use dropout 0"
            )
        if not self.targets:
            raise LoRAConfigError("LoRA needs at least one target module")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown:
            raise LoRAConfigError(f"unsupported LoRA target modules {unknown}; supported: {', '.join(TARGETS)}")
        if len(set(self.targets)) != len(self.targets):
            raise LoRAConfigError(f"LoRA target modules listed twice: {list(self.targets)}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_hf(self) -> dict[str, object]:
        """The JSON form ``lora_from_hf_config`` reads (the value of ``HF_CONFIG_KEY``)."""
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets), "dropout": self.dropout}


def lora_from_hf_config(hf_config: dict[str, object]) -> LoRAConfig | None:
    """The ``LoRAConfig`` an HF config carries under ``HF_CONFIG_KEY`` (None: no adapters); refuses a malformed
    value or unknown field with the reason, so a server with a bad override fails at start-up."""
    value = hf_config.get(HF_CONFIG_KEY)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise LoRAConfigError(f"{HF_CONFIG_KEY} must be a JSON object with fields {_HF_FIELDS}, got {value!r}")
    unknown = sorted(set(value) - set(_HF_FIELDS))
    if unknown:
        raise LoRAConfigError(f"{HF_CONFIG_KEY}: unknown fields {unknown}; expected {list(_HF_FIELDS)}")
    missing = [k for k in ("rank", "alpha", "targets") if k not in value]
    if missing:
        raise LoRAConfigError(f"{HF_CONFIG_KEY}: missing fields {missing}")
    targets = value["targets"]
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise LoRAConfigError(f"{HF_CONFIG_KEY}.targets must be a list of module names, got {targets!r}")
    return LoRAConfig(rank=value["rank"], alpha=float(value["alpha"]), targets=tuple(targets),  # type: ignore[arg-type]
                      dropout=float(value.get("dropout", 0.0)))  # type: ignore[arg-type]


class LoRAAdapter(nn.Module):
    """One adapter: ``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]`` (the layouts of PEFT's ``nn.Linear`` weights).
    Not an ``nn.Linear``, so ``Decoder.init_weights`` calls ``reset_parameters`` instead of its normal init."""

    def __init__(self, in_features: int, out_features: int, rank: int, scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.lora_A = nn.Parameter(torch.empty(rank, in_features))
        self.lora_B = nn.Parameter(torch.empty(out_features, rank))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # PEFT's default: A as nn.Linear's init, B zero, so a fresh adapter leaves the model unchanged
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def forward(self, x_TI: torch.Tensor) -> torch.Tensor:
        # the fixed order (module docstring): A, then B, then the scale
        return ops.linear(ops.linear(x_TI, self.lora_A), self.lora_B) * self.scale

    def extra_repr(self) -> str:
        r, i = self.lora_A.shape
        return f"in={i}, out={self.lora_B.shape[0]}, rank={r}, scale={self.scale:g}"


def _add_adapters(base_TO: torch.Tensor, x_TI: torch.Tensor, parts: Sequence[int], lora: nn.ModuleDict) -> torch.Tensor:
    """``base_TO`` with each adapter's output added onto its part's columns (the add last: the fixed order)."""
    pieces = list(torch.split(base_TO, list(parts), dim=-1))
    for j, adapter in lora.items():
        pieces[int(j)] = pieces[int(j)] + adapter(x_TI)
    return torch.cat(pieces, dim=-1) if len(pieces) > 1 else pieces[0]


class LoRALinear(ops.Linear):
    """``ops.Linear`` plus one adapter (``lora["0"]``); ``weight``/``bias`` keep their names, so checkpoints of
    the base model load unchanged."""

    def __init__(self, in_features: int, out_features: int, bias: bool, cfg: LoRAConfig) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.lora = nn.ModuleDict({"0": LoRAAdapter(in_features, out_features, cfg.rank, cfg.scale)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _add_adapters(super().forward(x), x, (self.out_features,), self.lora)


class LoRAMergedLinear(ops.MergedLinear):
    """``ops.MergedLinear`` with adapters on some parts (``lora[str(part)]``), each on that part's columns."""

    def __init__(self, in_features: int, parts: Sequence[int], bias: bool, lora_parts: Iterable[int], cfg: LoRAConfig) -> None:
        super().__init__(in_features, parts, bias=bias)
        self.lora = nn.ModuleDict(
            {str(j): LoRAAdapter(in_features, self.parts[j], cfg.rank, cfg.scale) for j in sorted(lora_parts)}
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _add_adapters(super().forward(x), x, self.parts, self.lora)


def _with_adapters(base: ops.Linear, lora_parts: set[int | None], cfg: LoRAConfig) -> ops.Linear:
    """A LoRA module sharing ``base``'s parameters (no copy, no re-init: works on meta and real tensors)."""
    bias = base.bias is not None
    if isinstance(base, ops.MergedLinear):
        new: ops.Linear = LoRAMergedLinear(base.in_features, base.parts, bias, {j for j in lora_parts if j is not None}, cfg)
    else:
        new = LoRALinear(base.in_features, base.out_features, bias, cfg)
    new.weight = base.weight
    if bias:
        new.bias = base.bias
    return new.to(device=base.weight.device, dtype=base.weight.dtype)


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> None:
    """Put adapters on ``cfg.targets`` in every block of ``model`` (a ``Decoder``) that has them and freeze every
    other parameter. Refuses a target no block has, and MLP targets where blocks run MoE experts."""
    layers = model.layers  # type: ignore[attr-defined]
    if any(hasattr(block, "moe") for block in layers) and _MLP_TARGETS & set(cfg.targets):
        raise LoRAConfigError(
            f"LoRA on MLP targets {sorted(_MLP_TARGETS & set(cfg.targets))} of MoE layers is not supported yet "
            "(experts are grouped GEMMs, not linears)"
        )
    found: set[str] = set()
    for block in layers:
        wanted: dict[str, set[int | None]] = {}
        for name in cfg.targets:
            path, part = TARGETS[name]
            try:
                block.get_submodule(path)
            except AttributeError:
                continue
            wanted.setdefault(path, set()).add(part)
            found.add(name)
        for path, parts in wanted.items():
            parent_path, _, attr = path.rpartition(".")
            parent = block.get_submodule(parent_path)
            setattr(parent, attr, _with_adapters(getattr(parent, attr), parts, cfg))
    lacking = [t for t in cfg.targets if t not in found]
    if lacking:
        raise LoRAConfigError(f"LoRA targets {lacking} do not exist in this architecture ({type(model).__name__} "
                              f"with layer types {sorted({b.layer_type for b in layers})})")
    for name, p in model.named_parameters():
        p.requires_grad_(is_lora_param(name))


def is_lora_param(name: str) -> bool:
    return ".lora." in name


def lora_modules(model: nn.Module) -> dict[str, LoRAAdapter]:
    """Every adapter by its module path (``layers.0.attention.wqkv.lora.0``)."""
    return {path: m for path, m in model.named_modules() if isinstance(m, LoRAAdapter)}


def lora_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a titan state dict: what an adapter-only push carries."""
    return {k: v for k, v in state_dict.items() if is_lora_param(k)}


@torch.no_grad()
def zero_lora(model: nn.Module) -> None:
    """Adapters with A = 0 and B = 0: the identity, deterministic and independent of any RNG (a generator's start,
    before the trainer pushes its adapter; ``reset_lora``'s random A would draw from the server's generator)."""
    for m in lora_modules(model).values():
        m.lora_A.zero_()
        m.lora_B.zero_()


def reset_lora(model: nn.Module) -> None:
    """Fresh adapters (A random, B zero) -- after ``to_empty`` or to start a new adapter on a loaded model."""
    for m in lora_modules(model).values():
        m.reset_parameters()
