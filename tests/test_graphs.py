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
from requires import require

require("vllm")


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

    # MoE and torchtitan's own classes take the graphs too (their decode steps read nothing from the host:
    # test_decode_step_reads_nothing_from_the_host, test_upstream_torchtitan.py)
    for other in (_config(tiny_ckpt("qwen3_5_moe", layout="text")), _config(dense, titan_model_spec="torchtitan.models.qwen3")):
        configure(other)
        assert other.model_config.enforce_eager is False
        assert other.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY


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
    assert not vc.model_config.enforce_eager and vc.compilation_config.mode == CompilationMode.NONE
    vc = build(tiny_ckpt("qwen3_5", layout="text"), model_impl="auto")  # native: vLLM's own choice
    assert vc.compilation_config.mode != CompilationMode.NONE


# -- the decode step reads nothing from the host --------------------------------------------------------
# A CUDA graph cannot hold a host read: on the GPU a capture that meets one fails (tests/gpu/vllm_graphs.py
# captures every size). On CPU the same property is checked by watching the decode forward for the ops that
# would read the device on a GPU: ``item``/``int(t)`` (aten._local_scalar_dense; under inference mode, as the
# engine runs, ``.item()`` reaches the dispatcher as aten.item instead), data-dependent shapes (nonzero,
# masked_select, unique) and ``tolist``. Kernel backends (``titan_rl_ext/kernels``) are exempt: on
# CPU their torch references loop over sequences on purpose, on CUDA FLA's and the project's Triton kernels
# run instead and the GPU capture covers them. Everything else on the path -- the titan layers, the
# decoder, the plugin's glue -- must not read the host.
_SYNC_OPS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive"}
_ROOT = Path(__file__).resolve().parents[1]
_EXEMPT = _ROOT / "titan_rl_ext" / "kernels"
HOST_READS: list[str] = []
DECODE_STEPS_WATCHED = [0]
NOT_WATCHED = [0]  # > 0 while a CPU-only fallback runs whose CUDA path is a kernel (see its callers)


def _where() -> str | None:
    """The innermost project frame of the current stack ('file:line'), None if it is an exempt kernel."""
    import traceback

    if NOT_WATCHED[0]:
        return None

    for fr in reversed(traceback.extract_stack()):
        path = Path(fr.filename).resolve()
        # a virtual environment inside the checkout holds the libraries, not the project: their frames are not it
        if _ROOT in path.parents and not {"tests", "site-packages"} & set(path.relative_to(_ROOT).parts):
            return None if _EXEMPT in path.parents else f"{path.relative_to(_ROOT)}:{fr.lineno}"
    return None


def _watch_decode_steps(model: Any) -> None:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from vllm.forward_context import get_forward_context

    class HostReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func.overloadpacket.__name__ in _SYNC_OPS and (where := _where()) is not None:
                HOST_READS.append(f"{func.overloadpacket.__name__} at {where}")
            return func(*args, **(kwargs or {}))

    orig_forward, orig_tolist = model.forward, torch.Tensor.tolist

    def tolist(t: torch.Tensor) -> Any:
        if (where := _where()) is not None:
            HOST_READS.append(f"tolist at {where}")
        return orig_tolist(t)

    def forward(*args: Any, **kwargs: Any) -> Any:
        md = get_forward_context().attn_metadata
        layers = list(md.values()) if isinstance(md, dict) else []
        gdn = [m for m in layers if hasattr(m, "num_prefills")]
        # decode-only: no GDN prefill (hybrid models), every attention layer one query token per sequence
        decode = bool(layers) and not any(m.num_prefills for m in gdn) and all(
            getattr(m, "max_query_len", 1) == 1 for m in layers if not hasattr(m, "num_prefills"))
        if not decode:
            return orig_forward(*args, **kwargs)  # prefills and mixed steps run eager: not captured
        DECODE_STEPS_WATCHED[0] += 1
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        try:
            with HostReads():
                return orig_forward(*args, **kwargs)
        finally:
            torch.Tensor.tolist = orig_tolist  # type: ignore[method-assign]

    model.forward = forward


def unwatched_attention_cpu_fallback(mp: pytest.MonkeyPatch) -> None:
    """Under BI the paged attention's CPU fallback loops over sequences on the host; on CUDA it is one Triton
    launch (``_paged_bi_kernel``, captured in the GPU bucket-invariance run): that fallback alone is not
    watched."""
    from vllm_titan_plugin.attention import VllmAttentionKernel

    cpu_fallback = VllmAttentionKernel._forward_batch_invariant

    def unwatched(self: Any, *args: Any) -> Any:
        NOT_WATCHED[0] += 1
        try:
            return cpu_fallback(self, *args)
        finally:
            NOT_WATCHED[0] -= 1

    mp.setattr(VllmAttentionKernel, "_forward_batch_invariant", unwatched)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_decode_step_reads_nothing_from_the_host(tiny_ckpt, arch: str) -> None:
    """Dense hybrid and MoE (the routed experts: sorted on the device, one grouped GEMM per weight; on CPU the
    grouped GEMM's reference loops over experts in ``titan_rl_ext/kernels``, on CUDA one Triton launch)."""
    from test_vllm_plugin import ENGINE_ENV, _generate, _prompts, titan_engine

    from titan_rl_ext.kernels import batch_invariant as bi

    with pytest.MonkeyPatch.context() as mp:
        for k, v in ENGINE_ENV.items():
            mp.setenv(k, v)
        unwatched_attention_cpu_fallback(mp)
        with titan_engine(tiny_ckpt(arch, layout="text"), enable_prefix_caching=False, max_num_seqs=8) as llm:
            llm.apply_model(_watch_decode_steps)
            for on in (False, True):
                with bi.batch_invariant(on):
                    HOST_READS.clear()
                    DECODE_STEPS_WATCHED[0] = 0
                    _generate(llm, _prompts([5, 17, 40, 3], seed=7), 6)
                assert DECODE_STEPS_WATCHED[0] >= 4, DECODE_STEPS_WATCHED  # the check saw decode-only steps
                assert HOST_READS == [], (on, sorted(set(HOST_READS)))
            # the control: one ``.item()`` planted where the decoder calls its first layer must be caught there
            hooks = llm.apply_model(_plant_host_read)
            try:
                HOST_READS.clear()
                _generate(llm, _prompts([5, 17], seed=8), 3)
            finally:
                for handle in hooks:
                    handle.remove()
            caught = {r for r in HOST_READS if r.split(" at ")[0] in ("item", "_local_scalar_dense")}
            assert caught, HOST_READS
            assert all(_ROOT.joinpath(r.split(" at ")[1].split(":")[0]).is_file() for r in caught), caught


def _plant_host_read(model: Any) -> Any:
    """A forward pre-hook reading a scalar of the first decoder layer's input to the host: the hook's own frame is
    in ``tests/``, so the watch must name the project frame that called the layer."""
    import torch

    layers = next(m.layers for m in model.modules() if isinstance(getattr(m, "layers", None), torch.nn.ModuleList))
    return layers[0].register_forward_pre_hook(lambda module, args: args[0].sum().item() and None)


class _Manager:
    """vLLM 0.26's V2-runner graph manager, as far as ``graphs.recapture`` touches it."""

    def __init__(self) -> None:
        self.graphs: dict[str, object] = {"decode-8": object()}
        self._graphs_captured = True


class _V2Runner:
    def __init__(self, fail: bool = False) -> None:
        self.cudagraph_manager, self.fail, self.captures = _Manager(), fail, 0

    def capture_model(self) -> int:
        assert not self.cudagraph_manager.graphs, "capture into a manager that still holds graphs"
        self.captures += 1
        if self.fail:
            raise RuntimeError("capture failed")
        self.cudagraph_manager.graphs["decode-8"] = object()
        self.cudagraph_manager._graphs_captured = True
        return 1


def test_recapture_on_the_v2_runner() -> None:
    """The BI switch's recapture on vLLM 0.26's V2 runner (no dispatcher; graphs in ``cudagraph_manager``):
    it must drop the old graphs and capture again, or fall back to eager with none left to replay."""
    from vllm_titan_plugin import graphs

    ok = SimpleNamespace(model_runner=_V2Runner())
    old = ok.model_runner.cudagraph_manager.graphs["decode-8"]
    assert graphs.has_graphs(ok) and graphs.recapture(ok) == "recaptured"
    mgr = ok.model_runner.cudagraph_manager
    assert ok.model_runner.captures == 1 and mgr._graphs_captured and mgr.graphs["decode-8"] is not old

    bad = SimpleNamespace(model_runner=_V2Runner(fail=True))
    assert graphs.recapture(bad) == "eager"
    mgr = bad.model_runner.cudagraph_manager
    assert not mgr.graphs and not mgr._graphs_captured  # dispatch() answers NONE: every step eager
    assert not graphs.has_graphs(bad) and graphs.recapture(bad) == "none"


def test_gdn_step_bounds_made_once_per_forward() -> None:
    """Every GDN layer of a step reads one metadata object: the first layer's bounds are reused by the rest of
    that forward (fewer launches per decode step), and a later forward on the same object -- its tensors
    refilled in place -- gets bounds made afresh."""
    import torch

    from titan_rl_ext.models.common.batch import SeqBatch
    from vllm_titan_plugin.gdn_layer import _step_bounds

    def step(T: int) -> SeqBatch:
        return SeqBatch(cu_seqlens=torch.tensor([0, T], dtype=torch.int32), positions=torch.arange(T), max_seqlen=T)

    # decode-only: 3 requests, one token each, slots by the metadata, every request continues
    md = SimpleNamespace(num_prefills=0, non_spec_state_indices_tensor=torch.tensor([4, 9, 2], dtype=torch.int32),
                         non_spec_query_start_loc=None, has_initial_state=None)
    b1 = step(3)
    first = _step_bounds(md, b1, 3, torch.device("cpu"))
    assert _step_bounds(md, b1, 3, torch.device("cpu")) is first
    assert torch.equal(first.seq.cu_seqlens, torch.arange(4, dtype=torch.int32))
    assert first.slots.dtype == torch.int64 and first.slots.tolist() == [4, 9, 2] and first.keep is None

    # the same object in the next forward, refilled in place: a mixed step of 2 sequences (5 + 2 tokens)
    md.num_prefills = 1
    md.non_spec_state_indices_tensor[:2] = torch.tensor([7, 1], dtype=torch.int32)
    md.non_spec_query_start_loc = torch.tensor([0, 5, 7], dtype=torch.int32)
    md.has_initial_state = torch.tensor([True, False])
    second = _step_bounds(md, step(7), 7, torch.device("cpu"))
    assert second is not first
    assert second.seq.cu_seqlens.tolist() == [0, 5, 7] and second.slots.tolist() == [7, 1]
    assert second.keep.tolist() == [True, False] and second.seq.positions.shape[0] == 7


def test_gdn_step_bounds_carry_the_prefill_layout() -> None:
    """A step with prefills: the bounds carry how many one-token decodes lead it and vLLM's FLA chunk indices for
    its prefills (host values of the metadata, for the rule kernel to peel the decodes as vLLM's layer does);
    decode-only steps, decodes of several tokens and another backend's chunk layout carry none."""
    import torch

    from titan_rl_ext.models.common.batch import SeqBatch
    from vllm_titan_plugin.gdn_layer import _step_bounds

    chunks = torch.tensor([[0, 0], [0, 1], [1, 0]], dtype=torch.int32)

    def bounds(**md_fields: object):  # type: ignore[no-untyped-def]
        md = SimpleNamespace(non_spec_state_indices_tensor=torch.tensor([3, 8, 5, 6], dtype=torch.int32),
                             non_spec_query_start_loc=torch.tensor([0, 1, 2, 70, 75], dtype=torch.int32),
                             has_initial_state=torch.tensor([True, True, False, True]), chunk_indices=chunks,
                             num_decodes=2, num_decode_tokens=2, num_prefills=2)
        for key, value in md_fields.items():
            setattr(md, key, value)
        batch = SeqBatch(cu_seqlens=torch.tensor([0, 75], dtype=torch.int32), positions=torch.arange(75),
                         max_seqlen=75)
        return _step_bounds(md, batch, 75, torch.device("cpu"))

    mixed = bounds()
    assert mixed.n_decodes == 2 and mixed.chunk_indices is chunks and mixed.seq.cu_seqlens.tolist() == [0, 1, 2, 70, 75]
    prefill_only = bounds(num_decodes=0, num_decode_tokens=0)
    assert prefill_only.n_decodes == 0 and prefill_only.chunk_indices is chunks
    assert bounds(num_decode_tokens=3).n_decodes == 0 and bounds(num_decode_tokens=3).chunk_indices is None
    other_layout = bounds(chunk_indices=torch.zeros(3, dtype=torch.int32))
    assert other_layout.n_decodes == 2 and other_layout.chunk_indices is None
    assert bounds(chunk_indices=None).chunk_indices is None
    decode_only = bounds(num_prefills=0, num_decodes=4, num_decode_tokens=4,
                         non_spec_query_start_loc=torch.arange(5, dtype=torch.int32))
    assert decode_only.n_decodes == 0 and decode_only.chunk_indices is None
