#!/usr/bin/env bash
# The trainer's pure-Python dependencies as wheels for the lent GPU machine (Python 3.12, no package registry),
# into .whl/trainer/ (ignored by git; carried to the device with `carry: [".whl"]`). That image already holds
# torch 2.11, numpy, pandas, pyarrow, fsspec, xxhash, tokenizers, safetensors, tensorboard, einops, pillow,
# requests and pyyaml; what torchtitan 0.3.0, its config/data stack and the math reward add is fetched here
# (versions as in this project's CPU environment). On the device:
#   python3 -m pip install -q --no-deps --no-index --target /tmp/titan-site .whl/trainer/*.whl
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/.whl/trainer"
mkdir -p "$dest"
pkgs=(torchtitan==0.3.0 torchdata==0.11.0 torch_checkpointing==0.1.1 spmd_types==0.2.3 tyro==1.0.17
      docstring-parser typeguard datasets==4.7.0 "dill<0.4.1" "multiprocess<0.70.19"
      math-verify==0.9.0 latex2sympy2_extended==1.11.0 "antlr4-python3-runtime==4.13.2"
      # the OpenAI API server the RL run spawns: vLLM 0.26's entrypoint imports these, which neither the image
      # nor ../shared/gpu's vLLM carry holds (the image has click, h11, uvloop, prometheus-client)
      uvicorn==0.55.0 prometheus-fastapi-instrumentator==8.1.0 python-multipart==0.0.34
      model-hosting-container-standards==0.1.16 jmespath supervisor watchfiles==1.1.1)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d "$dest" "${pkgs[@]}"
ls "$dest"
du -sh "$dest"
