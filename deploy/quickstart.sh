#!/usr/bin/env bash
# Builds strata and runs the node agent in the foreground on its embedded defaults:
#   cold store   /var/lib/strata/cold   (a local directory; objects are files under it)
#   hot tier     /var/lib/strata/hot    (10 GiB)
#   warm tier    /var/lib/strata/warm   (50 GiB)
#   admin socket /run/strata/admin.sock (mode 0600; `strata tier ...` talks to it)
#   metrics      http://127.0.0.1:9464/metrics
# /etc/strata/config.toml, when present, overrides these (see docs/CONFIG.md).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo >/dev/null || { echo "cargo not found: install the Rust toolchain (rustup) first" >&2; exit 1; }
# The build generates containerd's Snapshots API with protoc.
if ! command -v protoc >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends protobuf-compiler >/dev/null
fi
cargo build --release --locked --bin strata
install -m 0755 target/release/strata /usr/local/bin/strata
mkdir -p /var/lib/strata/cold
cat <<'MSG'
strata is starting in the foreground (Ctrl-C stops it). In another shell:
  mkdir -p /var/lib/strata/cold/datasets && cp some-file /var/lib/strata/cold/datasets/
  strata tier warmup datasets/
  strata tier status
MSG
exec /usr/local/bin/strata daemon
