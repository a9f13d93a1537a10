#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what the tests need (DynamoDB Local,
# cargo-lambda, SAM CLI, cfn-lint, moto, schemathesis into .tools/), then runs every test.
# Tests start and stop their own servers (DynamoDB Local, the Lambda emulator, moto).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

"$root/scripts/install-test-deps.sh"
export PATH="$root/.tools/venv/bin:$PATH"
export LEASEHOLD_TOOLS="$root/.tools"

echo "== build"
cargo build --workspace --all-targets --locked

echo "== tests"
cargo test --workspace --locked --no-fail-fast -- --test-threads "${LEASEHOLD_TEST_THREADS:-8}"
