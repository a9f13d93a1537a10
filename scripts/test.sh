#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what the tests need (DynamoDB Local,
# cargo-lambda, SAM CLI, cfn-lint, moto, schemathesis, cargo-audit into .tools/), checks
# formatting, lints and the lockfile against the RustSec snapshot, then runs every test.
# Tests start and stop their own servers (DynamoDB Local, the Lambda emulator, moto).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

"$root/scripts/install-test-deps.sh"
export PATH="$root/.tools/venv/bin:$PATH"
export LEASEHOLD_TOOLS="$root/.tools"

echo "== format"
cargo fmt --all --check

echo "== lints"
cargo clippy --workspace --all-targets --locked -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc -p leasehold --no-deps --locked

echo "== dependency audit (offline)"
"$root/scripts/audit.sh"

echo "== build"
cargo build --workspace --all-targets --locked

echo "== tests"
log="$(mktemp)"
# Anything a test started from this tree and left running (a server whose test panicked) is
# stopped when the tests end: it would otherwise keep this script's output open.
leftovers() {
  pkill -TERM -f "$root/target/" 2>/dev/null || true
  pkill -TERM -f "$root/.tools/" 2>/dev/null || true
}
trap leftovers EXIT
set +e
# The output goes to the terminal and the log through a process substitution, so the script
# waits for cargo only, not for whatever might still hold the pipe.
cargo test --workspace --locked --no-fail-fast -- --test-threads "${LEASEHOLD_TEST_THREADS:-8}" > >(tee "$log") 2>&1
status=$?
set -e
leftovers
sleep 0.5
# One closing line for the whole suite (cargo prints one per test binary).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i; if ($(i+1) ~ /^ignored/) s += $i } }
     END { printf "tests: %d passed, %d failed, %d skipped\n", p, f, s }' "$log"
rm -f "$log"
exit "$status"
