#!/usr/bin/env bash
# `python -m pytest -q tests/gpu` on the lent GPU with everything the tests import on the path, so that nothing
# skips or fails for want of a package: fla-core and torchtitan's wheels (`.whl/`, from
# scripts/make_trainer_carry.sh) installed into /tmp/gpu-test-site, vLLM where the set-up staged it.
#
#   bash tests/gpu/run_pytest.sh [pytest args]      # carry .whl; after `device_setup_vllm.sh install` for the vLLM tests
#   bash tests/gpu/run_pytest.sh tests/gpu/test_x.py  # only that file (a path given replaces tests/gpu)
set -uo pipefail
cd "$(dirname "$0")/../.."
site=/tmp/gpu-test-site
if [ ! -f $site/.installed ]; then
    python3 -m pip install -q --no-deps --no-index --target $site .whl/fla_core-*.whl .whl/trainer/*.whl \
        2>&1 | grep -v "WARNING: Target directory" || true
    python3 -c "import sys; sys.path.insert(0, '$site'); import fla, torchtitan" || { echo "install into $site failed"; exit 1; }
    touch $site/.installed
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
source tests/gpu/triton_autotune.sh
triton_autotune_restore
# tests/gpu unless a test path is given (then only what is named runs)
targets=(tests/gpu)
for a in "$@"; do [[ $a == tests/* ]] && { targets=(); break; }; done
python3 -m pytest -q -rfEs "${targets[@]}" "$@"; rc=$?
triton_autotune_save "${OUT:-/tmp}"
exit $rc
