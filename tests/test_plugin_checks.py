"""What ``--model-impl titan`` refuses at start-up, and the settings it pins, instead of failing or drifting
later: unsupported attention head sizes, a KV cache in another dtype under batch invariance, TF32, and a
paged-KV layout that cannot be told from its sizes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from titan_rl_ext.kernels.batch_invariant import batch_invariant, set_batch_invariant
from requires import require

vllm = require("vllm")

from vllm_titan_plugin import checks, compat  # noqa: E402


def _config(cache_dtype: str, dtype: torch.dtype = torch.float32) -> SimpleNamespace:
    return SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=cache_dtype), model_config=SimpleNamespace(dtype=dtype))


def test_kv_cache_dtype_problem_names_the_setting() -> None:
    assert checks.kv_cache_dtype_problem(_config("auto")) is None
    assert checks.kv_cache_dtype_problem(_config("bfloat16", torch.bfloat16)) is None
    msg = checks.batch_invariance_problem(_config("fp8"))
    assert msg is not None and "--kv-cache-dtype" in msg and "'fp8'" in msg and "float32" in msg


def test_attention_group_problem_on_cuda_only() -> None:
    pytest.importorskip("triton")

    def cfg(device: str, heads: int, kv: int, head_dim: int) -> SimpleNamespace:
        hf = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, hidden_size=heads * head_dim)
        return SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="auto"), device_config=SimpleNamespace(device_type=device),
                               model_config=SimpleNamespace(dtype=torch.bfloat16, hf_text_config=hf))

    assert checks.batch_invariance_problem(cfg("cuda", 16, 4, 256)) is None  # Qwen3.5-9B
    msg = checks.batch_invariance_problem(cfg("cuda", 128, 1, 128))
    assert msg is not None and "at most 64 query heads per key/value head" in msg
    assert "head sizes up to 256" in (checks.batch_invariance_problem(cfg("cuda", 8, 8, 512)) or "")
    assert checks.batch_invariance_problem(cfg("cpu", 128, 1, 512)) is None  # the CPU path takes any shape


def test_gdn_recurrent_kernel_problem_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TITAN_GDN_RECURRENT", raising=False)
    assert checks.gdn_recurrent_kernel_problem() is None
    monkeypatch.setenv("TITAN_GDN_RECURRENT", "titan")
    assert checks.gdn_recurrent_kernel_problem() is None
    monkeypatch.setenv("TITAN_GDN_RECURRENT", "triton")
    msg = checks.gdn_recurrent_kernel_problem()
    assert msg is not None and "TITAN_GDN_RECURRENT='triton'" in msg and "fla, titan" in msg
    monkeypatch.setenv("TITAN_GDN_RECURRENT", "titan")
    monkeypatch.setenv("TITAN_GDN_MIXED_STEPS", "peel")
    assert checks.gdn_recurrent_kernel_problem() is None
    monkeypatch.setenv("TITAN_GDN_MIXED_STEPS", "split")
    msg = checks.gdn_recurrent_kernel_problem()
    assert msg is not None and "TITAN_GDN_MIXED_STEPS='split'" in msg and "recurrent, peel" in msg


def test_prefill_attention_problem_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TITAN_PREFILL_ATTENTION", raising=False)
    assert checks.prefill_attention_problem() is None
    for ok in ("titan", "vllm"):
        monkeypatch.setenv("TITAN_PREFILL_ATTENTION", ok)
        assert checks.prefill_attention_problem() is None
    monkeypatch.setenv("TITAN_PREFILL_ATTENTION", "flash")
    msg = checks.prefill_attention_problem()
    assert msg is not None and "TITAN_PREFILL_ATTENTION='flash'" in msg and "titan, vllm" in msg


def test_attention_head_size_problem_asks_the_backend() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert checks.attention_head_size_problem(CPUAttentionBackend, 64) is None
    msg = checks.attention_head_size_problem(CPUAttentionBackend, 24)
    assert msg is not None and "head size 24" in msg and "CPU_ATTN" in msg and "32" in msg
    assert checks.attention_head_size_problem(None, 24) is None  # nothing to ask: vLLM decides


def test_batch_invariance_pins_tf32_off() -> None:
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        with batch_invariant(True):
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


class _Backend:
    def __init__(self, kv_first: bool) -> None:
        self.kv_first = kv_first

    def get_kv_cache_shape(self, num_blocks: int, block_size: int, n_kv: int, head: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, n_kv, head) if self.kv_first else (num_blocks, 2, block_size, n_kv, head)


def test_paged_kv_layout_comes_from_the_backend_not_the_sizes() -> None:
    """A 2-block cache is [2, 2, bs, K, D] in both 5-D layouts: only the backend can say which axis is K/V."""
    kv = torch.arange(2 * 2 * 4 * 3 * 8, dtype=torch.float32).view(2, 2, 4, 3, 8)
    k, v = compat.split_kv_cache(kv, 8, _Backend(kv_first=True))
    assert torch.equal(k, kv[0]) and torch.equal(v, kv[1])
    k, v = compat.split_kv_cache(kv, 8, _Backend(kv_first=False))
    assert torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])
    with pytest.raises(NotImplementedError, match="cannot tell K from V"):
        compat.split_kv_cache(kv, 8, None)
    wide = torch.zeros(5, 2, 4, 3, 8)  # unambiguous without a backend
    assert compat.split_kv_cache(wide, 8, None)[0].shape == (5, 4, 3, 8)
    logical = torch.randn(5, 3, 4, 16)  # vLLM 0.32's [NB, K, bs, 2*D] view
    k, v = compat.split_kv_cache(logical, 8, None)
    assert k.shape == (5, 4, 3, 8) and torch.equal(v, logical[..., 8:].transpose(1, 2))


def _start(model_dir: Path, **kwargs: object) -> None:
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    try:
        llm = LLM(model=str(model_dir), model_impl="titan", dtype="float32", max_model_len=256, seed=0, **kwargs)
        llm.llm_engine.engine_core.shutdown()  # only reached if the engine wrongly starts
    finally:
        cleanup_dist_env_and_memory()  # a failed start must not leave state for the next engine in this process


def test_engine_refuses_at_start_up(tiny_ckpt, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process engines: the refusal comes from model construction, before any request."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    with pytest.raises(Exception) as e:
        _start(tiny_ckpt("qwen3", layout="text", head_dim=24))
    assert "attention head size 24" in repr(e.value) or "attention head size 24" in str(e.value.__cause__), e.value
    set_batch_invariant(True)
    try:
        with pytest.raises(Exception) as e:
            _start(tiny_ckpt("qwen3", layout="text", head_dim=32), kv_cache_dtype="fp8")
    finally:
        set_batch_invariant(False)
    assert "--kv-cache-dtype" in repr(e.value) or "--kv-cache-dtype" in str(e.value.__cause__), e.value
    monkeypatch.setenv("TITAN_PREFILL_ATTENTION", "flash")
    with pytest.raises(Exception) as e:
        _start(tiny_ckpt("qwen3", layout="text", head_dim=32))
    assert "TITAN_PREFILL_ATTENTION" in repr(e.value) or "TITAN_PREFILL_ATTENTION" in str(e.value.__cause__), e.value


def test_pushes_refuse_data_parallel_and_several_api_servers_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """With TITAN_SWAP_TOKEN set, the API server's app build stops start-up on ``-dp 2`` or
    ``--api-server-count 2`` (a push would reach one engine of two) and builds normally with one of each."""
    from vllm_titan_plugin import swap

    monkeypatch.setenv("TITAN_SWAP_TOKEN", "t" * 32)
    monkeypatch.delenv("TITAN_SWAP_PORT", raising=False)
    for args in (SimpleNamespace(data_parallel_size=2, api_server_count=None),
                 SimpleNamespace(data_parallel_size=1, api_server_count=2)):
        with pytest.raises(RuntimeError, match="one engine and one API server"):
            swap._attach(object(), args)  # raises before touching the app
    assert checks.swap_topology_problem(SimpleNamespace(data_parallel_size=1, api_server_count=None)) is None
    assert checks.swap_topology_problem(None) is None  # no namespace: nothing says there are more


def test_prefill_steps_take_the_project_attention_kernel_where_vllm_runs_its_triton_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """BI off, a step with a prefill runs the project's attention kernel when vLLM's backend is TRITON_ATTN and the
    KV cache holds the activations' dtype; decode-only steps (what the decode graphs capture), other backends, an
    fp8 cache, CPU tensors and ``TITAN_PREFILL_ATTENTION=vllm`` keep vLLM's kernel."""
    from vllm_titan_plugin import attention

    cache = {"dtype": torch.bfloat16}
    monkeypatch.setattr(compat, "paged_kv_views", lambda attn, head_dim: (torch.zeros(1, dtype=cache["dtype"]),) * 2)
    kern = attention.VllmAttentionKernel.__new__(attention.VllmAttentionKernel)
    backend = {"name": "TRITON_ATTN"}
    object.__setattr__(kern, "attn", SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: backend["name"])))
    kern.head_dim = 256
    q = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)
    prefill, decode = SimpleNamespace(max_query_len=528), SimpleNamespace(max_query_len=1)
    monkeypatch.delenv(attention.PREFILL_ENV, raising=False)
    assert kern.prefill_on_own_kernel(q, prefill)
    assert not kern.prefill_on_own_kernel(q, decode)
    assert not kern.prefill_on_own_kernel(SimpleNamespace(is_cuda=False, dtype=torch.bfloat16), prefill)
    cache["dtype"] = torch.float8_e4m3fn
    assert not kern.prefill_on_own_kernel(q, prefill)
    cache["dtype"] = torch.bfloat16
    backend["name"] = "FLASH_ATTN"
    assert not kern.prefill_on_own_kernel(q, prefill)
    backend["name"] = "TRITON_ATTN"
    monkeypatch.setenv(attention.PREFILL_ENV, "vllm")
    assert not kern.prefill_on_own_kernel(q, prefill)
