#!/usr/bin/env bash
# Conversion time and peak memory: `strata convert` against `ctr-remote image convert
# --estargz --oci` on the same image (the Debian + python test image, one 81 MB layer), with
# the same settings (gzip level 9, 4 MiB chunks), both reading from local disk and writing to
# local disk, in one run. Prints a Markdown table, also written to target/convert-bench.md.
#
#   bash tests/run-all.sh      # once, on a fresh machine: containerd, the registry, image tools
#   bash benches/convert.sh    # STRATA_BENCH_RUNS=N runs per side (3)
#
# Uses the registry in STRATA_TEST_REGISTRY if set, else starts one on port 5071 with the test
# images. Needs root: it drops the page cache before each conversion.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
RUNS=${STRATA_BENCH_RUNS:-3}
command -v /usr/bin/time >/dev/null || { apt-get update -qq && apt-get install -y -qq time >/dev/null; }

WORK=$(mktemp -d /tmp/strata-convert-bench.XXXXXX)
CTD=$WORK/containerd
cleanup() {
  [[ -n ${CTD_PID:-} ]] && kill "$CTD_PID" 2>/dev/null && wait "$CTD_PID" 2>/dev/null || true
  [[ -n ${OWN_REGISTRY:-} ]] && bash tests/infra/registry.sh stop "$WORK/registry" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT

if [[ -z ${STRATA_TEST_REGISTRY:-} ]]; then
  OWN_REGISTRY=1
  REGISTRY_PORT=5071 bash tests/infra/registry.sh start "$WORK/registry"
  bash tests/infra/images.sh 127.0.0.1:5071 "$WORK/images"
  STRATA_TEST_REGISTRY=127.0.0.1:5071
fi
REG=$STRATA_TEST_REGISTRY
SRC=$REG/strata/python:1

cargo build --release --bin strata 2>&1 | tail -1
STRATA=$ROOT/target/release/strata

# Strata reads an OCI layout; ctr-remote reads containerd's content store. Both local.
skopeo copy -q --src-tls-verify=false "docker://$SRC" "oci:$WORK/src:1"
mkdir -p "$CTD"
cat >"$CTD/config.toml" <<TOML
version = 2
root = "$CTD/root"
state = "$CTD/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "$CTD/containerd.sock"
TOML
containerd --config "$CTD/config.toml" >"$CTD/log" 2>&1 &
CTD_PID=$!
REMOTE=(ctr-remote --address "$CTD/containerd.sock" -n bench)
remote() { "${REMOTE[@]}" "$@"; }
for _ in $(seq 100); do remote version >/dev/null 2>&1 && break; sleep 0.1; done
remote image pull --plain-http "$SRC" >/dev/null

quiet() { sync; echo 3 >/proc/sys/vm/drop_caches; }
# "seconds peak-RSS-KiB" of a command, from GNU time.
measure() { /usr/bin/time -f '%e %M' -o "$WORK/time" "$@" >/dev/null 2>"$WORK/err" || { cat "$WORK/err" >&2; exit 1; }; cat "$WORK/time"; }

rows=()
for run in $(seq "$RUNS"); do
  for side in strata ctr-remote; do
    quiet
    case $side in
      strata)
        read -r secs kib < <(measure "$STRATA" convert --compression-level 9 "oci:$WORK/src:1" "oci:$WORK/out-$run:esgz")
        rm -rf "$WORK/out-$run" ;;
      ctr-remote)
        read -r secs kib < <(measure "${REMOTE[@]}" image convert --oci --estargz --estargz-compression-level 9 "$SRC" "bench/python:esgz-$run")
        remote image rm --sync "bench/python:esgz-$run" >/dev/null ;;
    esac
    rows+=("$run $side $secs $kib")
    echo "run $run: $side ${secs}s, peak RSS $((kib / 1024)) MiB" >&2
  done
done

median() { sort -n | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }
col() { printf '%s\n' "${rows[@]}" | awk -v s="$1" -v c="$2" '$2 == s {print $c}' | median; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", a / b}'; }
st=$(col strata 3) sm=$(col strata 4) ct=$(col ctr-remote 3) cm=$(col ctr-remote 4)
{
  echo "| tool | time (median of $RUNS) | peak RSS (median) |"
  echo "| --- | --- | --- |"
  echo "| \`strata convert\` | ${st} s | $((sm / 1024)) MiB |"
  echo "| \`ctr-remote image convert --estargz\` | ${ct} s | $((cm / 1024)) MiB |"
  echo "| **ratio** (Strata ÷ ctr-remote) | **$(ratio "$st" "$ct")** | **$(ratio "$sm" "$cm")** |"
  echo
  echo "Cores: $(nproc). Per run: $(printf '%s; ' "${rows[@]}")"
} | tee "$ROOT/target/convert-bench.md"
