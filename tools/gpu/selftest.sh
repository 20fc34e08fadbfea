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
#               memory, in the same run (bar: 0.80);
#   rpc_bench   (on a host of 8 or more CPUs, GPU or not) the rpc bench's round
#               trips with the server on cores 0-6 and --spin-us 1000, the other
#               cores left to the clients: its bars (two round trips within 2.4x
#               a bare libzmq echo) need a host where a hand-off between threads
#               is cheap, which a 2-CPU machine is not. Bars print PASS/ABOVE;
#               the step fails only if a request goes unanswered. Then its
#               saturation section (8 lookup clients, a 1 GiB store, /status
#               polled; same server flags);
#   front_bench (same hosts) the front's CPU per request on this host's
#               cores, beside the chained chunk hashing every fresh request
#               needs (the part of the store's round trip no server avoids).
# Each step has a time limit; the exit status is non-zero if any step failed.
#
# Usage: tools/gpu/selftest.sh [DIR]   (default .gpu)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
DIR="$(cd "${1:-.gpu}" && pwd)"
export KVSHARD_BIN="$DIR/kvshard"
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
cpus=$(nproc)
if [ "$cpus" -ge 8 ] && [ -x "$DIR/rpc_bench" ]; then
    step rpc_bench 180 env KVSHARD_BENCH_CORES=0-6 KVSHARD_BENCH_SPIN_US=1000 \
        "$DIR/rpc_bench" --bench round_trips
    step rpc_saturation 90 env KVSHARD_BENCH_CORES=0-6 KVSHARD_BENCH_SPIN_US=1000 \
        "$DIR/rpc_bench" --bench saturation
else
    echo "=== rpc_bench: skipped ($cpus CPUs, or no $DIR/rpc_bench)"
fi
if [ "$cpus" -ge 8 ] && [ -x "$DIR/front_bench" ]; then
    step front_bench 90 taskset -c 7 "$DIR/front_bench" --bench
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv
    export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1 | tail -1
    step gpu_golden 90 "$DIR/gpu_golden" --nocapture --test-threads 1
    step cuda_gpu 240 "$DIR/cuda_gpu" --nocapture --test-threads 1
    step gpu_workers 120 "$DIR/gpu_workers" --test-threads 2
    step gpu_bench 100 "$DIR/gpu_bench" --bench
else
    echo "gpu selftest: no GPU on this host (nvidia-smi is missing or lists no device); GPU steps not run"
fi
if [ "$failed" -ne 0 ]; then
    # The end-to-end tests keep their server logs where a test failed.
    for f in "${TMPDIR:-/tmp}"/cuda-gpu-*/server.log; do
        [ -f "$f" ] && { echo "--- $f"; tail -40 "$f"; }
    done
fi
echo "gpu selftest: $failed step(s) failed"
[ "$failed" -eq 0 ]
