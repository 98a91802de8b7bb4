#!/usr/bin/env bash
# The two entry points of the README:  `bash scripts/dev.sh demo`  and  `bash scripts/dev.sh test`.
# Both first run scripts/setup.sh (idempotent), so they work on a fresh clone.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
case "${1:-}" in
    demo) shift; exec .venv/bin/python -m titan_rl_ext.demo "$@" ;;
    test) shift; exec .venv/bin/python -m pytest -q "$@" ;;
    *) echo "usage: bash scripts/dev.sh {demo|test} [args...]" >&2; exit 2 ;;
esac
