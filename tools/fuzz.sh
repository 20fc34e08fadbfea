#!/usr/bin/env bash
# Runs the fuzz targets of fuzz/ for SECONDS each, one after the other:
#
#   tools/fuzz.sh SECONDS [TARGET...]      (default: every target)
#
# Each target starts from its seeds (fuzz/corpus/<target>, written by
# fuzz/make-corpus.py) plus what earlier runs here added (fuzz/scratch/<target>,
# not committed). An input that takes over 10 s counts as a hang. Per target it
# prints libFuzzer's executions per second and coverage (the `cov:` edge count
# of its last status line); it exits non-zero if any target crashed, hung or ran
# out of memory, naming the input it kept under fuzz/artifacts/<target>/.
#
# With a nightly toolchain (`cargo +nightly`) the targets are built with
# AddressSanitizer. Without one they are built by the default toolchain with
# the same coverage instrumentation and no sanitizer (`cargo fuzz -s none`):
# panics, failed debug assertions, overflows, hangs and running out of memory
# are still found, memory errors in unsafe code may not be. KVSHARD_FUZZ_SANITIZER
# (address or none) overrides the choice. Installs cargo-fuzz
# (`cargo install cargo-fuzz --locked`) if it is missing.
set -euo pipefail

usage() { echo "usage: tools/fuzz.sh SECONDS [TARGET...]" >&2; exit 2; }
[[ $# -ge 1 && "$1" =~ ^[1-9][0-9]*$ ]] || usage
seconds=$1
shift

cd "$(dirname "$0")/.."

if cargo +nightly --version >/dev/null 2>&1; then
    toolchain=(+nightly)
    sanitizer=${KVSHARD_FUZZ_SANITIZER:-address}
else
    toolchain=()
    sanitizer=${KVSHARD_FUZZ_SANITIZER:-none}
    if [[ $sanitizer != none ]]; then
        echo "fuzz: -s $sanitizer needs a nightly toolchain, and cargo +nightly fails" >&2
        exit 2
    fi
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz: installing cargo-fuzz" >&2
    cargo install cargo-fuzz --locked >&2
fi
fuzz=(cargo "${toolchain[@]}" fuzz)
echo "fuzz: $(cargo "${toolchain[@]}" --version), sanitizer: $sanitizer" >&2

if [[ $# -gt 0 ]]; then
    targets=("$@")
else
    mapfile -t targets < <("${fuzz[@]}" list)
fi

# One build of every target (one cargo invocation); `cargo fuzz run` below
# then finds it up to date.
"${fuzz[@]}" build -s "$sanitizer" >&2

# `cov: EDGES ft: FEATURES` of the last libFuzzer status line of kind $2 in log $1.
status_cov() {
    sed -n -E "s/^#[0-9]+[[:space:]]+$2[[:space:]]+cov: ([0-9]+) ft: ([0-9]+).*/\\1 \\2/p" "$1" | tail -n 1
}

logs=fuzz/target/fuzz-logs
mkdir -p "$logs"
failed=()
summary=()
for t in "${targets[@]}"; do
    [[ -d "fuzz/corpus/$t" ]] || { echo "fuzz: no seeds for $t (run fuzz/make-corpus.py)" >&2; exit 2; }
    mkdir -p "fuzz/scratch/$t"
    log="$logs/$t.log"
    echo "fuzz: $t for ${seconds}s" >&2
    status=0
    # New inputs go to the first directory (scratch); the seeds stay as committed.
    "${fuzz[@]}" run -s "$sanitizer" "$t" "fuzz/scratch/$t" "fuzz/corpus/$t" -- \
        -max_total_time="$seconds" -timeout=10 -print_final_stats=1 \
        >"$log" 2>&1 || status=$?
    # libFuzzer's final stats, and `cov:` (edges) and `ft:` (features) of its
    # status lines: after the seeds (INITED) and the last one.
    execs_per_s=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
    read -r cov ft < <(status_cov "$log" '[A-Z]+'; echo) || true
    read -r seed_cov _ < <(status_cov "$log" INITED; echo) || true
    line="$t: ${execs_per_s:-?} execs/s, ${runs:-?} runs, coverage ${cov:-?} edges (${seed_cov:-?} at the start), ${ft:-?} features"
    if [[ $status -ne 0 ]]; then
        kind=$( (grep -oE 'ERROR: libFuzzer: [a-z-]+|panicked at [^ ]+:[0-9]+:[0-9]+|ERROR: AddressSanitizer: [a-z-]+' "$log" || true) | head -n 1)
        artifact=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -n 1)
        line="$line; FAILED (exit $status): ${kind:-see $log}${artifact:+; input $artifact}"
        failed+=("$t")
    fi
    echo "fuzz: $line" >&2
    summary+=("$line")
done

echo "fuzz summary (${seconds}s per target; logs in $logs):"
printf '  %s\n' "${summary[@]}"
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "fuzz: failed: ${failed[*]}; reproduce with: ${fuzz[*]} run -s $sanitizer TARGET fuzz/artifacts/TARGET/INPUT"
    exit 1
fi
