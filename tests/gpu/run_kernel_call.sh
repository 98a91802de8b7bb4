#!/usr/bin/env bash
# One device call for the kernel-only checks and timings (no vLLM): the BI attention tests and long-context bench,
# the BI GEMM's M-bucket sweep. Writes everything under $OUT; each step's log beside its JSON.
#   bash tests/gpu/run_kernel_call.sh [gdn_diag] [gdn_grid] [attention] [gemm_tests] [gemm_table]
set -uo pipefail
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ] && ls .whl/fla_core-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/fla .whl/fla_core-*.whl && export PYTHONPATH=/tmp/fla:${PYTHONPATH:-}
fi
steps=${*:-gdn_grid attention gemm_table}
for step in $steps; do
  case $step in
    attention)
      python3 -m pytest -q -x tests/gpu/test_bi_kernels_cuda.py -k attention tests/gpu/test_paged_kv_cuda.py 2>&1 | tail -15 | tee "$OUT/attention_tests.log"
      python3 benchmarks/bi_attention_long.py --decode "8192:1,8;32768:1,8,32" --prefill 32768,65536 --reps 6 \
        --out "$OUT/bi_attention_long.json" 2>&1 | tail -40 ;;
    gdn_diag)  # each fold kernel repeated alone: where the grid's bits go (tests/gpu/gdn_grid_diag.py)
      python3 tests/gpu/gdn_grid_diag.py --out "$OUT/gdn_grid_diag.json" > "$OUT/gdn_grid_diag.log" 2>&1
      tail -60 "$OUT/gdn_grid_diag.log" ;;
    gdn_grid)
      python3 benchmarks/gdn_chunk_grid.py --out "$OUT/gdn_chunk_grid.json" > "$OUT/gdn_chunk_grid.log" 2>&1
      tail -40 "$OUT/gdn_chunk_grid.log" ;;
    gemm_tests)
      python3 -m pytest -q -x tests/gpu/test_batch_invariant_cuda.py -k "gemm or matmul" 2>&1 | tail -8 | tee "$OUT/gemm_tests.log" ;;
    gemm_table)
      cp titan_rl_ext/kernels/bi_gemm_tables.json "$OUT/bi_gemm_tables.json"
      python3 tests/gpu/bi_gemm_tiles.py --ms 1,8,16,32,64,96,128,192,256,1024,4096,8192 --reps 8 \
        --out "$OUT/bi_gemm_tiles.json" --table-out "$OUT/bi_gemm_tables.json" > "$OUT/bi_gemm_tiles.log" 2>&1
      grep SUMMARY "$OUT/bi_gemm_tiles.log"; tail -3 "$OUT/bi_gemm_tiles.log" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
python3 -c "import json,subprocess as s;print(json.dumps({'git':s.getoutput('git rev-parse HEAD'),'git_tree':s.getoutput('git rev-parse HEAD^{tree}')}))" > "$OUT/tree.json" 2>/dev/null || true
