#!/usr/bin/env bash
# Cold-start benchmark of the three Lambda functions (a benchmark, not a test: it prints
# figures against targets and asserts nothing).
#
# Builds the functions in release mode, then runs scripts/bench_cold_start.py (what it
# measures and against which targets is described there).
#
# Usage: scripts/bench-cold-start.sh [RUNS] [OTHER_BIN_DIR ...]   (default 10; RUNS=... also works)
# OTHER_BIN_DIRs hold the function binaries of other builds (copies of target/release/{acquire,
# heartbeat,release}, e.g. of the commit before a change): each run then starts this build and
# those in turn, alternating the order, and the table has a row per build (1 = this one).
# Other build settings through cargo's own environment, in a separate target directory, e.g.
#   CARGO_TARGET_DIR=target/lambda-size CARGO_PROFILE_RELEASE_OPT_LEVEL=s \
#   CARGO_PROFILE_RELEASE_LTO=fat CARGO_PROFILE_RELEASE_CODEGEN_UNITS=1 scripts/bench-cold-start.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
runs="${1:-${RUNS:-10}}"
shift || true
cd "$root"

echo "== cargo build --release -p acquire -p heartbeat -p release -p leasehold-cli" >&2
cargo build --release -p acquire -p heartbeat -p release -p leasehold-cli >&2

py="$root/.tools/venv/bin/python"
[ -x "$py" ] || py="$(command -v python3)"

bin_dir="${CARGO_TARGET_DIR:-$root/target}/release"
case "$bin_dir" in /*) ;; *) bin_dir="$root/$bin_dir" ;; esac

exec "$py" "$root/scripts/bench_cold_start.py" "$root" "$runs" "$bin_dir" "$@"
