# Sourced by the GPU stage scripts: Triton's autotuning results survive from one lease to the next.
#
# A fresh lease autotunes every autotuned Triton kernel again -- fla's chunk kernels try dozens of configurations,
# each compiled -- which is most of the BI arm's first step (docs/gpu_runs.md §9, "The RL loop on the GPU"). The
# whole Triton cache (tens of MB gzipped) is too large to carry or return, but the autotuner's results are small JSON files
# (`<hash>/<kernel>.autotune.json`, keyed by Triton's version, the GPU and the kernel source: a file that does not
# match is simply not found). With them, each kernel compiles its chosen configuration only.
#
#   triton_autotune_restore   copy tests/gpu/triton-autotune/ into $TRITON_CACHE_DIR (before the run)
#   triton_autotune_save OUT  write OUT/triton-autotune.tar.gz with every *.autotune.json of the cache (after);
#                             unpack it into tests/gpu/triton-autotune/ here and commit, for the next lease
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache} TRITON_CACHE_AUTOTUNING=1
_autotune_src="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/triton-autotune"

triton_autotune_restore() {
    mkdir -p "$TRITON_CACHE_DIR"
    [ -d "$_autotune_src" ] || return 0
    cp -rn "$_autotune_src"/. "$TRITON_CACHE_DIR"/ 2>/dev/null
    echo "triton autotune results: $(find "$_autotune_src" -name '*.autotune.json' | wc -l) files from tests/gpu/triton-autotune"
}

triton_autotune_save() {
    local out=${1:?OUT}
    (cd "$TRITON_CACHE_DIR" 2>/dev/null && find . -name '*.autotune.json' | tar -czf "$out/triton-autotune.tar.gz" -T - 2>/dev/null)
}
