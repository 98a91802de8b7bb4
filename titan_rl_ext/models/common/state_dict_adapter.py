"""Strict mapping between HF checkpoints and the titan parameter names.

Strictness is the point: every HF tensor either maps onto a titan parameter or belongs to a part the
text model deliberately does not serve (vision tower, MTP head), which is skipped with one log line.
Anything else -- a missing key, an unexpected key, a wrong shape, an incomplete expert set -- raises a
``CheckpointMismatchError`` naming the keys. Nothing is dropped silently.

The titan model merges projections that read the same input (q/k/v, GDN's qkv/z/b/a, gate/up) into one
``MergedLinear``; HF keeps them split. ``from_hf`` concatenates the parts in column order (every part
present, each with the part's row count) and ``to_hf`` splits them back, so a round trip is exact.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections import defaultdict
from typing import Literal

import torch

from titan_rl_ext.kernels.ops import MergedLinear
from titan_rl_ext.models.common.decoder import DecoderConfig

logger = logging.getLogger(__name__)

TextLayout = Literal["text", "vlm"]
ExpertLayout = Literal["fused", "per_expert"]

# HF per-layer suffix -> titan per-layer suffix (1:1 renames).
_LAYER_RENAMES: dict[str, str] = {
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.o_proj.bias": "attention.wo.bias",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "linear_attn.conv1d.weight": "linear_attn.conv_weight",
    "linear_attn.dt_bias": "linear_attn.dt_bias",
    "linear_attn.A_log": "linear_attn.A_log",
    "linear_attn.norm.weight": "linear_attn.norm.weight",
    "linear_attn.out_proj.weight": "linear_attn.out_proj.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.gate.weight": "moe.router.gate.weight",
    "mlp.experts.down_proj": "moe.experts.w2",
    "mlp.shared_expert.down_proj.weight": "moe.shared_expert.w2.weight",
    "mlp.shared_expert_gate.weight": "moe.shared_gate.weight",
}
_LAYER_RENAMES_INV = {v: k for k, v in _LAYER_RENAMES.items()}
# titan merged projection (``ops.MergedLinear``) -> the HF modules of its parts, in column order; each
# parameter (".weight", ".bias") is the concatenation along dim 0 of the parts' tensors
_MERGED: dict[str, tuple[str, ...]] = {
    "attention.wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "linear_attn.in_proj": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
                            "linear_attn.in_proj_a"),
    "feed_forward.w13": ("mlp.gate_proj", "mlp.up_proj"),
    "moe.shared_expert.w13": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
}
_PART_OF: dict[str, tuple[str, int]] = {
    f"{hf}.{p}": (f"{merged}.{p}", j) for merged, hfs in _MERGED.items() for j, hf in enumerate(hfs) for p in ("weight", "bias")
}
_FUSED_GATE_UP = "mlp.experts.gate_up_proj"  # [E, 2I, D] = cat(w1, w3) along dim 1
_PER_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_PER_EXPERT_TARGET = {"gate_proj": "moe.experts.w1", "up_proj": "moe.experts.w3", "down_proj": "moe.experts.w2"}
_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the model. The message names every offending key."""


def _fmt(keys: list[str], limit: int = 20) -> str:
    keys = sorted(keys)
    more = f" ... (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


class HFStateDictAdapter:
    """``from_hf`` / ``to_hf`` for one model config. ``to_hf`` writes the layout ``from_hf`` last saw
    (text or VLM keys, fused or per-expert MoE weights), so a round trip reproduces the checkpoint."""

    # key prefixes of parts a text model does not serve; skipped on load with one log line
    skipped_prefixes: tuple[str, ...] = ()
    # key prefixes under which the text model lives, by layout
    text_prefixes: dict[str, str] = {"text": "model."}

    def __init__(
        self,
        config: DecoderConfig,
        layout: TextLayout = "text",
        expert_layout: ExpertLayout = "fused",
    ) -> None:
        self.config = config
        self.layout: TextLayout = layout
        self.expert_layout: ExpertLayout = expert_layout
        with torch.device("meta"):  # LoRA adapters are no part of an HF checkpoint (``models.peft_adapter``)
            model = dataclasses.replace(config, lora=None).build()
        self.expected: dict[str, torch.Size] = {k: v.shape for k, v in model.state_dict().items()}
        # merged parameter (titan key) -> its parts' row counts, read off the model's MergedLinear modules
        self.merged_parts: dict[str, tuple[int, ...]] = {
            f"{path}.{p}": m.parts for path, m in model.named_modules() if isinstance(m, MergedLinear)
            for p in ("weight", "bias") if getattr(m, p, None) is not None
        }

    # -- HF -> titan ------------------------------------------------------------------------------
    def detect_layout(self, hf_keys: list[str]) -> TextLayout:
        # longest prefix first: "model.language_model." must win over "model."
        for layout, prefix in sorted(self.text_prefixes.items(), key=lambda kv: -len(kv[1])):
            if any(k.startswith(prefix + "embed_tokens.") for k in hf_keys):
                return layout  # type: ignore[return-value]
        raise CheckpointMismatchError(
            "cannot find the embedding table: expected one of "
            + ", ".join(p + "embed_tokens.weight" for p in self.text_prefixes.values())
        )

    def from_hf(self, hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        layout = self.detect_layout(list(hf_sd))
        prefix = self.text_prefixes[layout]
        out: dict[str, torch.Tensor] = {}
        unexpected: list[str] = []
        skipped: list[str] = []
        merged: dict[str, dict[int, tuple[str, torch.Tensor]]] = defaultdict(dict)  # titan key -> part -> (HF key, t)
        experts: dict[tuple[int, str], dict[int, torch.Tensor]] = defaultdict(dict)
        expert_source: dict[tuple[int, str], list[str]] = defaultdict(list)
        saw_per_expert = saw_fused = False

        for key, t in hf_sd.items():
            if key.startswith(self.skipped_prefixes):
                skipped.append(key)
                continue
            if key == "lm_head.weight":
                if self.config.tie_embeddings:
                    emb = hf_sd.get(prefix + "embed_tokens.weight")
                    if emb is None or not torch.equal(emb, t):
                        raise CheckpointMismatchError(
                            "config ties word embeddings but lm_head.weight differs from the embedding table"
                        )
                    continue
                out["output.weight"] = t
                continue
            if not key.startswith(prefix):
                unexpected.append(key)
                continue
            rest = key[len(prefix) :]
            if rest == "embed_tokens.weight":
                out["tok_embeddings.weight"] = t
                continue
            if rest == "norm.weight":
                out["norm.weight"] = t
                continue
            m = _LAYER_KEY.fullmatch(rest)
            if m is None:
                unexpected.append(key)
                continue
            i, suffix = int(m.group(1)), m.group(2)
            if suffix in _LAYER_RENAMES:
                out[f"layers.{i}.{_LAYER_RENAMES[suffix]}"] = t
            elif suffix in _PART_OF:
                target, j = _PART_OF[suffix]
                merged[f"layers.{i}.{target}"][j] = (key, t)
            elif suffix == _FUSED_GATE_UP:
                saw_fused = True
                if t.dim() != 3 or t.shape[1] % 2:
                    raise CheckpointMismatchError(f"{key}: expected [E, 2*I, D], got {tuple(t.shape)}")
                w1, w3 = t.chunk(2, dim=1)
                out[f"layers.{i}.moe.experts.w1"] = w1
                out[f"layers.{i}.moe.experts.w3"] = w3
            elif (pm := _PER_EXPERT.fullmatch(suffix)) is not None:
                saw_per_expert = True
                target = f"layers.{i}.{_PER_EXPERT_TARGET[pm.group(2)]}"
                experts[(i, target)][int(pm.group(1))] = t
                expert_source[(i, target)].append(key)
            else:
                unexpected.append(key)

        for (_, target), parts in experts.items():
            if self.config.moe is None:
                unexpected.extend(expert_source[(_, target)])
                continue
            n = self.config.moe.num_experts
            ids = sorted(parts)
            if ids != list(range(n)):
                missing_ids = sorted(set(range(n)) - set(ids))
                extra_ids = sorted(set(ids) - set(range(n)))
                raise CheckpointMismatchError(
                    f"{target}: per-expert weights incomplete (missing experts {missing_ids}, unexpected {extra_ids})"
                )
            shapes = {tuple(p.shape) for p in parts.values()}
            if len(shapes) != 1:
                raise CheckpointMismatchError(f"{target}: experts have different shapes {sorted(shapes)}")
            out[target] = torch.stack([parts[e] for e in range(n)])

        missing_parts: list[str] = []
        bad_parts: list[str] = []
        for target, parts in merged.items():
            sizes = self.merged_parts.get(target)
            if sizes is None:  # parts of a projection this config does not have (e.g. a bias)
                unexpected.extend(k for k, _ in parts.values())
                continue
            names = self._part_names(target, prefix)
            missing_parts += [names[j] for j in range(len(sizes)) if j not in parts]
            tail = tuple(self.expected[target][1:])
            bad_parts += [f"{k}: checkpoint {tuple(t.shape)} vs model part {(sizes[j], *tail)}" for j, (k, t) in parts.items()
                          if t.dim() != 1 + len(tail) or t.shape[0] != sizes[j] or tuple(t.shape[1:]) != tail]
            if len(parts) == len(sizes) and not bad_parts:
                out[target] = torch.cat([parts[j][1] for j in range(len(sizes))], dim=0)
        if missing_parts or bad_parts:
            raise CheckpointMismatchError("checkpoint does not match the model config -- "
                                          + " | ".join(([f"missing keys: {_fmt(missing_parts)}"] if missing_parts else [])
                                                       + ([f"shape mismatches: {'; '.join(bad_parts[:20])}"] if bad_parts else [])))

        if skipped:
            roots = sorted({".".join(k.split(".")[:2]) for k in skipped})
            logger.info("skipped %d checkpoint tensors the text model does not serve (%s)", len(skipped), ", ".join(roots))
        if saw_per_expert and saw_fused:
            raise CheckpointMismatchError("checkpoint mixes fused and per-expert MoE weights")
        self._check(out, unexpected)
        self.layout = layout
        self.expert_layout = "per_expert" if saw_per_expert else "fused"
        return out

    def _check(self, sd: dict[str, torch.Tensor], unexpected_hf: list[str]) -> None:
        missing = sorted(set(self.expected) - set(sd))
        unexpected = sorted(unexpected_hf + [k for k in sd if k not in self.expected])
        bad_shapes = [
            f"{k}: checkpoint {tuple(t.shape)} vs model {tuple(self.expected[k])}"
            for k, t in sd.items()
            if k in self.expected and t.shape != self.expected[k]
        ]
        problems = []
        if missing:
            problems.append(f"missing keys: {_fmt([self._hf_name(k) for k in missing])}")
        if unexpected:
            problems.append(f"unexpected keys: {_fmt(unexpected)}")
        if bad_shapes:
            problems.append(f"shape mismatches: {'; '.join(bad_shapes[:20])}")
        if problems:
            raise CheckpointMismatchError("checkpoint does not match the model config -- " + " | ".join(problems))

    def _part_names(self, titan_key: str, prefix: str) -> list[str]:
        """HF keys of a merged parameter's parts, in column order."""
        m = _LAYER_KEY.fullmatch(titan_key)
        assert m is not None
        module, param = m.group(2).rsplit(".", 1)
        return [f"{prefix}layers.{m.group(1)}.{hf}.{param}" for hf in _MERGED[module]]

    def hf_modules(self, titan_module: str) -> list[str]:
        """HF module names of a titan linear (``layers.0.attention.wqkv``), one per part in column order, in the
        layout ``from_hf`` last saw."""
        key = f"{titan_module}.weight"
        if key in self.merged_parts:
            names = self._part_names(key, self.text_prefixes[self.layout])
        else:
            names = list(self.to_hf({key: torch.empty(0)}, _partial=True))
        return [n.removesuffix(".weight") for n in names]

    def _hf_name(self, titan_key: str) -> str:
        """Best-effort HF name of a titan key, for error messages."""
        try:
            names = list(self.to_hf({titan_key: torch.empty(0)}, _partial=True))
        except Exception:
            return titan_key
        return names[0] if len(names) == 1 else titan_key

    # -- titan -> HF ------------------------------------------------------------------------------
    def to_hf(self, sd: dict[str, torch.Tensor], _partial: bool = False) -> dict[str, torch.Tensor]:
        prefix = self.text_prefixes[self.layout]
        out: dict[str, torch.Tensor] = {}
        pending_gate_up: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
        for key, t in sd.items():
            if key == "tok_embeddings.weight":
                out[prefix + "embed_tokens.weight"] = t
            elif key == "norm.weight":
                out[prefix + "norm.weight"] = t
            elif key == "output.weight":
                out["lm_head.weight"] = t
            elif (m := _LAYER_KEY.fullmatch(key)) is not None:
                i, suffix = int(m.group(1)), m.group(2)
                base = f"{prefix}layers.{i}."
                if suffix in ("moe.experts.w1", "moe.experts.w2", "moe.experts.w3") and self.expert_layout == "per_expert":
                    name = {"moe.experts.w1": "gate_proj", "moe.experts.w3": "up_proj", "moe.experts.w2": "down_proj"}[suffix]
                    for e in range(t.shape[0]):
                        out[f"{base}mlp.experts.{e}.{name}.weight"] = t[e]
                elif suffix in ("moe.experts.w1", "moe.experts.w3"):
                    if _partial:
                        out[base + _FUSED_GATE_UP] = t
                        continue
                    pending_gate_up[i][suffix] = t
                    if len(pending_gate_up[i]) == 2:
                        parts = pending_gate_up.pop(i)
                        out[base + _FUSED_GATE_UP] = torch.cat([parts["moe.experts.w1"], parts["moe.experts.w3"]], dim=1)
                elif key in self.merged_parts:
                    names = self._part_names(key, prefix)
                    if _partial:
                        out.update({n: t for n in names})
                        continue
                    sizes = self.merged_parts[key]
                    if t.shape[0] != sum(sizes):
                        raise ValueError(f"{key}: {t.shape[0]} rows, expected {sum(sizes)} ({sizes})")
                    out.update(zip(names, torch.split(t, sizes, dim=0)))
                elif suffix in _LAYER_RENAMES_INV:
                    out[base + _LAYER_RENAMES_INV[suffix]] = t
                else:
                    raise KeyError(f"no HF name for titan parameter {key!r}")
            else:
                raise KeyError(f"no HF name for titan parameter {key!r}")
        if pending_gate_up:
            raise KeyError(f"fused gate_up export needs both w1 and w3; incomplete for layers {sorted(pending_gate_up)}")
        return out
