#!/usr/bin/env bash
# The dependency audit, offline: Cargo.lock against the RustSec advisory database snapshot
# kept beside the project (../shared/advisory-db, or $LEASEHOLD_ADVISORY_DB). Any advisory
# (vulnerability, unsound, unmaintained, yanked crate) fails, and cargo-audit names the crate
# and the advisory. --stale: the snapshot is old by design; nothing is fetched.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
db="${LEASEHOLD_ADVISORY_DB:-$root/../shared/advisory-db}"
audit="$root/.tools/venv/bin/cargo-audit"
[ -x "$audit" ] || audit="$(command -v cargo-audit || true)"
if [ -z "$audit" ]; then
  echo "audit: cargo-audit is not installed: run scripts/install-test-deps.sh" >&2
  exit 1
fi
if [ ! -d "$db" ]; then
  echo "audit: no advisory database at $db (set LEASEHOLD_ADVISORY_DB)" >&2
  exit 1
fi
[ -f "$db/SNAPSHOT" ] && echo "audit: $(head -n1 "$db/SNAPSHOT")"
exec "$audit" audit --no-fetch --stale --db "$db" --deny warnings --file "$root/Cargo.lock"
