"""CUDA graphs for the titan classes: which mode they run in, and re-capture when the BI switch flips.

The titan model runs vLLM's full decode graphs without torch.compile (``CompilationMode.NONE`` +
``CUDAGraphMode.FULL_DECODE_ONLY``, which vLLM allows without compilation): a decode-only step replays
one captured graph of the whole forward, padded to a capture size; prefills and mixed steps run eager.
What makes the forward capturable lives in the layers: no host reads on the decode path, padded rows
routed to vLLM's null block and null state slot (``gdn_layer``, ``attention``).

Piecewise graphs would need the model traced by torch.compile (``support_torch_compile``) with the
attention and GDN cores as splitting ops; a request for a mode with a piecewise part is mapped to its
full-decode part here, with a log line, rather than silently dropping to eager as vLLM would.

Every titan class takes the graphs: the dense and hybrid models, the MoE models (their routed experts are
sorted on the device and run as one grouped GEMM per weight, ``kernels.grouped_gemm``) and torchtitan's own
classes (``titan_model_spec``). That no decode step reads the host is checked on CPU, BI on and off
(``tests/test_graphs.py``, ``tests/test_upstream_torchtitan.py``); ``--enforce-eager`` still runs
everything eager.

Graphs bake in the code path they captured, and the batch-invariant switch (``POST
/titan/v1/batch_invariant``) changes the path: after a flip every worker drops its graphs and captures them
again under the new setting (``recapture``); if that fails, the worker serves eager from then on.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("vllm.titan_plugin")


def configure(vllm_config: Any) -> None:
    """Pick the compilation and CUDA graph modes of a ``--model-impl titan`` engine. Runs before vLLM
    resolves its own defaults, so an unset field still reads None and a user's explicit choice is kept
    where the titan classes can honour it."""
    from vllm.config import CompilationMode, CUDAGraphMode

    mc, cc = vllm_config.model_config, vllm_config.compilation_config
    if mc is None or getattr(mc, "model_impl", None) != "titan" or mc.enforce_eager:
        return
    if cc.mode is None:
        cc.mode = CompilationMode.NONE  # the titan classes are not traced by torch.compile
    asked = cc.cudagraph_mode
    if asked is None:
        cc.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    elif asked not in (CUDAGraphMode.NONE, CUDAGraphMode.FULL_DECODE_ONLY):
        # FULL (mixed batches too) would capture prefills, whose GDN kernels read sequence bounds on the
        # host; piecewise modes need torch.compile. Their decode part is what the titan classes capture.
        now = CUDAGraphMode.FULL_DECODE_ONLY if asked.decode_mode() == CUDAGraphMode.FULL else CUDAGraphMode.NONE
        logger.warning("--model-impl titan: cudagraph_mode %s is not supported, using %s", asked.name, now.name)
        cc.cudagraph_mode = now
    logger.info("--model-impl titan: compilation mode %s, cudagraph_mode %s",
                getattr(cc.mode, "name", cc.mode), cc.cudagraph_mode.name)


# Two model runners keep their graphs in two places. The V1 runner: ``CUDAGraphWrapper`` s, dispatched by
# ``runner.cudagraph_dispatcher``. vLLM 0.26's V2 runner (its default for dense, non-hybrid text models):
# ``runner.cudagraph_manager.graphs`` with a ``_graphs_captured`` flag, no dispatcher.


def has_graphs(worker: Any) -> bool:
    runner = getattr(worker, "model_runner", None)
    manager = getattr(runner, "cudagraph_manager", None)
    if manager is not None:
        return bool(getattr(manager, "graphs", None))
    dispatcher = getattr(runner, "cudagraph_dispatcher", None)
    mode = getattr(dispatcher, "cudagraph_mode", None)
    return mode is not None and getattr(mode, "name", "NONE") != "NONE"


def _clear(runner: Any) -> None:
    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    CUDAGraphWrapper.clear_all_graphs()
    try:  # VLLM_USE_BREAKABLE_CUDAGRAPH=1 captures through this wrapper instead
        from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphWrapper
    except ImportError:
        pass
    else:
        BreakableCUDAGraphWrapper.clear_all_graphs()
    if (manager := getattr(runner, "cudagraph_manager", None)) is not None:
        manager.graphs.clear()
        manager._graphs_captured = False  # its dispatch() then answers NONE: steps run eager


def recapture(worker: Any) -> str:
    """Drop every captured graph of this worker and capture them again (after the BI switch flipped).
    Returns what happened: ``"none"`` (no graphs), ``"recaptured"`` or ``"eager"`` (capture failed: the
    runner is set to run every step eager, so the engine keeps serving, slower)."""
    if not has_graphs(worker):
        return "none"
    runner = worker.model_runner
    _clear(runner)
    try:
        runner.capture_model()
        return "recaptured"
    except Exception:
        logger.exception("titan: CUDA graph re-capture failed; this worker serves eager from now on")
        _clear(runner)
        if (dispatcher := getattr(runner, "cudagraph_dispatcher", None)) is not None:
            from vllm.config import CUDAGraphMode

            dispatcher.cudagraph_mode = CUDAGraphMode.NONE  # dispatch() then answers NONE
        return "eager"
