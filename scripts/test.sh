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

echo "== dependency audit (offline)"
"$root/scripts/audit.sh"

echo "== build"
cargo build --workspace --all-targets --locked

echo "== tests"
log="$(mktemp)"
set +e
cargo test --workspace --locked --no-fail-fast -- --test-threads "${LEASEHOLD_TEST_THREADS:-8}" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
# One closing line for the whole suite (cargo prints one per test binary).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i; if ($(i+1) ~ /^ignored/) s += $i } }
     END { printf "tests: %d passed, %d failed, %d skipped\n", p, f, s }' "$log"
rm -f "$log"
exit "$status"
