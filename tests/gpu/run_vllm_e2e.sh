#!/usr/bin/env bash
# On the GPU machine, after `source .gpu-carry/device_setup_vllm.sh install` (vLLM 0.26 on PYTHONPATH) and with
# fla-core's wheel in .whl/: the plugin inside real vLLM on checkpoints with the real Qwen3.5-9B and
# Qwen3.5-35B-A3B layer shapes (4 layers: 3 GDN + 1 gated attention; real vocabulary; random bf16 weights).
#   bash tests/gpu/run_vllm_e2e.sh setup    # install the package + FLA, build the checkpoints on the GPU (SKIP_MOE / SKIP_VLM=1: fewer)
#   bash tests/gpu/run_vllm_e2e.sh setup_bg # the same, started in the background and returned from at once: run it in
#                                           # the vLLM staging command (it needs no vLLM); a later stage waits for it
#   bash tests/gpu/run_vllm_e2e.sh parity   # tools.parity BI on/off (PARITY_BI_ONLY=1: on), prefix caching + split prefills, both shapes
#                                           # (the engine as shipped: full decode CUDA graphs; PARITY_EAGER=1: --enforce-eager)
#   bash tests/gpu/run_vllm_e2e.sh graphs   # tests/gpu/vllm_graphs.py: BI bits under every capture size = eager
#   bash tests/gpu/run_vllm_e2e.sh checks_bg   # parity then graphs, in the background (their engines take 0.3 of the
#                                              # GPU each): start it before `run_pytest.sh` in one call, then
#   bash tests/gpu/run_vllm_e2e.sh checks_wait # wait for it (at most CHECKS_WAIT_S, default 400 s) and bring its logs to $OUT
#   bash tests/gpu/run_vllm_e2e.sh graphs_moe  # the same on the 35B-A3B-shaped MoE checkpoint
#   bash tests/gpu/run_vllm_e2e.sh ipc      # CUDA IPC swap into a running engine + the IPC round-trip test
#   bash tests/gpu/run_vllm_e2e.sh ipc_engine  # tests/gpu/ipc_engine_swap.py: vLLM's weight-transfer calls with CUDA IPC
#                                              # handles (titan_ipc) timed beside the cuda_ipc push route, one server
#   bash tests/gpu/run_vllm_e2e.sh bench    # benchmarks/vllm_throughput.py: native default, titan, titan BI (and titan with
#                                           # every mixed step peeled: titan_peel), all up at once, timed rep by rep -> serving.json
#                                           # (BENCH_CONFIGS, BENCH_REPS; BENCH_ROLLOUT=NxLxT, default 1024x256x128, empty: none)
#   bash tests/gpu/run_vllm_e2e.sh bench_eager  # titan eager beside titan (what the graphs buy)
#   bash tests/gpu/run_vllm_e2e.sh bench_bi # titan with BI on vs off at a smaller prefill
#   bash tests/gpu/run_vllm_e2e.sh setup_long  # full-depth checkpoints: the 9B shape at 32 layers (dense32, dense32_vlm;
#                                              # the published max_position_embeddings), in the background like setup_bg
#   bash tests/gpu/run_vllm_e2e.sh attn_long   # benchmarks/bi_attention_long.py: the BI split-KV kernel vs vLLM's at 8K-64K
#   bash tests/gpu/run_vllm_e2e.sh parity_long # parity at 32K context on dense32: BI, graphs, prefix caching (a 32K shared
#                                              # prefix, prompts split over several prefill steps)
#   bash tests/gpu/run_vllm_e2e.sh bench_long  # serving_long.json: decode at 8K/32K/64K, prefill 1x32K/1x64K, a rollout with
#                                              # answers of 1-4K tokens, on dense32 (LONG_CONFIGS, LONG_SEQUENTIAL=1: one engine
#                                              # at a time, LONG_MERGE=earlier.json to join an earlier call's engines)
#   bash tests/gpu/run_vllm_e2e.sh profile  # one profiled generate call per workload: CUDA kernels by time
#                                           # (PROFILE_CKPT dense|dense32, PROFILE_CONFIGS, default titan,titan_bi; native_graphs takes ~300 s more;
#                                           #  HOST_PROFILE=1: also cProfile each decode call: the host's time by function)
# Results (logs, JSON) go to $OUT (default /tmp/e2e-gpu).
set -uo pipefail
out=${OUT:-/tmp/e2e-gpu}
ck=/tmp/ckpt
mkdir -p "$out" "$ck"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
export PYTHONPATH="/tmp/titan-site${PYTHONPATH:+:$PYTHONPATH}"
# autotuning results from earlier leases (vLLM's native GDN kernels alone autotune for minutes on a cold machine)
source "$(dirname "$0")/triton_autotune.sh"
triton_autotune_restore
trap 'triton_autotune_save "$out"' EXIT
what=${1:-all}

if [[ $what == setup_bg ]]; then
    # setsid: a process in its own session outlives this command while the machine stays up; its output goes under
    # /tmp, not $OUT (a device call's $OUT is gone once the call has replied)
    # (setup itself skips every checkpoint already built)
    [ -f $ck/.setup-running ] && { echo "a background setup is already running"; trap - EXIT; exit 0; }
    touch $ck/.setup-running
    OUT=/tmp/e2e-setup setsid nohup bash -c "bash '$0' setup > /tmp/e2e-setup.log 2>&1; rm -f $ck/.setup-running" \
        > /dev/null 2>&1 < /dev/null &
    trap - EXIT
    echo "setup started in the background (log: /tmp/e2e-setup.log)"; exit 0
fi
if [[ $what == checks_bg ]]; then  # correctness only: nothing timed may run beside it
    rm -rf /tmp/e2e-checks /tmp/e2e-checks.done; mkdir -p /tmp/e2e-checks
    OUT=/tmp/e2e-checks setsid nohup bash -c "bash '$0' parity > /tmp/e2e-checks/checks.log 2>&1; bash '$0' graphs >> /tmp/e2e-checks/checks.log 2>&1; touch /tmp/e2e-checks.done" \
        > /dev/null 2>&1 < /dev/null &
    trap - EXIT
    echo "parity + graphs started in the background (log: /tmp/e2e-checks/checks.log)"; exit 0
fi
if [[ $what == checks_wait ]]; then
    t=$(date +%s)
    while [ ! -f /tmp/e2e-checks.done ] && (( $(date +%s) - t < ${CHECKS_WAIT_S:-400} )); do sleep 3; done
    [ -f /tmp/e2e-checks.done ] && echo "checks done (waited $(( $(date +%s) - t )) s)" || echo "checks STILL RUNNING after $(( $(date +%s) - t )) s"
    cat /tmp/e2e-checks/checks.log; cp /tmp/e2e-checks/*.log /tmp/e2e-checks/*.json "$out"/ 2>/dev/null
    trap - EXIT; exit 0
fi
if [[ $what == setup_long ]]; then  # started in the background (two 18 GB checkpoints: about two minutes)
    [ -f $ck/.setup-running ] && { echo "a background setup is already running"; trap - EXIT; exit 0; }
    touch $ck/.setup-running
    setsid nohup bash -c "
        python3 -m pip install -q --no-deps --no-index --no-build-isolation --target /tmp/titan-site . &&
        python3 -m pip install -q --no-deps --no-index --target /tmp/titan-site .whl/fla_core-*.whl &&
        for layout in text vlm; do d=$ck/dense32\$( [ \$layout = vlm ] && echo _vlm ); [ -f \$d/config.json ] ||
            python3 -m titan_rl_ext.tools.make_tiny --arch qwen3_5 --shape qwen3_5-9b --layers 32 --layout \$layout \
                --dtype bfloat16 --device cuda --out \$d || break; done; rm -f $ck/.setup-running" > /tmp/e2e-setup.log 2>&1 < /dev/null &
    trap - EXIT
    echo "full-depth checkpoints building in the background (log: /tmp/e2e-setup.log)"; exit 0
fi
if [[ $what != setup && $what != all && -f $ck/.setup-running ]]; then  # a setup_bg build still running
    t=$(date +%s)
    while [ -f $ck/.setup-running ]; do sleep 2; done
    echo "waited $(( $(date +%s) - t )) s for the background setup: $(tail -1 /tmp/e2e-setup.log)"
fi

if [[ $what == setup || $what == all ]]; then
    # the plugin must be *installed* (entry point), not only importable
    python3 -m pip install -q --no-deps --no-index --no-build-isolation --target /tmp/titan-site . || exit 1
    python3 -m pip install -q --no-deps --no-index --target /tmp/titan-site .whl/fla_core-*.whl || exit 1
    t=$(date +%s)
    [ -f $ck/dense/config.json ] || python3 -m titan_rl_ext.tools.make_tiny --arch qwen3_5 --shape qwen3_5-9b --layers 4 \
        --layout text --dtype bfloat16 --device cuda --out $ck/dense > "$out/make_dense.log" 2>&1 || { tail -5 "$out/make_dense.log"; exit 1; }
    [ -f $ck/moe/config.json ] || [ -n "${SKIP_MOE:-}" ] || python3 -m titan_rl_ext.tools.make_tiny --arch qwen3_5_moe --shape qwen3_5-35b-a3b --layers 4 \
        --layout text --dtype bfloat16 --device cuda --out $ck/moe > "$out/make_moe.log" 2>&1 || { tail -5 "$out/make_moe.log"; exit 1; }
    [ -f $ck/dense_vlm/config.json ] || [ -n "${SKIP_VLM:-}" ] || python3 -m titan_rl_ext.tools.make_tiny --arch qwen3_5 --shape qwen3_5-9b --layers 4 \
        --layout vlm --dtype bfloat16 --device cuda --out $ck/dense_vlm > "$out/make_dense_vlm.log" 2>&1 || { tail -5 "$out/make_dense_vlm.log"; exit 1; }
    echo "checkpoints built in $(( $(date +%s) - t )) s: $(du -sh $ck/* | tr '\n' ' ')"
fi

parity() {  # name, args...
    local name=$1; shift
    local t=$(date +%s)
    timeout 300 python3 -m titan_rl_ext.tools.parity --attention-backend TRITON_ATTN --dtype bfloat16 \
        ${PARITY_EAGER:+--enforce-eager} "$@" > "$out/$name.log" 2>&1
    echo "$name rc=$? $(( $(date +%s) - t ))s $(grep -E '^(engine|prompts|logprob_diff|doctor)' "$out/$name.log" | tr '\n' ' ')"
    grep -E "Error|error" "$out/$name.log" | grep -v "^WARNING" | tail -3
}
if [[ $what == parity || $what == all ]]; then
    parity dense_bi   --model-dir $ck/dense --max-num-batched-tokens 528 --bi --prefix-caching --num-seqs 16 --max-tokens 32 --shared-prefix 1200 --doctor
    [ -n "${PARITY_BI_ONLY:-}" ] || parity dense_nobi --model-dir $ck/dense --max-num-batched-tokens 528 --prefix-caching --num-seqs 16 --max-tokens 32 --shared-prefix 1200
    [ -f $ck/moe/config.json ] && parity moe_bi     --model-dir $ck/moe --max-num-batched-tokens 1056 --bi --prefix-caching --num-seqs 16 --max-tokens 32 --shared-prefix 1200 --doctor
    [ -f $ck/moe/config.json ] && { [ -n "${PARITY_BI_ONLY:-}" ] || parity moe_nobi   --model-dir $ck/moe --max-num-batched-tokens 1056 --prefix-caching --num-seqs 16 --max-tokens 32 --shared-prefix 1200; }
fi

if [[ $what == ipc || $what == all ]]; then
    TITAN_SWAP_TOKEN=ipc timeout 300 python3 tests/gpu/vllm_ipc_swap.py --model-dir $ck/dense --out "$out/ipc_swap.json" > "$out/ipc_swap.log" 2>&1
    echo "ipc_swap rc=$? $(grep -E '^cuda_ipc swap' "$out/ipc_swap.log")"; tail -1 "$out/ipc_swap.log"
    timeout 200 python3 -m pytest -q tests/gpu/test_cuda_ipc.py 2>&1 | tail -3
fi

if [[ $what == ipc_engine || $what == all ]]; then
    TITAN_SWAP_TOKEN=ipc timeout 500 python3 tests/gpu/ipc_engine_swap.py --model-dir $ck/dense --pushes ${IPC_PUSHES:-6} \
        --out "$out/ipc_engine_swap.json" > "$out/ipc_engine_swap.log" 2>&1
    echo "ipc_engine_swap rc=$? $(grep -E '^[0-9]+ tensors|^SKIP|^FAILED' "$out/ipc_engine_swap.log")"; tail -1 "$out/ipc_engine_swap.log"
fi

if [[ $what == graphs || $what == all ]]; then
    timeout 560 python3 tests/gpu/vllm_graphs.py --model-dir $ck/dense --out "$out/graphs.json" 2>&1 | tee "$out/graphs.log" | tail -12
fi
if [[ $what == graphs_moe ]]; then  # the 35B-A3B shape (setup without SKIP_MOE): grouped experts under graphs
    timeout 560 python3 tests/gpu/vllm_graphs.py --model-dir $ck/moe --out "$out/graphs_moe.json" 2>&1 | tee "$out/graphs_moe.log" | tail -12
fi

# One table from one driver run: the three engines start one after the other (a cold machine spends ~150 s
# compiling and autotuning vLLM's native class) and are then timed back to back, rep by rep, so a drift in
# the host's speed (decode at small B is host-bound) hits all three alike.
if [[ $what == bench || $what == all ]]; then
    rollout=${BENCH_ROLLOUT-1024x256x128}  # BENCH_ROLLOUT= (empty): no rollout workload
    timeout 590 python3 benchmarks/vllm_throughput.py --model-dir $ck/dense --native-dir $ck/dense_vlm \
        --configs ${BENCH_CONFIGS:-native_graphs,titan,titan_bi,titan_peel} --decode-tokens 128 --reps ${BENCH_REPS:-5} \
        ${rollout:+--rollout $rollout} \
        --out "$out/throughput.json" --serving-json "$out/serving.json" --timeout 300 2>&1 | tee "$out/throughput.log" | tail -14
fi
if [[ $what == bench_eager || $what == all ]]; then
    timeout 560 python3 benchmarks/vllm_throughput.py --model-dir $ck/dense --configs titan,titan_eager \
        --decode-tokens 64 --reps 3 --out "$out/throughput_eager.json" --timeout 240 2>&1 | tee "$out/throughput_eager.log" | tail -8
fi
if [[ $what == bench_bi || $what == all ]]; then
    # BI's cost in the generator (smaller prefill: BI attention runs one sequence at a time)
    timeout 560 python3 benchmarks/vllm_throughput.py --model-dir $ck/dense --configs titan,titan_bi --decode-tokens 64 \
        --prefill 4x1024 --reps 2 --out "$out/throughput_bi.json" --timeout 200 2>&1 | tee "$out/throughput_bi.log" | tail -8
fi
if [[ $what == attn_long ]]; then
    timeout 580 python3 benchmarks/bi_attention_long.py --out "$out/bi_attention_long.json" 2>&1 | tee "$out/attn_long.log" | tail -20
fi
if [[ $what == parity_long ]]; then  # 12 prompts, every third extending a 32K shared prefix; 4096-token steps
    parity dense32_long_bi --model-dir $ck/dense32 --max-num-batched-tokens 4224 --bi --prefix-caching --num-seqs 12 \
        --max-tokens 32 --shared-prefix 32768 --doctor
fi
if [[ $what == bench_long ]]; then
    timeout 590 python3 benchmarks/vllm_throughput.py --model-dir $ck/dense32 --native-dir $ck/dense32_vlm \
        --configs ${LONG_CONFIGS:-native_graphs,titan,titan_bi} ${LONG_SEQUENTIAL:+--sequential} --workload-major \
        --batch-sizes "" --decode-ctx "${LONG_DECODE:-8192:1,8,32;32768:1,8,32;65536:1,4}" --decode-tokens 128 \
        --prefill "${LONG_PREFILL:-1x32768,1x65536}" --rollout "${LONG_ROLLOUT-64x1024x1024-4096}" --reps ${BENCH_REPS:-3} \
        ${LONG_MERGE:+--merge $LONG_MERGE} --gpu-mem ${LONG_GPU_MEM:-0} \
        --out "$out/throughput_long.json" --serving-json "$out/serving_long.json" --timeout 400 2>&1 | tee "$out/throughput_long.log" | tail -20
fi
if [[ $what == profile ]]; then
    pc=${PROFILE_CKPT:-dense}  # dense32: the full-depth checkpoints of setup_long
    timeout 580 python3 benchmarks/vllm_throughput.py --model-dir $ck/$pc --native-dir $ck/${pc}_vlm \
        --configs ${PROFILE_CONFIGS:-titan,titan_bi} --batch-sizes ${PROFILE_BATCH_SIZES:-1,256} --decode-tokens 16 --reps 1 --sequential \
        --profile ${HOST_PROFILE:+--host-profile} --out "$out/profile.json" --timeout 400 > "$out/profile.log" 2>&1
    echo "profile rc=$?"; grep -A40 "^PROFILE" "$out/profile.log" | grep -E "^PROFILE|by category" ; grep -A12 "^HOST PROFILE" "$out/profile.log"; grep -B2 -A5 FAILED "$out/profile.log" | tail -20
fi
