"""The one table of what titan serves and trains: each supported HF architecture, the model family that
builds it and how its checkpoints lay out the text model's keys.

``models/hf.py`` (config and state-dict adapter of a checkpoint), the RL recipes (a torchtitan ``ModelSpec``
from a checkpoint) and the vLLM plugin (which serving class) all read it, so a new architecture of a
known family is one row of ``ARCHITECTURES`` and a new family one entry of ``FAMILIES``.

A family names its classes by ``module:attribute`` and loads them on first use: the plugin asks which
architectures exist in every vLLM process, and importing every family's model code (and the kernels
it pulls in) there would cost each process start for families it never serves.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from titan_rl_ext.models.common.decoder import DecoderConfig
    from titan_rl_ext.models.common.state_dict_adapter import HFStateDictAdapter, TextLayout


def _load(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True, slots=True)
class ModelFamily:
    name: str
    """The family's torchtitan model name (``ModelSpec.name``) and the prefix of its flavors."""
    config: str
    """``module:class`` of its ``DecoderConfig`` (``from_hf`` reads an HF config.json dict)."""
    adapter: str
    """``module:class`` of its ``HFStateDictAdapter``."""
    flavors: str
    """``module:function`` returning its named flavors, ``{name: DecoderConfig}``."""
    recurrent_state: bool
    """Some layers carry state from token to token (Gated DeltaNet): vLLM must allocate that state, so the
    plugin serves the family with its hybrid class."""

    def config_class(self) -> type[DecoderConfig]:
        return _load(self.config)

    def adapter_class(self) -> type[HFStateDictAdapter]:
        return _load(self.adapter)

    def flavor_configs(self) -> dict[str, DecoderConfig]:
        return _load(self.flavors)()


FAMILIES: dict[str, ModelFamily] = {
    f.name: f
    for f in (
        ModelFamily(
            name="qwen3",
            config="titan_rl_ext.models.qwen3.model:Qwen3Config",
            adapter="titan_rl_ext.models.qwen3.state_dict_adapter:Qwen3StateDictAdapter",
            flavors="titan_rl_ext.models.qwen3.flavors:qwen3_flavors",
            recurrent_state=False,
        ),
        ModelFamily(
            name="qwen3_5",
            config="titan_rl_ext.models.qwen3_5.model:Qwen3_5Config",
            adapter="titan_rl_ext.models.qwen3_5.state_dict_adapter:Qwen3_5StateDictAdapter",
            flavors="titan_rl_ext.models.qwen3_5.flavors:qwen3_5_flavors",
            recurrent_state=True,
        ),
    )
}


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str
    """The HF ``architectures`` entry of a checkpoint's config.json."""
    family: ModelFamily
    layout: TextLayout
    """Where the text model's keys live: ``text`` (``model.*``) or ``vlm`` (``model.language_model.*``)."""


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("Qwen3ForCausalLM", FAMILIES["qwen3"], "text"),
        Architecture("Qwen3MoeForCausalLM", FAMILIES["qwen3"], "text"),
        Architecture("Qwen3_5ForCausalLM", FAMILIES["qwen3_5"], "text"),
        Architecture("Qwen3_5ForConditionalGeneration", FAMILIES["qwen3_5"], "vlm"),
        Architecture("Qwen3_5MoeForCausalLM", FAMILIES["qwen3_5"], "text"),
        Architecture("Qwen3_5MoeForConditionalGeneration", FAMILIES["qwen3_5"], "vlm"),
    )
}


class UnsupportedArchitectureError(ValueError):
    pass


def architecture_named(names: str | list[str]) -> Architecture:
    """The table's row for a checkpoint's ``architectures`` list (exactly one, and supported)."""
    archs = [names] if isinstance(names, str) else list(names)
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {archs or '(none given)'}; titan supports: {', '.join(ARCHITECTURES)}"
        )
    return ARCHITECTURES[archs[0]]


def architecture_of(hf_config: dict[str, Any]) -> Architecture:
    """The table's row for an HF config.json dict."""
    return architecture_named(hf_config.get("architectures") or [])


def family_named(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; titan has: {', '.join(FAMILIES)}")
    return FAMILIES[name]
