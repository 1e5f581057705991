#!/usr/bin/env bash
# The README's test command with the CPUs kept busy, as a developer runs it before submitting
# (docs/reliability.md "Under load"): `stress-ng --cpu N` (4 by default: twice the cores of a
# 2-core CI machine) runs beside pytest and is stopped when this script ends, however it ends.
# stress-ng is installed (apt-get) when it is missing and this runs as root.
#
#   bench/under_load.sh [--cpu N] [--runs K] [PYTEST ARGS...]
#     (default: the whole suite once; e.g. --runs 5 tests/test_sessions.py -k hung_up)
set -euo pipefail
cd "$(dirname "$0")/.."

cpu=4 runs=1
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) cpu=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    *) break ;;
  esac
done

if ! command -v stress-ng >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends stress-ng >/dev/null
  else
    echo "under_load.sh: stress-ng is not installed (sudo apt-get install stress-ng)" >&2
    exit 1
  fi
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]'
fi

stress-ng --cpu "$cpu" --timeout 0 >/dev/null 2>&1 &
stress=$!
tests=
stop_all() {
  [ -n "$tests" ] && kill "$tests" 2>/dev/null
  kill "$stress" 2>/dev/null
  wait 2>/dev/null || true
}
trap stop_all EXIT
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM

passed=0
for i in $(seq 1 "$runs"); do
  start=$(date +%s)
  rc=0
  .venv/bin/python -m pytest -q "$@" &  # waited for with `wait`, which a signal interrupts
  tests=$!
  wait "$tests" || rc=$?
  tests=
  [ "$rc" = 0 ] && passed=$((passed + 1))
  echo "under_load.sh: run $i of $runs beside stress-ng --cpu $cpu: exit $rc after $(($(date +%s) - start)) s" \
       "(load average $(cut -d' ' -f1-3 /proc/loadavg))"
done
echo "under_load.sh: $passed of $runs runs passed"
[ "$passed" = "$runs" ]
