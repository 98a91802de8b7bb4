"""Trained titan weights out as a stock HF checkpoint, shaped like the checkpoint the run started from
(the command line is ``titan_rl_ext.tools.export``; the trainer calls ``export_hf`` at the end of a run).

The output has the source's architecture and ``config.json``, its key layout (text ``model.*`` or VLM
``model.language_model.*``; fused or per-expert MoE weights), its tokenizer and other side files, each
tensor in the source's dtype, and the tensors the text model does not train (vision tower, MTP head)
copied unchanged. So it loads in transformers and serves with vLLM's native class, or again with
``--model-impl titan``. ``load_dcp_titan_state`` reads the titan parameters of a torchtitan checkpoint step
(its flattened model keys are the titan parameter names).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from titan_rl_ext.models.common.state_dict_adapter import CheckpointMismatchError
from titan_rl_ext.models.hf import adapter_for, config_from_hf, read_config

WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json", "*.bin", "pytorch_model.bin.index.json")
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def _source_tensors(source: Path) -> dict[str, tuple[Path, str]]:
    from safetensors import safe_open

    out: dict[str, tuple[Path, str]] = {}  # key -> (file, safetensors dtype name)
    for f in sorted(source.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                out[k] = (f, st.get_slice(k).get_dtype())
    if not out:
        raise FileNotFoundError(f"no *.safetensors files in {source}")
    return out



def export_hf(titan_sd: Mapping[str, torch.Tensor], source: str | Path, out: str | Path) -> Path:
    """Write ``titan_sd`` (titan names, full tensors) as an HF checkpoint shaped like ``source``. Strict:
    the exported key set must equal the source's, or nothing is written."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    source, out = Path(source), Path(out)
    if out.resolve() == source.resolve():
        raise ValueError("export into the source directory would overwrite the checkpoint the run started from")
    hf_config = read_config(source)
    adapter = adapter_for(hf_config, config_from_hf(hf_config))
    src = _source_tensors(source)
    keys = list(src)
    adapter.layout = adapter.detect_layout(keys)
    adapter.expert_layout = "per_expert" if any(".mlp.experts.0." in k for k in keys) else "fused"
    expected = set(adapter.expected)
    missing, extra = sorted(expected - set(titan_sd)), sorted(set(titan_sd) - expected)
    if missing or extra:
        raise CheckpointMismatchError(f"titan state dict does not fit {source}: missing {missing[:10]}, unexpected {extra[:10]}")
    hf_sd = adapter.to_hf({k: v.detach().to("cpu").contiguous() for k, v in titan_sd.items()})
    if adapter.config.tie_embeddings and "lm_head.weight" in src:  # a tied checkpoint that stores the head too
        emb = next(k for k in hf_sd if k.endswith("embed_tokens.weight"))
        hf_sd["lm_head.weight"] = hf_sd[emb]
    kept: dict[Path, list[str]] = {}  # not trained: copied as they are, each source file opened once
    for k in keys:
        if k.startswith(adapter.skipped_prefixes):
            kept.setdefault(src[k][0], []).append(k)
    for f, names in kept.items():
        with safe_open(str(f), framework="pt") as st:
            hf_sd.update({k: st.get_tensor(k) for k in names})
    if set(hf_sd) != set(keys):
        raise CheckpointMismatchError(
            f"exported keys differ from {source}: missing {sorted(set(keys) - set(hf_sd))[:10]}, "
            f"unexpected {sorted(set(hf_sd) - set(keys))[:10]}")
    for k, t in hf_sd.items():  # each tensor in the source's dtype (fp32 master weights -> a bf16 checkpoint)
        dt = _ST_DTYPES.get(src[k][1])
        if dt is not None and t.dtype != dt:
            hf_sd[k] = t.to(dt)
    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():  # config, tokenizer, generation config, chat template, ...
        if f.is_file() and not any(f.match(p) for p in WEIGHT_FILES):
            shutil.copy2(f, out / f.name)
    save_file({k: v.contiguous() for k, v in hf_sd.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def load_dcp_titan_state(step_dir: str | Path, source: str | Path) -> dict[str, torch.Tensor]:
    """The titan parameters of a torchtitan checkpoint step (single process, CPU)."""
    import torch.distributed.checkpoint as dcp

    cfg = config_from_hf(read_config(source))
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device="cpu")
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=str(step_dir))
    return sd
