#!/usr/bin/env bash
# Shows that the simulation finds reverted fixes (BENCHMARKS.md, the seeds-to-find tables):
# applies each patch of scripts/sim-reverts/ alone (a fix reverted, or a mutation of the
# holder), builds the simulator, runs seeds 1..N until the first violation, and reverts the
# patch. Prints one line per patch: the first seed found and what it saw, or "not found".
#
#   scripts/sim-reverts.sh [SEEDS] [PATCH...]     (SEEDS defaults to 200; all patches by default)
#
# A patch may begin with header lines (git apply skips them): `Run: ARGS` runs the simulator
# with ARGS instead of `--seeds SEEDS --first` (a bug found only by a later seed, or only by a
# regression seed), and `Finds: KIND` looks for that kind among the known findings too (a kind
# the checker reports as known on main's code, such as `lease_id_regranted_untold`).
# The patched files must be unmodified; the tree is put back as it was, also on Ctrl-C.
# The suite checks that every patch still applies (sim/tests/seeds.rs).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

seeds="${1:-200}"
shift || true
patches=("$@")
if [ ${#patches[@]} -eq 0 ]; then
  patches=(scripts/sim-reverts/*.patch)
fi

applied=""
restore() {
  if [ -n "$applied" ]; then
    git apply -R "$applied"
    applied=""
  fi
}
trap restore EXIT INT TERM

for p in "${patches[@]}"; do
  name="$(basename "$p" .patch)"
  git apply --check "$p" || { echo "$name: does not apply to this tree" >&2; exit 1; }
  git apply "$p"
  applied="$p"
  cargo build --quiet --release --locked -p leasehold-sim 2>/dev/null
  run="$(sed -n 's/^Run: //p' "$p" | head -1)"
  kind="$(sed -n 's/^Finds: //p' "$p" | head -1)"
  args=(${run:---seeds $seeds --first})
  out="$(./target/release/leasehold-sim "${args[@]}" 2>&1 || true)"
  if [ -n "$kind" ]; then
    found="$(grep -m1 -E "^(VIOLATION|known finding,) .*: $kind on" <<<"$out" || true)"
  else
    found="$(grep -m1 '^VIOLATION' <<<"$out" || true)"
  fi
  restore
  if [ -n "$found" ]; then
    echo "$name ($(echo "${args[@]}")): ${found#VIOLATION }"
  else
    echo "$name ($(echo "${args[@]}")): not found"
  fi
done
cargo build --quiet --release --locked -p leasehold-sim
