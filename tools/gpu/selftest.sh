#!/usr/bin/env bash
# kvshard's own GPU checks, from executables built by tools/gpu/pack.sh:
#   gpu_golden  the NVRTC kernel on this GPU against lmcache 0.5.6's gathered
#               bytes for 9 KV layouts, and scatter round trips;
#   cuda_gpu    the real server with --cuda-transfer on against CUDA workers
#               (driver-API cuda_raw workers; a torch `cuda` worker where
#               python3 has a CUDA-enabled torch): NHD, HND, MLA, TP 2, skips,
#               and a CPU worker reading the GPU workers' chunks;
#   gpu_workers registrations the server refuses on a GPU host (a GPU it does
#               not see, --cuda-transfer off), answered and reported;
#   gpu_bench   gather/scatter bandwidth against cuMemcpy D2H/H2D into pinned
#               memory, in the same run (bar: 0.80).
# Each step has a time limit; the exit status is non-zero if any step failed.
#
# Usage: tools/gpu/selftest.sh [DIR]   (default .gpu)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
DIR="$(cd "${1:-.gpu}" && pwd)"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu selftest: no GPU on this host (nvidia-smi is missing or lists no device); nothing to run"
    exit 0
fi
nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export KVSHARD_BIN="$DIR/kvshard"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1 | tail -1
failed=0
step() { # NAME LIMIT_S CMD...
    local name="$1" limit="$2"; shift 2
    echo "=== $name"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    echo "=== $name: rc $rc in $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}
step gpu_golden 90 "$DIR/gpu_golden" --nocapture --test-threads 1
step cuda_gpu 150 "$DIR/cuda_gpu" --nocapture --test-threads 1
step gpu_workers 120 "$DIR/gpu_workers" --test-threads 2
step gpu_bench 100 "$DIR/gpu_bench" --bench
if [ "$failed" -ne 0 ]; then
    # The end-to-end tests keep their server logs where a test failed.
    for f in "${TMPDIR:-/tmp}"/cuda-gpu-*/server.log; do
        [ -f "$f" ] && { echo "--- $f"; tail -40 "$f"; }
    done
fi
echo "gpu selftest: $failed step(s) failed"
[ "$failed" -eq 0 ]
