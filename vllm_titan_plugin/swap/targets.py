"""Where a push's tensors go inside a worker: the served model as a set of titan-named tensors.

A push always carries the titan state dict (titan names, the served dtypes). Two kinds of served model take it:

- ``--model-impl titan``: the model's own parameters under their titan names (``titan_parameters``); each
  tensor is copied into its parameter in place.
- vLLM's native class for the same checkpoint (the baseline arm of an RL comparison): no titan parameters to
  copy into, so the names and shapes a push must have come from the titan model that the served checkpoint's
  config describes (built on the meta device, in the served dtype), and the tensors go through the titan
  state-dict adapter to the checkpoint's names and into vLLM's own in-place reload (``model_runner.
  reload_weights``: the class's ``load_weights`` layer by layer, then each layer's post-load processing --
  fusing, repacking for the CPU kernels -- copied back into the existing storage, so captured graphs stay
  valid). Its live weights are vLLM's processed tensors, so there is no per-tensor checksum of them under
  titan names (``checksums`` refuses).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from vllm_titan_plugin import compat
from vllm_titan_plugin.swap.validate import ST_DTYPE

_CACHE = "_titan_swap_target"


def _spec_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, list[Any]]:
    return {name: [ST_DTYPE[t.dtype], list(t.shape)] for name, t in tensors.items()}


class TitanTarget:
    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {name: p for name, (_, p) in model.titan_parameters().items()}
        self.device = next(iter(self.params.values())).device

    def spec(self) -> dict[str, list[Any]]:
        return _spec_of(self.params)

    def copy_in(self, get: Any, names: Iterable[str] | None = None) -> None:
        """``get(name)`` -> the pushed tensor; copied into the parameter in place. ``names``: the pushed subset (an
        adapter-only push, already checked to be exactly the adapter set); None: every parameter."""
        for name in self.params if names is None else names:
            self.params[name].copy_(get(name))

    def checksums(self) -> dict[str, str]:
        from titan_rl_ext.wire.weights import tensor_checksum

        return {name: tensor_checksum(p) for name, p in self.params.items()}


class NativeTarget:
    def __init__(self, model_runner: Any, hf_config: dict[str, Any], dtype: torch.dtype) -> None:
        from titan_rl_ext.models.hf import adapter_for, config_from_hf

        cfg = config_from_hf(hf_config)
        self.adapter = adapter_for(hf_config, cfg)
        with torch.device("meta"):
            titan = cfg.build().to(dtype)  # GDN's A_log stays fp32, as in a titan-served model and the trainer
        self._spec = _spec_of(dict(titan.named_parameters()))
        self.runner = model_runner
        self.model = model_runner.get_model()
        self.device = next(self.model.parameters()).device

    def spec(self) -> dict[str, list[Any]]:
        return self._spec

    def copy_in(self, get: Any, names: Iterable[str] | None = None) -> None:
        # the native class has no adapters, so ``push_spec`` never lets a partial set reach it
        assert names is None or set(names) == set(self._spec), "a native target takes whole pushes only"
        hf = self.adapter.to_hf({name: get(name) for name in self._spec})
        self.runner.reload_weights(weights_iterator=iter(hf.items()), is_checkpoint_format=True)

    def checksums(self) -> dict[str, str]:
        raise RuntimeError(f"per-tensor checksums of the live weights need --model-impl titan (this server runs "
                           f"vLLM's native {type(self.model).__name__}, whose weights are fused)")


def target_of(worker: Any) -> TitanTarget | NativeTarget:
    """The worker's push target (built once: the served model does not change shape)."""
    target = getattr(worker, _CACHE, None)
    if target is None:
        model = compat.worker_model(worker)
        if hasattr(model, "titan_parameters"):
            target = TitanTarget(model)
        else:
            mc = worker.vllm_config.model_config
            target = NativeTarget(worker.model_runner, mc.hf_config.to_dict(), mc.dtype)
        setattr(worker, _CACHE, target)
    return target
