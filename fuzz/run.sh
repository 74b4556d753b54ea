#!/usr/bin/env bash
# Builds and runs Strata's fuzz targets: cargo-fuzz with libFuzzer, on stable Rust, with no
# sanitizer (Rust's own checks and the targets' assertions are what fail).
#
#   bash fuzz/run.sh list                       the targets
#   bash fuzz/run.sh build                      builds every target, refusing a stale Cargo.lock
#   bash fuzz/run.sh replay [TARGET...]         runs each committed seed once: deterministic
#   bash fuzz/run.sh explore SECONDS [TARGET...]  random fuzzing, SECONDS per target, FUZZ_JOBS at once
#   bash fuzz/run.sh reproduce TARGET BASE64    runs one input, as a failed run printed it
#
# A failure prints the input in base64 and the reproduce command for it. New inputs that
# explore finds go to fuzz/corpus/TARGET (not committed); crashes to fuzz/artifacts/TARGET.
set -euo pipefail
FUZZ=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$FUZZ")
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}/fuzz
BIN_DIR=$TARGET_DIR/x86_64-unknown-linux-gnu/release

targets() { sed -n 's/^name = "\(.*\)"$/\1/p' "$FUZZ/Cargo.toml" | grep -v '^strata-fuzz$'; }

die() { echo "fuzz/run.sh: $*" >&2; exit 2; }

check_target() {
  targets | grep -qx "$1" || die "no target named '$1' (targets: $(targets | tr '\n' ' '))"
}

build() {
  command -v cargo-fuzz >/dev/null || die "cargo-fuzz is not installed: cargo install cargo-fuzz --locked --version 0.13.2"
  # cargo fuzz has no --locked of its own: the same resolution under --locked fails here, before
  # the build, if Cargo.lock does not match Cargo.toml, instead of the build rewriting it.
  (cd "$FUZZ" && cargo metadata --locked --format-version 1 >/dev/null) ||
    die "fuzz/Cargo.lock is stale: run 'cargo update -w' in fuzz/ and commit it"
  # Many codegen units: the targets link the whole daemon's crates, and one unit per crate
  # (cargo fuzz's default) makes that build take several times longer on two cores.
  (cd "$FUZZ" && cargo fuzz build --sanitizer none --codegen-units 16 --target-dir "$TARGET_DIR")
}

# Prints what to run to replay input FILE of TARGET, and the input itself.
report() {
  local target=$1 file=$2
  echo "FUZZ FAILURE: target $target, input of $(wc -c <"$file") bytes:"
  echo "  bash fuzz/run.sh reproduce $target $(base64 -w0 "$file")"
}

replay() {
  local failed=0 target seed count
  for target in "$@"; do
    count=0
    for seed in "$FUZZ/seeds/$target"/*; do
      [[ -f $seed ]] || continue
      count=$((count + 1))
      if ! "$BIN_DIR/$target" "$seed" >"$TARGET_DIR/replay.log" 2>&1; then
        tail -n 30 "$TARGET_DIR/replay.log"
        report "$target" "$seed"
        failed=1
      fi
    done
    # A target without seeds would replay nothing and pass: that is a missing seed, not a pass.
    if [[ $count -eq 0 ]]; then
      echo "target $target has no seeds in fuzz/seeds/$target" >&2
      failed=1
    else
      echo "replayed $count seeds of $target"
    fi
  done
  return $failed
}

# Fuzzes TARGET for SECONDS; its log goes to LOG.
explore_one() {
  local target=$1 seconds=$2 log=$3 artifacts=$FUZZ/artifacts/$1
  mkdir -p "$FUZZ/corpus/$target" "$artifacts"
  rm -f "$artifacts"/*
  # -timeout: an input that takes 25 s is a hang of a parser, and fails as a crash does.
  if "$BIN_DIR/$target" -max_total_time="$seconds" -timeout=25 -print_final_stats=1 \
    -artifact_prefix="$artifacts/" "$FUZZ/corpus/$target" "$FUZZ/seeds/$target" >"$log" 2>&1; then
    echo "$target: $(grep -m1 -E '^stat::number_of_executed_units' "$log" | awk '{print $2}') executions in ${seconds}s, no failure"
    return 0
  fi
  tail -n 40 "$log"
  local found=0 f
  for f in "$artifacts"/*; do
    [[ -f $f ]] || continue
    report "$target" "$f"
    found=1
  done
  [[ $found -eq 1 ]] || echo "FUZZ FAILURE: target $target failed without an input (see above)"
  return 1
}

explore() {
  local seconds=$1; shift
  [[ $seconds =~ ^[0-9]+$ ]] || die "explore takes a whole number of seconds, not '$seconds'"
  local jobs=${FUZZ_JOBS:-$(nproc)} failed=0 target pids=() names=() logs=() i
  for target in "$@"; do
    local log
    log=$(mktemp "$TARGET_DIR/explore-$target.XXXXXX.log")
    explore_one "$target" "$seconds" "$log" >"$log.out" 2>&1 &
    pids+=("$!") names+=("$target") logs+=("$log")
    if [[ ${#pids[@]} -ge $jobs ]]; then
      wait "${pids[0]}" || failed=1
      cat "${logs[0]}.out"; rm -f "${logs[0]}" "${logs[0]}.out"
      pids=("${pids[@]:1}") names=("${names[@]:1}") logs=("${logs[@]:1}")
    fi
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || failed=1
    cat "${logs[$i]}.out"; rm -f "${logs[$i]}" "${logs[$i]}.out"
  done
  return $failed
}

cmd=${1:-}; shift || true
case $cmd in
  list) targets ;;
  build) build ;;
  replay|explore)
    [[ $cmd == explore ]] && { [[ $# -ge 1 ]] || die "usage: explore SECONDS [TARGET...]"; seconds=$1; shift; }
    for t in "$@"; do check_target "$t"; done
    [[ $# -gt 0 ]] || set -- $(targets)
    mkdir -p "$TARGET_DIR"
    for t in "$@"; do [[ -x $BIN_DIR/$t ]] || die "target $t is not built: bash fuzz/run.sh build"; done
    if [[ $cmd == replay ]]; then replay "$@"; else explore "$seconds" "$@"; fi
    ;;
  reproduce)
    [[ $# -eq 2 ]] || die "usage: reproduce TARGET BASE64"
    check_target "$1"
    [[ -x $BIN_DIR/$1 ]] || build
    input=$(mktemp)
    trap 'rm -f "$input"' EXIT
    base64 -d <<<"$2" >"$input" || die "the input is not base64"
    "$BIN_DIR/$1" "$input"
    ;;
  *) die "usage: list | build | replay [TARGET...] | explore SECONDS [TARGET...] | reproduce TARGET BASE64" ;;
esac
