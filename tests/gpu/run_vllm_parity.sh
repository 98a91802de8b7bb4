#!/usr/bin/env bash
# On the GPU machine, after `source .gpu-carry/device_setup_vllm.sh install` (vLLM 0.26 on PYTHONPATH):
# the plugin inside real vLLM (eager, TRITON_ATTN, FLA kernels), trainer/generator logprob parity with
# batch invariance on and off, on tiny checkpoints of each architecture. Results go to $OUT if set.
set -uo pipefail
out=${OUT:-/tmp/parity-gpu}
mkdir -p "$out" /tmp/tiny
# the plugin must be *installed*: vLLM finds it through the vllm.general_plugins entry point, and with
# --model-impl titan but no plugin it silently serves its native class
python3 -m pip install -q --no-deps --no-index --no-build-isolation --target /tmp/titan-site . || exit 1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/titan-site${PYTHONPATH:+:$PYTHONPATH}"
for arch in qwen3_5 qwen3_5_moe qwen3; do
    # text layout: vLLM 0.26 wants an image processor config for the multimodal architectures
    [ -f /tmp/tiny/$arch/config.json ] || python3 -m titan_rl_ext.tools.make_tiny --arch $arch --layout text --out /tmp/tiny/$arch >/dev/null 2>&1
done
run() {  # name, args...
    local name=$1; shift
    python3 -m titan_rl_ext.tools.parity --attention-backend TRITON_ATTN "$@" > "$out/$name.log" 2>&1
    echo "$name rc=$? $(grep -E '^(prompts|logprob_diff|doctor)' "$out/$name.log" | tr '\n' ' ')"
    grep -E "Error|error" "$out/$name.log" | tail -3
}
run qwen3_5_bi_prefix  --model-dir /tmp/tiny/qwen3_5 --bi --prefix-caching --dtype bfloat16 --doctor
run qwen3_5_nobi_prefix --model-dir /tmp/tiny/qwen3_5 --prefix-caching --dtype bfloat16
run qwen3_5_moe_bi_prefix --model-dir /tmp/tiny/qwen3_5_moe --bi --prefix-caching --dtype bfloat16
run qwen3_bi_prefix --model-dir /tmp/tiny/qwen3 --bi --prefix-caching --dtype bfloat16 --doctor
