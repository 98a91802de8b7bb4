#!/usr/bin/env bash
# The RL loop on one GPU, three generator arms of one recipe: `rl_gpu_hybrid` (titan_rl_ext/configs/rl_gpu.py)
# with the generator on vLLM's native Qwen3.5 class, on --model-impl titan, and on titan with batch invariance.
# On the lent GPU machine, after `source .gpu-carry/device_setup_vllm.sh install` (vLLM 0.26 on PYTHONPATH), with fla-core's
# wheel and the trainer's wheels (`bash scripts/make_trainer_carry.sh`) in .whl/ -- one stage per command:
#   bash tests/gpu/run_rl_e2e.sh smoke      # install, then the same recipe on the tiny model, BI on, 6 steps (~2 min):
#                                           # the whole GPU path (FSDP bf16, CUDA IPC push, swap, BI) before the big runs
#   bash tests/gpu/run_rl_e2e.sh setup      # install, build the 0.85 B checkpoint and its warm-up (cached in /tmp/rlcache)
#   bash tests/gpu/run_rl_e2e.sh ckpt_bg    # the same build started in the background and returned from at once: run
#                                           # it in the staging command (only .whl/fla_core-*.whl needed there, no vLLM),
#                                           # so the build overlaps the next command's install; an arm waits for it
#   bash tests/gpu/run_rl_e2e.sh titan_bi   # one arm: 40 steps (RL_STEPS), metrics.jsonl + plots in $OUT/<arm>
#   bash tests/gpu/run_rl_e2e.sh titan
#   bash tests/gpu/run_rl_e2e.sh native
#   bash tests/gpu/run_rl_e2e.sh report     # arms.png + rl_gpu.json over the arms found in $OUT (TITAN_GIT names the commit)
#   bash tests/gpu/run_rl_e2e.sh resume     # the BI window switch and a SIGKILLed trainer's resume, toy size
#                                           # (tests/gpu/rl_window_resume.py): $OUT/window_resume.json
#   bash tests/gpu/run_rl_e2e.sh ipc_arms   # install, then smoke's recipe (toy, BI on, 8 steps: RL_STEPS) twice, its
#                                           # pushes by today's IPC route (--rl.weight-transport cuda_ipc) and through
#                                           # vLLM's weight-transfer calls (titan_ipc; the spawned server gets the
#                                           # engine's flags itself), issue 43: metrics.jsonl + log tails in
#                                           # $OUT/ipc_arms/<transport>, both side by side in $OUT/ipc_arms/summary.json
#                                           # (push seconds after step 1, bytes, step-1 gap, every stale max 0, env).
#                                           # IPC_ARMS="titan_ipc" runs one arm; the summary covers every arm this
#                                           # machine has run (kept in /tmp/rl-ipc-arms), so the two may be split
# The long-answer recipe `rl_gpu_long` (issue 41: generation dominates the step), the same arms; a 30-step arm
# outlasts one command, so it runs detached and a command waits for it:
#   bash tests/gpu/run_rl_e2e.sh long_smoke     # install, then its toy (worked_sum_short), BI on, 3 steps
#   bash tests/gpu/run_rl_e2e.sh long_setup     # install, build the 1.13 B checkpoint and its chain warm-up (~10 min)
#   bash tests/gpu/run_rl_e2e.sh long_ckpt_bg   # the same build in the background (the staging command, as ckpt_bg)
#   WINDOW=4 RUN=1 bash tests/gpu/run_rl_e2e.sh long_titan_bi   # starts one arm (30 steps, RL_STEPS) detached in
#                                           # /tmp/rl-long/w<WINDOW>/<arm>_r<RUN>, then waits as long_wait does
#   bash tests/gpu/run_rl_e2e.sh long_wait      # waits up to LONG_WAIT_S (540) for the arm started last; when it has
#                                           # ended, its metrics.jsonl, run_env.json, plots and log tails land in
#                                           # $OUT/long/w<WINDOW>/<arm>_r<RUN> (exit 3: still running, wait again)
# run_env.json records the GPU, versions, recipe, window, run and commit (TITAN_GIT, TITAN_GIT_TREE, else git) for
# `python -m titan_rl_ext.tools.rl_arms --windows` (docs/training.md, "Long answers").
# LoRA RL on the 9B shape, `rl_lora_9b` (issue 44): the checkpoint build (~1 min), its LoRA warm-up (<= 5 min) and
# 30 steps outlast one command, so all three run detached, in that order, and a command waits for them:
#   bash tests/gpu/run_rl_e2e.sh lora           # install, start it in /tmp/rl-lora/run, then waits as lora_wait
#                                           # does (up to LORA_WAIT_S, 480 here: the install came first)
#   bash tests/gpu/run_rl_e2e.sh lora_wait      # waits up to LORA_WAIT_S (540); when it has ended, its metrics.jsonl,
#                                           # run_env.json, warmup.json, adapter/adapter_config.json, log tails and
#                                           # rl_lora.json (python -m titan_rl_ext.tools.rl_lora_report) land in
#                                           # $OUT/lora (exit 3: still running, wait again)
# A stage that needs the checkpoint builds it first when this machine has none (a fresh lease).
set -uo pipefail
out=${OUT:-/tmp/rl-gpu}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 OMP_NUM_THREADS=4
export TITAN_RL_CACHE=/tmp/rlcache
export PYTHONPATH="/tmp/titan-site${PYTHONPATH:+:$PYTHONPATH}"
# A fresh lease compiles and autotunes every Triton kernel again (fla's chunk kernels, the titan kernels, vLLM's
# attention): most of a toy warm-up's time (docs/decisions.md). Each stage leaves the cache in $OUT/triton-cache.tar.gz; put that
# file at .gpu-carry/triton-cache.tar.gz and carry it, and the next lease starts from it.
export TRITON_CACHE_DIR=/tmp/triton-cache TRITON_CACHE_AUTOTUNING=1
if [ ! -d /tmp/triton-cache ]; then
    mkdir -p /tmp/triton-cache
    [ -f .gpu-carry/triton-cache.tar.gz ] && tar -xzf .gpu-carry/triton-cache.tar.gz -C /tmp/triton-cache \
        && echo "triton cache: $(find /tmp/triton-cache -type f | wc -l) files from .gpu-carry"
fi
# the autotuner's results alone are small: tests/gpu/triton_autotune.sh carries them in the repo
source "$(dirname "$0")/triton_autotune.sh"
triton_autotune_restore
save_triton_cache() {
    triton_autotune_save "$out"
    tar -czf "$out/triton-cache.tar.gz" -C /tmp/triton-cache . 2>/dev/null
    local mb=$(( $(stat -c %s "$out/triton-cache.tar.gz") / 1048576 ))
    [ $mb -le 40 ] || { echo "triton cache ${mb} MB: too large to carry, left out"; rm -f "$out/triton-cache.tar.gz"; }
}
trap save_triton_cache EXIT
what=${1:?stage: smoke | setup | ckpt_bg | titan_bi | titan | native | report | resume | ipc_arms | long_* | lora | lora_wait}
# which checkpoint a stage needs, and the markers of its (background) build
case $what in
    long_*) ckpt_mod=rl_long ckpt_fn=long_rl_checkpoint ready=/tmp/rlcache/.long_ready building=/tmp/rlcache/.long_building ;;
    lora*) ckpt_mod=rl_lora ckpt_fn=lora_9b_checkpoint ready=/tmp/rlcache/.lora_ready building=/tmp/rlcache/.lora_building ;;
    *) ckpt_mod=rl_gpu ckpt_fn=gpu_rl_checkpoint ready=/tmp/rlcache/.ready building=/tmp/rlcache/.building ;;
esac

install() {
    [ -f /tmp/titan-site/.installed ] && return 0
    python3 -m pip install -q --no-deps --no-index --no-build-isolation --target /tmp/titan-site . || return 1
    python3 -m pip install -q --no-deps --no-index --target /tmp/titan-site .whl/fla_core-*.whl .whl/trainer/*.whl || return 1
    touch /tmp/titan-site/.installed
}
checkpoint() {
    python3 -c "from titan_rl_ext.configs.$ckpt_mod import $ckpt_fn; print($ckpt_fn())" > "$out/setup.log" 2>&1 \
        || { tail -20 "$out/setup.log"; return 1; }
    tail -3 "$out/setup.log"
}
wait_for_checkpoint() {  # a background build (ckpt_bg, long_ckpt_bg) if one runs, else build it here
    local t=$(date +%s)
    while [ -f $building ] && [ ! -f $ready ]; do sleep 2; done
    [ $(( $(date +%s) - t )) -gt 2 ] && { echo "waited $(( $(date +%s) - t )) s for the background checkpoint build"; tail -2 /tmp/rlcache/build.log; }
    [ -f $ready ] || { checkpoint && touch $ready; }
}
if [ "$what" = ckpt_bg ] || [ "$what" = long_ckpt_bg ]; then  # before install(): the trainer's wheels and vLLM need not be here yet
    [ -f $ready ] && { echo "checkpoint already built"; exit 0; }
    python3 -m pip install -q --no-deps --no-index --no-build-isolation --target /tmp/ckpt-site . .whl/fla_core-*.whl \
        2>&1 | grep -v "WARNING: Target directory"
    mkdir -p /tmp/rlcache && touch $building
    # setsid: a process in its own session outlives this command while the machine stays up
    PYTHONPATH=/tmp/ckpt-site setsid nohup bash -c "cd /tmp && python3 -c 'from titan_rl_ext.configs.$ckpt_mod import \
$ckpt_fn; print($ckpt_fn())' > /tmp/rlcache/build.log 2>&1 && touch $ready; rm -f $building" > /dev/null 2>&1 < /dev/null &
    trap - EXIT
    echo "checkpoint build started in the background (log: /tmp/rlcache/build.log)"; exit 0
fi
install || { echo "install failed"; exit 1; }

arm_flags() {  # the generator arm's trainer flags
    case $1 in
        titan_bi|smoke|long_smoke) echo --rl.batch-invariant-steps 1000000 ;;
        native) echo --rl.server-model-impl auto ;;
    esac
}
# a detached run (its folder $1, where it writes rc when it ends): wait for it (up to $3 s), then bring its files
# back into $2
wait_detached() {
    local run=$1 back=$2 bound=$3 t=$(date +%s) seen=""
    while [ ! -f "$run/rc" ] && [ $(( $(date +%s) - t )) -lt $bound ]; do
        # a LoRA run's warm-up (setup.log) comes before its steps
        local last; last=$(grep -h -e "RL step" -e "LoRA warm-up step" "$run/setup.log" "$run/train.log" 2>/dev/null \
            | tail -1 | sed 's/.*\(RL step\|LoRA warm-up step\)/\1/')
        [ -n "$last" ] && [ "$last" != "$seen" ] && { echo "$(( $(date +%s) - t )) s: $last"; seen=$last; }
        sleep 15
    done
    mkdir -p "$back"
    cp "$run/metrics.jsonl" "$run/run_env.json" "$back/" 2>/dev/null
    [ -f "$run/rc" ] || { echo "$run still running (step: $seen); wait again"; return 3; }
    local rc; rc=$(cat "$run/rc")
    echo "$run rc=$rc"; grep "RL step" "$run/train.log" 2>/dev/null | sed -n '1,2p;$p' | cut -c60-
    grep -v "^\[rank" "$run/train.log" 2>/dev/null | tail -200 > "$back/train_tail.log"
    tail -200 "$run/server.log" > "$back/server_tail.log" 2>/dev/null
    python3 -m titan_rl_ext.tools.plot "$run" --out "$back/plots" > /dev/null 2>&1
    [ "$rc" = 0 ] || tail -30 "$back/train_tail.log"
    return "$rc"
}
long_wait() {  # the long arm started last
    local run; run=$(cat /tmp/rl-long/current 2>/dev/null) || { echo "no long arm was started on this machine"; return 2; }
    wait_detached "$run" "$out/long/${run#/tmp/rl-long/}" ${LONG_WAIT_S:-540}
}
# the LoRA run: wait_detached, then what its report is made of, and the report (also of a run that stopped early)
lora_wait() {
    local run=/tmp/rl-lora/run back="$out/lora" rc
    [ -d $run ] || { echo "no LoRA run was started on this machine"; return 2; }
    wait_detached $run "$back" "$1"; rc=$?
    cp "$run/warmup.json" "$back/" 2>/dev/null
    tail -100 "$run/setup.log" > "$back/setup_tail.log" 2>/dev/null
    [ -f "$run/adapter/adapter_config.json" ] && mkdir -p "$back/adapter" && cp "$run/adapter/adapter_config.json" "$back/adapter/"
    if [ $rc != 3 ] && [ ! -f "$run/train.log" ]; then echo "the checkpoint or its warm-up failed:"; tail -20 "$run/setup.log"; fi
    # the adapter's weights stay here (only their header is read): $OUT/lora/rl_lora.json is the record
    [ $rc != 3 ] && [ -f "$run/metrics.jsonl" ] && python3 -m titan_rl_ext.tools.rl_lora_report "$run" --out "$back/rl_lora.json"
    return $rc
}

case $what in
setup|long_setup)
    t=$(date +%s); checkpoint || exit 1; echo "checkpoint + warm-up in $(( $(date +%s) - t )) s"
    python3 -c "from titan_rl_ext.compat import patch_torchtitan; patch_torchtitan(); import torchtitan.trainer; print('torchtitan imports')" 2>&1 | tail -2
    python3 -c "import vllm.entrypoints.openai.api_server; print('the vLLM OpenAI server imports')" 2>&1 | tail -2
    ;;
smoke|long_smoke|titan_bi|titan|native)
    config=rl_gpu_hybrid steps=${RL_STEPS:-40}
    if [ $what = smoke ]; then config=rl_gpu_hybrid_toy steps=${RL_STEPS:-6}
    elif [ $what = long_smoke ]; then config=rl_gpu_long_toy steps=${RL_STEPS:-3}
    else
        t=$(date +%s)
        wait_for_checkpoint || exit 1
        [ -n "${ARM_BUDGET:-}" ] && export ARM_TIMEOUT=$(( ARM_BUDGET - ($(date +%s) - t) ))
    fi
    read -ra arm <<< "$(arm_flags $what)"
    rm -rf "$out/$what" "/tmp/dump_$what"
    t=$(date +%s)
    timeout ${ARM_TIMEOUT:-570} python3 -m torch.distributed.run --standalone --nproc_per_node=1 -m titan_rl_ext.train \
        --module titan_rl_ext.configs --config $config --training.steps $steps \
        --rl.run-dir "$out/$what" --dump-folder "/tmp/dump_$what" "${arm[@]}" > "$out/$what.log" 2>&1
    rc=$?
    echo "$what rc=$rc in $(( $(date +%s) - t )) s"
    grep "RL step" "$out/$what.log" | sed -n '1,3p;$p' | cut -c60-
    [ $rc -eq 0 ] || { grep -v "^\[rank" "$out/$what.log" | tail -30; cp "$out/$what/server.log" "$out/${what}_server.log" 2>/dev/null; }
    python3 -m titan_rl_ext.tools.plot "$out/$what" > /dev/null 2>&1
    ;;
resume)
    t=$(date +%s)
    python3 tests/gpu/rl_window_resume.py "$out" > "$out/resume.log" 2>&1; rc=$?
    echo "resume rc=$rc in $(( $(date +%s) - t )) s"; tail -25 "$out/resume.log"
    # the device returns a handful of files: both runs' logs, metrics and rollouts travel as one archive
    tar -czf "$out/resume_runs.tar.gz" -C "$out" resume_a resume_b && rm -rf "$out/resume_a" "$out/resume_b"
    exit $rc
    ;;
ipc_arms)
    # each arm's own run (its server spawned with the transport's needs), one at a time: they share the GPU
    steps=${RL_STEPS:-8} rc=0
    for tr in ${IPC_ARMS:-cuda_ipc titan_ipc}; do
        run=/tmp/rl-ipc-arms/$tr back=$out/ipc_arms/$tr
        rm -rf "$run" "/tmp/dump_ipc_$tr" && mkdir -p "$run" "$back"
        t=$(date +%s)
        timeout ${ARM_TIMEOUT:-260} python3 -m torch.distributed.run --standalone --nproc_per_node=1 -m titan_rl_ext.train \
            --module titan_rl_ext.configs --config rl_gpu_hybrid_toy --training.steps $steps --rl.weight-transport $tr \
            --rl.run-dir "$run" --dump-folder "/tmp/dump_ipc_$tr" $(arm_flags smoke) > "$run/train.log" 2>&1
        r=$?; [ $r -eq 0 ] || rc=$r
        echo "ipc_arms $tr rc=$r in $(( $(date +%s) - t )) s"
        grep "RL step" "$run/train.log" | sed -n '1,2p;$p' | cut -c60-
        cp "$run/metrics.jsonl" "$back/" 2>/dev/null
        grep -v "^\[rank" "$run/train.log" | tail -200 > "$back/train_tail.log"
        tail -200 "$run/server.log" > "$back/server_tail.log" 2>/dev/null
        [ $r -eq 0 ] || tail -30 "$back/train_tail.log"
    done
    python3 - /tmp/rl-ipc-arms "$out/ipc_arms/summary.json" "$steps" <<'PY'
import json, os, sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
import torch
from titan_rl_ext.rl import metrics as M
from titan_rl_ext.tools.rl_arms import _nan_to_null, report_env, transport_summary
root, path, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
runs = {d.name: M.read_metrics(d) for d in sorted(root.iterdir()) if (d / M.METRICS_FILE).is_file()}
try:
    vllm_version = version("vllm")
except PackageNotFoundError:  # vLLM unpacked onto PYTHONPATH, no dist-info
    import vllm
    vllm_version = vllm.__version__
given = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "vllm": vllm_version,
         "recipe": "rl_gpu_hybrid_toy", "batch_invariant": True, "rl_steps": steps}
given.update({k: os.environ[v] for k, v in (("git", "TITAN_GIT"), ("git_tree", "TITAN_GIT_TREE")) if os.environ.get(v)})
summary = _nan_to_null(transport_summary(runs, report_env([], given)))
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text(json.dumps(summary, indent=1, allow_nan=False))
print(path)
print(json.dumps({k: v for k, v in summary.items() if k != "env"}, indent=1))
PY
    exit $rc
    ;;
long_titan_bi|long_titan|long_native)
    wait_for_checkpoint || exit 1
    a=${what#long_} window=${WINDOW:-4} r=${RUN:-1} steps=${RL_STEPS:-30}
    run=/tmp/rl-long/w$window/${a}_r$r
    rm -rf "$run" "/tmp/dump_long_$a" && mkdir -p "$run" && echo "$run" > /tmp/rl-long/current
    python3 - "$run/run_env.json" "$a" "$r" "$window" "$steps" <<'PY'
import json, os, subprocess, sys
from importlib.metadata import version
from pathlib import Path
import torch
from titan_rl_ext.configs.rl_long import long_rl_checkpoint
path, arm, run, window, steps = sys.argv[1:]
env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "vllm": version("vllm"), "recipe": "rl_gpu_long",
       "arm": arm, "run": int(run), "offpolicy": int(window), "rl_steps": int(steps),
       # each lease builds its own start: which warm-up this arm started from
       "warmup": json.loads((Path(long_rl_checkpoint()) / "warmup.json").read_text())}
for key, var, rev in (("git", "TITAN_GIT", "HEAD"), ("git_tree", "TITAN_GIT_TREE", "HEAD^{tree}")):
    found = subprocess.run(["git", "rev-parse", rev], capture_output=True, text=True)
    value = os.environ.get(var) or (found.stdout.strip() if found.returncode == 0 else "")
    if value:
        env[key] = value
open(path, "w").write(json.dumps(env, indent=1))
PY
    # the window's every version kept for the exact stale gap; setsid: the run outlives this command
    cmd=(python3 -m torch.distributed.run --standalone --nproc_per_node=1 -m titan_rl_ext.train
         --module titan_rl_ext.configs --config rl_gpu_long --training.steps "$steps" --rl.offpolicy "$window"
         --rl.stale-gap-versions $(( window + 1 )) --rl.run-dir "$run" --dump-folder "/tmp/dump_long_$a" $(arm_flags $a))
    setsid nohup bash -c "$(printf '%q ' "${cmd[@]}") > $run/train.log 2>&1; echo \$? > $run/rc" > /dev/null 2>&1 < /dev/null &
    echo "started $a (window $window, run $r, $steps steps) in $run"
    long_wait; exit $?
    ;;
long_wait)
    long_wait; exit $?
    ;;
lora)
    run=/tmp/rl-lora/run steps=${RL_STEPS:-30}
    if [ ! -f $run/rc ] && kill -0 "$(cat $run/pid 2>/dev/null)" 2>/dev/null; then
        echo "a LoRA run is still going in $run: lora_wait"; exit 3
    fi
    rm -rf $run /tmp/dump_lora && mkdir -p $run /tmp/rlcache
    # run_env.json: the GPU, versions, commit and the recipe's settings as the trainer will build them (after the
    # checkpoint: the recipe reads it); warmup.json: how the start checkpoint was made
    cat > "$run/run_env.py" <<'PY'
import json, os, shutil, subprocess, sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
import torch
from titan_rl_ext.configs.rl_lora import rl_lora_9b
run, steps = Path(sys.argv[1]), int(sys.argv[2])
cfg = rl_lora_9b()
rl, args = cfg.rl, list(cfg.rl.server_args)
try:
    vllm_version = version("vllm")
except PackageNotFoundError:  # vLLM unpacked onto PYTHONPATH, no dist-info
    import vllm
    vllm_version = vllm.__version__
env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "vllm": vllm_version, "recipe": "rl_lora_9b",
       "rl_steps": steps, "model_dir": rl.model_dir, "lora_rank": rl.lora_rank, "lora_alpha": rl.lora_alpha,
       "lora_targets": list(rl.lora_targets), "lr": cfg.optimizer.param_groups[0].optimizer_kwargs["lr"],
       "prompts_per_step": rl.prompts_per_step, "group_size": rl.group_size, "max_tokens": rl.max_tokens,
       "offpolicy": rl.offpolicy, "stale_gap_versions": rl.stale_gap_versions, "weight_transport": rl.weight_transport,
       "server_args": args}
if "--gpu-memory-utilization" in args:
    env["gpu_memory_utilization"] = float(args[args.index("--gpu-memory-utilization") + 1])
for key, var, rev in (("git", "TITAN_GIT", "HEAD"), ("git_tree", "TITAN_GIT_TREE", "HEAD^{tree}")):
    found = subprocess.run(["git", "rev-parse", rev], capture_output=True, text=True)
    value = os.environ.get(var) or (found.stdout.strip() if found.returncode == 0 else "")
    if value:
        env[key] = value
(run / "run_env.json").write_text(json.dumps(env, indent=1))
if (Path(rl.model_dir) / "warmup.json").is_file():  # the published checkpoint (QWEN3_5_9B_DIR) has none
    shutil.copy(Path(rl.model_dir) / "warmup.json", run / "warmup.json")
PY
    # a build cut short leaves a directory that lora_9b_checkpoint would take as done: without the marker, start over
    build="[ -f $ready ] || { rm -rf /tmp/rlcache/rl_lora_9b_init /tmp/rlcache/rl_lora_9b_*_lora; python3 -c \
'from titan_rl_ext.configs.$ckpt_mod import $ckpt_fn; print($ckpt_fn())' > $run/setup.log 2>&1 && touch $ready; }"
    cmd=(python3 -m torch.distributed.run --standalone --nproc_per_node=1 -m titan_rl_ext.train
         --module titan_rl_ext.configs --config rl_lora_9b --training.steps "$steps" --rl.run-dir "$run"
         --dump-folder /tmp/dump_lora --rl.export-adapter-dir "$run/adapter")
    # setsid: the run outlives this command; each part's failure ends the chain with its exit status in rc
    setsid nohup bash -c "$build && python3 $run/run_env.py $run $steps >> $run/setup.log 2>&1 \
&& $(printf '%q ' "${cmd[@]}") > $run/train.log 2>&1; echo \$? > $run/rc" > /dev/null 2>&1 < /dev/null &
    echo $! > $run/pid
    echo "started rl_lora_9b ($steps steps) in $run$([ -f $ready ] || echo ', after its checkpoint and warm-up')"
    lora_wait ${LORA_WAIT_S:-480}; exit $?
    ;;
lora_wait)
    lora_wait ${LORA_WAIT_S:-540}; exit $?
    ;;
report)
    arms=(); for a in native titan titan_bi; do [ -f "$out/$a/metrics.jsonl" ] && arms+=("$a=$out/$a"); done
    gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name())")
    python3 -m titan_rl_ext.tools.rl_arms "${arms[@]}" --out "$out" \
        --env "{\"git\": \"${TITAN_GIT:-$(git rev-parse HEAD 2>/dev/null)}\", \"gpu\": \"$gpu\", \"recipe\": \"rl_gpu_hybrid\"}"
    ;;
*) echo "unknown stage $what"; exit 2 ;;
esac
