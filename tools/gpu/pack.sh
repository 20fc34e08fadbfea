#!/usr/bin/env bash
# Builds kvshard's GPU checks, and the rpc and front benches for the host's many
# cores, as release executables and copies them, stripped, into one folder
# (default .gpu/, ignored by git), for a GPU host that has the NVIDIA driver but no Rust
# toolchain. Run tools/gpu/selftest.sh there on it.
#
# Usage: tools/gpu/pack.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR="${1:-.gpu}"
mkdir -p "$DIR"

# The path of the one executable cargo reports for a target of the given kind.
exe_of() { # KIND NAME, cargo's JSON messages on stdin
    python3 -c '
import json, sys
kind, name = sys.argv[1], sys.argv[2]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and m.get("executable") \
            and t.get("name") == name and kind in t.get("kind", []):
        print(m["executable"])
' "$1" "$2"
}

cargo build --release --bin kvshard
root="${CARGO_TARGET_DIR:-target}"
cp "$root/release/kvshard" "$DIR/kvshard"
json=$(cargo test --release --no-run --test cuda_gpu --message-format=json 2>/dev/null)
cp "$(exe_of test cuda_gpu <<<"$json" | tail -1)" "$DIR/cuda_gpu"
json=$(cargo test --release --no-run --test gpu_workers --message-format=json 2>/dev/null)
cp "$(exe_of test gpu_workers <<<"$json" | tail -1)" "$DIR/gpu_workers"
json=$(cargo test --release --no-run -p kvshard-gds --test gpu_golden --message-format=json 2>/dev/null)
cp "$(exe_of test gpu_golden <<<"$json" | tail -1)" "$DIR/gpu_golden"
json=$(cargo bench --no-run -p kvshard-gds --bench gpu --message-format=json 2>/dev/null)
cp "$(exe_of bench gpu <<<"$json" | tail -1)" "$DIR/gpu_bench"
json=$(cargo bench --no-run --bench rpc --message-format=json 2>/dev/null)
cp "$(exe_of bench rpc <<<"$json" | tail -1)" "$DIR/rpc_bench"
json=$(cargo bench --no-run --bench front --message-format=json 2>/dev/null)
cp "$(exe_of bench front <<<"$json" | tail -1)" "$DIR/front_bench"
chmod u+w "$DIR"/*
strip "$DIR"/kvshard "$DIR"/cuda_gpu "$DIR"/gpu_workers "$DIR"/gpu_golden "$DIR"/gpu_bench "$DIR"/rpc_bench \
    "$DIR"/front_bench
ls -la "$DIR"
