"""Entry point of the ``vllm.general_plugins`` group; runs once in every vLLM process.

``--model-impl titan`` is not a value vLLM knows: it accepts any string and, left alone, silently
serves its native class. So the plugin intercepts class resolution (``inspect_model_cls`` /
``resolve_model_cls`` of vLLM's model registry): with ``model_impl == "titan"`` the supported
architectures resolve to the titan model classes and every other architecture fails with an error
naming the supported ones. The original architecture name is what vLLM keeps seeing, so its
per-architecture config hooks (e.g. Qwen3.5's ``mamba_ssm_dtype`` -> ``mamba_ssm_cache_dtype``) still
apply. Any other ``model_impl`` goes straight to vLLM's own resolution, unchanged. The compilation and
CUDA graph modes of a titan engine are set in ``graphs.configure``, hooked into vLLM's config checks.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

logger = logging.getLogger("vllm.titan_plugin")

TITAN_MODEL_IMPL = "titan"
_MARK = "__titan_routing__"


def supported_architectures() -> tuple[str, ...]:
    from titan_rl_ext.models.architectures import ARCHITECTURES

    return tuple(ARCHITECTURES)


def titan_model_class(architectures: str | list[str], model_config: Any = None) -> tuple[type, str]:
    """(titan vLLM model class, the checkpoint's architecture name); raises for anything unsupported.
    A checkpoint whose HF config names a ``titan_model_spec`` (``--hf-overrides``) is served with that
    torchtitan definition (``upstream_model``); the spec is checked here, at start-up."""
    from titan_rl_ext.models.architectures import ARCHITECTURES

    archs = [architectures] if isinstance(architectures, str) else list(architectures)
    from vllm_titan_plugin.upstream_model import spec_of

    if model_config is not None and (spec := spec_of(model_config)) is not None:
        from titan_rl_ext.models.upstream.build import check_architecture, spec_name
        from vllm_titan_plugin.upstream_model import TorchtitanForCausalLM

        from titan_rl_ext.models.common.lora import HF_CONFIG_KEY

        if getattr(model_config.hf_config, HF_CONFIG_KEY, None) is not None:
            raise ValueError(f"{HF_CONFIG_KEY} (LoRA adapters) needs the titan model definition; titan_model_spec="
                             f"{spec!r} serves torchtitan's, which has no adapters: drop one of the two overrides")
        if len(archs) != 1:
            raise ValueError(f"titan_model_spec={spec!r} needs a checkpoint with one architecture, got {archs}")
        check_architecture(spec_name(spec), archs[0])
        return TorchtitanForCausalLM, archs[0]
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ValueError(
            f"--model-impl {TITAN_MODEL_IMPL} does not support architecture(s) {archs or '(none given)'}; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    arch = ARCHITECTURES[archs[0]]
    from vllm_titan_plugin.model import TitanForCausalLM, TitanHybridForCausalLM

    # a family with recurrent layers needs vLLM to allocate their state: only the hybrid class declares it
    return (TitanHybridForCausalLM if arch.family.recurrent_state else TitanForCausalLM), arch.name


def _wants_titan(model_config: Any) -> bool:
    return getattr(model_config, "model_impl", None) == TITAN_MODEL_IMPL


def _route_inspect(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def inspect_model_cls(self: Any, architectures: str | list[str], model_config: Any) -> Any:
        if not _wants_titan(model_config):
            return orig(self, architectures, model_config)
        from vllm_titan_plugin import compat

        cls, arch = titan_model_class(architectures, model_config)
        return compat.model_info(cls), arch

    setattr(inspect_model_cls, _MARK, True)
    return inspect_model_cls


def _route_resolve(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def resolve_model_cls(self: Any, architectures: str | list[str], model_config: Any) -> Any:
        if not _wants_titan(model_config):
            return orig(self, architectures, model_config)
        return titan_model_class(architectures, model_config)

    setattr(resolve_model_cls, _MARK, True)
    return resolve_model_cls


def register() -> None:
    """Idempotent: patches vLLM's registry class once per process."""
    from vllm_titan_plugin import swap
    from vllm_titan_plugin.compat import ModelRegistryClass as R

    # Weight push routes (API server) and worker methods; off unless TITAN_SWAP_TOKEN is set. Idempotent.
    swap.install()

    from vllm_titan_plugin import graphs
    from vllm_titan_plugin.compat import wrap_config_update

    wrap_config_update(graphs.configure, _MARK)  # CUDA graph mode of titan engines; idempotent
    if getattr(R.resolve_model_cls, _MARK, False):
        return
    R.inspect_model_cls = _route_inspect(R.inspect_model_cls)  # type: ignore[method-assign]
    R.resolve_model_cls = _route_resolve(R.resolve_model_cls)  # type: ignore[method-assign]
    logger.debug("titan plugin: --model-impl %s routes %s", TITAN_MODEL_IMPL, ", ".join(supported_architectures()))
