"""The CUDA graph mode a ``--model-impl titan`` engine runs in (``vllm_titan_plugin.graphs``).

The capture itself needs a GPU (``tests/gpu/vllm_graphs.py``: bits under every capture size equal eager);
here: which modes ``graphs.configure`` picks for which model and which user request, through vLLM's own
config construction on CPU too.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")


class _HF:
    def __init__(self, d: dict[str, Any], **extra: Any) -> None:
        self._d = d
        for k, v in extra.items():
            setattr(self, k, v)

    def to_dict(self) -> dict[str, Any]:
        return dict(self._d)


def _config(model_dir: Path, *, impl: str = "titan", eager: bool = False, mode: Any = None, cg: Any = None,
            **hf_extra: Any) -> SimpleNamespace:
    hf = _HF(json.loads((model_dir / "config.json").read_text()), **hf_extra)
    mc = SimpleNamespace(model_impl=impl, enforce_eager=eager, hf_config=hf)
    return SimpleNamespace(model_config=mc, compilation_config=SimpleNamespace(mode=mode, cudagraph_mode=cg))


def test_configure_picks_full_decode_graphs_without_compile(tiny_ckpt) -> None:
    from vllm.config import CompilationMode, CUDAGraphMode

    from vllm_titan_plugin.graphs import configure

    dense = tiny_ckpt("qwen3_5", layout="text")
    M = CUDAGraphMode
    # unset -> the titan default; explicit modes -> their full-decode part; NONE and FULL_DECODE_ONLY kept
    for asked, want in [(None, M.FULL_DECODE_ONLY), (M.FULL_AND_PIECEWISE, M.FULL_DECODE_ONLY),
                        (M.FULL, M.FULL_DECODE_ONLY), (M.PIECEWISE, M.NONE), (M.NONE, M.NONE),
                        (M.FULL_DECODE_ONLY, M.FULL_DECODE_ONLY)]:
        vc = _config(dense, cg=asked)
        configure(vc)
        assert vc.compilation_config.cudagraph_mode == want, asked
        assert vc.compilation_config.mode == CompilationMode.NONE
        assert vc.model_config.enforce_eager is False

    vc = _config(dense, mode=CompilationMode.VLLM_COMPILE)  # a user's explicit compile mode is kept
    configure(vc)
    assert vc.compilation_config.mode == CompilationMode.VLLM_COMPILE

    for untouched in (_config(dense, impl="auto"), _config(dense, eager=True)):  # not titan / --enforce-eager
        configure(untouched)
        assert untouched.compilation_config.mode is None and untouched.compilation_config.cudagraph_mode is None

    # models whose forward reads the host run eager, with the reason logged
    for eager in (_config(tiny_ckpt("qwen3_5_moe", layout="text")),
                  _config(dense, titan_model_spec="torchtitan.models.qwen3")):
        configure(eager)
        assert eager.model_config.enforce_eager is True
        assert eager.compilation_config.cudagraph_mode is None


def test_engine_config_of_titan_models(tiny_ckpt) -> None:
    """Through vLLM's own ``EngineArgs`` (the hook runs inside ``VllmConfig.__post_init__``)."""
    from vllm.config import CompilationMode
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    load_general_plugins()

    def build(model_dir: Path, **kw: Any) -> Any:
        return EngineArgs(model=str(model_dir), dtype="float32", max_model_len=256, **kw).create_engine_config()

    vc = build(tiny_ckpt("qwen3_5", layout="text"), model_impl="titan")
    assert not vc.model_config.enforce_eager
    assert vc.compilation_config.mode == CompilationMode.NONE  # no torch.compile of the titan classes
    vc = build(tiny_ckpt("qwen3_5_moe", layout="text"), model_impl="titan")
    assert vc.model_config.enforce_eager
    vc = build(tiny_ckpt("qwen3_5", layout="text"), model_impl="auto")  # native: vLLM's own choice
    assert vc.compilation_config.mode != CompilationMode.NONE
