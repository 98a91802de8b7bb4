"""What ``--model-impl titan`` refuses, and why, before it serves a request.

Each check returns a message naming the setting and what to do, or None. The model class runs them at
start-up (an error there stops the engine before it accepts traffic); the batch-invariance switch runs
``batch_invariance_problem`` before it flips, and refuses with the same message.
"""

from __future__ import annotations

from typing import Any

from titan_rl_ext import settings


def kv_cache_dtype_problem(vllm_config: Any) -> str | None:
    """Batch-invariant attention reads keys/values back from vLLM's cache: a cache in another dtype than
    the activations (``--kv-cache-dtype fp8``) would round them differently from the trainer, silently."""
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    model_dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    if cache_dtype in ("auto", model_dtype):
        return None
    return (f"batch-invariant mode needs the KV cache in the model dtype ({model_dtype}); --kv-cache-dtype is "
            f"{cache_dtype!r}: serve with --kv-cache-dtype auto, or without TITAN_BATCH_INVARIANT")


def attention_group_problem(vllm_config: Any) -> str | None:
    """On CUDA, batch-invariant attention runs the project's Triton kernel, whose query tile holds whole GQA
    groups and whose tile table covers head sizes up to 256: refuse other shapes before the first request."""
    if str(getattr(getattr(vllm_config, "device_config", None), "device_type", "")) != "cuda":
        return None  # the CPU path (plain PyTorch) serves any grouping and head size
    hf = getattr(vllm_config.model_config, "hf_text_config", None)
    n_heads = getattr(hf, "num_attention_heads", None)
    if n_heads is None:
        return None
    n_kv = getattr(hf, "num_key_value_heads", None) or n_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // n_heads
    try:
        from titan_rl_ext.kernels.attention_triton import group_problem
    except ImportError:  # no triton: no CUDA kernel to refuse
        return None
    problem = group_problem(n_heads, n_kv, head_dim)
    return None if problem is None else f"--model-impl titan with batch invariance: {problem}"


def gdn_bi_form_problem(vllm_config: Any, batch_invariant: bool) -> str | None:
    """``TITAN_GDN_BI_FORM=grid``: batch invariance from start-up (the layers' state gains the open-chunk buffer
    then, sized once), GDN heads the chunk-grid kernels tile, an fp32 ssm cache (the grid's ``S`` rows are
    advanced in place in fp32), no speculative decoding (one token a sequence per decode step)."""
    from titan_rl_ext.kernels.gdn import bi_form, bi_form_problem, grid_shape_problem

    if bi_form() != "grid":
        return None
    if (problem := bi_form_problem(batch_invariant)) is not None:
        return f"--model-impl titan: {problem}"
    hf = getattr(vllm_config.model_config, "hf_text_config", None)
    heads = [getattr(hf, name, None) for name in ("linear_num_key_heads", "linear_num_value_heads",
                                                   "linear_key_head_dim", "linear_value_head_dim")]
    if all(isinstance(x, int) for x in heads) and (problem := grid_shape_problem(*heads)) is not None:
        return f"--model-impl titan: {problem}"
    ssm_dtype = str(getattr(vllm_config.cache_config, "mamba_ssm_cache_dtype", "auto"))
    if ssm_dtype not in ("auto", "float32"):
        return (f"--model-impl titan: {settings.GDN_BI_FORM.name}=grid keeps the GDN state in fp32; "
                f"--mamba-ssm-cache-dtype is {ssm_dtype!r}: serve with --mamba-ssm-cache-dtype auto")
    return None


def batch_invariance_problem(vllm_config: Any) -> str | None:
    return kv_cache_dtype_problem(vllm_config) or attention_group_problem(vllm_config)


def _settings_problem(*chosen: settings.Setting) -> str | None:
    found = [p for p in (s.problem() for s in chosen) if p is not None]
    return f"--model-impl titan: {'; '.join(found)}" if found else None


def gdn_recurrent_kernel_problem() -> str | None:
    """``TITAN_GDN_RECURRENT`` names the kernel of every recurrent GDN forward, ``TITAN_GDN_MIXED_STEPS`` how
    mixed steps run it; a typo would otherwise raise inside the first GDN forward of the first request."""
    return _settings_problem(settings.GDN_RECURRENT, settings.GDN_MIXED_STEPS)


def prefill_attention_problem() -> str | None:
    """``TITAN_PREFILL_ATTENTION`` picks the attention kernel of non-BI prefill steps (``vllm_titan_plugin.attention``);
    an unknown value would otherwise raise inside the first prefill."""
    return _settings_problem(settings.PREFILL_ATTENTION)


def settings_problem() -> str | None:
    """Every setting the plugin's processes read (``titan_rl_ext.settings``, side ``plugin`` or ``both``), so that
    a typo stops start-up instead of surfacing in a request or being read as something else."""
    return _settings_problem(*(s for s in settings.SETTINGS.values() if s.side in ("plugin", "both")))


def attention_head_size_problem(backend: Any, head_size: int) -> str | None:
    """vLLM's attention backends accept a fixed set of head sizes but only say so inside the first
    forward (which kills the engine then): ask the backend at start-up instead."""
    supports = getattr(backend, "supports_head_size", None)
    if supports is None or supports(head_size):
        return None
    sizes = backend.get_supported_head_sizes() if hasattr(backend, "get_supported_head_sizes") else "?"
    name = backend.get_name() if hasattr(backend, "get_name") else type(backend).__name__
    return (f"--model-impl titan: the attention head size {head_size} of this checkpoint is not supported by "
            f"vLLM's {name} attention backend here (supported: {sizes}); pick another --attention-backend")



def swap_topology_problem(args: Any) -> str | None:
    """Weight pushes reach one engine core and one API server: with data parallelism the swap utility lands
    on the first engine only (the others keep the old weights under the new version), and with several
    API-server processes only the one that took the push knows each request's versions. ``args``: vLLM's
    CLI namespace (absent settings count as 1)."""
    dp = int(getattr(args, "data_parallel_size", 1) or 1)
    api = int(getattr(args, "api_server_count", 1) or 1)
    if dp <= 1 and api <= 1:
        return None
    return (f"TITAN_SWAP_TOKEN (weight pushes) needs one engine and one API server: got --data-parallel-size {dp}, "
            f"--api-server-count {api}. Run one server per replica (the trainer's fleet pushes to each), "
            f"or unset TITAN_SWAP_TOKEN")
