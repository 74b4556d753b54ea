#!/usr/bin/env bash
# A docker-registry (distribution) on loopback, for the snapshotter's end-to-end tests.
#   registry.sh start DIR   # wipe DIR, serve 127.0.0.1:$REGISTRY_PORT from it, log to DIR/registry.log
#   registry.sh stop DIR    # stop it, remove DIR
# Env: REGISTRY_PORT (default 5000).
set -euo pipefail

CMD=${1:-}; DIR=${2:-}
[[ $CMD == start || $CMD == stop ]] && [[ -n $DIR ]] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }
DIR=$(realpath -m -- "$DIR")
PORT=${REGISTRY_PORT:-5000}
[[ $PORT =~ ^[0-9]+$ ]] || { echo "REGISTRY_PORT must be a number" >&2; exit 2; }

if [[ $CMD == stop ]]; then
  if [[ -f $DIR/pid ]]; then
    pid=$(cat "$DIR/pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -rf -- "$DIR"
  exit 0
fi

rm -rf -- "$DIR"; mkdir -p "$DIR/data"
# Our own config: the packaged one turns on htpasswd and listens on every interface.
cat >"$DIR/config.yml" <<YAML
version: 0.1
log: {level: info, accesslog: {disabled: false}}
storage: {filesystem: {rootdirectory: $DIR/data}, delete: {enabled: true}}
http: {addr: 127.0.0.1:$PORT}
YAML
setsid docker-registry serve "$DIR/config.yml" >"$DIR/registry.log" 2>&1 </dev/null &
echo $! >"$DIR/pid"
for _ in $(seq 100); do
  if curl -fsS "http://127.0.0.1:$PORT/v2/" >/dev/null 2>&1; then
    echo "registry: serving 127.0.0.1:$PORT from $DIR" >&2
    exit 0
  fi
  kill -0 "$(cat "$DIR/pid")" 2>/dev/null || break
  sleep 0.1
done
echo "registry: did not start; its log:" >&2
cat "$DIR/registry.log" >&2
exit 1
