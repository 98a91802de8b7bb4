#!/usr/bin/env bash
# Issue 13 on the GPU machine, one device command (~7 min):  bash benchmarks/run_issue13.sh   carry: [".whl"]
# 1. the GPU checks of the new kernels and the BI suite (bits, float64 errors, FLA chunk-backward gradients)
# 2. bi_attention_head: attention and fp32 head, BI vs non-BI, kernel by kernel
# 3. bi_trainer_step: the headline step ratio with the order check, breakdown and profile
# Writes $OUT/{tests.log, bi_attention_head.{json,log}, bi_trainer_step.{json,log}}.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/issue13}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ! python3 -c "import fla.ops.gated_delta_rule" >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla-site .whl/fla_core-*.whl 2>&1 \
        | grep -v "WARNING: Target directory" || true
    export PYTHONPATH=/tmp/fla-site${PYTHONPATH:+:$PYTHONPATH}
fi
stages=${*:-tests kernels step}
for s in $stages; do
    t0=$(date +%s)
    case $s in
        tests) timeout -k 10 ${TESTS_LIMIT:-240} python3 -m pytest -q -s tests/gpu/test_bi_kernels_cuda.py \
                   tests/gpu/test_batch_invariant_cuda.py tests/gpu/test_gdn_cuda.py > "$out/tests.log" 2>&1
               echo "===== tests rc=$? ($(( $(date +%s) - t0 )) s)"
               grep -E "rel err|max err|BI on|BI off|guard|passed|failed|FAILED|Error" "$out/tests.log" | head -40 ;;
        kernels) timeout -k 10 120 python3 benchmarks/bi_attention_head.py --out "$out/bi_attention_head.json" \
                   > "$out/bi_attention_head.log" 2>&1
               echo "===== kernels rc=$? ($(( $(date +%s) - t0 )) s)"
               sed -n '/^SUMMARY/,$p' "$out/bi_attention_head.log"; tail -3 "$out/bi_attention_head.log" ;;
        step) OUT="$out" bash benchmarks/run_issue8.sh step ;;
        *) echo "unknown stage $s (tests kernels step)" ;;
    esac
done
