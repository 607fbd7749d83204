#!/usr/bin/env bash
# The cores each test keeps busy: runs the chosen tests one at a time and
# prints, per test, its wall time and (user + sys) / wall of its whole
# process tree. A test at one core or less is registered with CORES 1
# (tests/CMakeLists.txt, concord_pytest): ctest -j then runs another test
# beside it instead of leaving a core idle.
#
#   ./scripts/test_cores.sh [BUILD_DIR] [CTEST -R REGEX]
#   e.g. ./scripts/test_cores.sh build '^(netfault|deploy)_'
set -euo pipefail
build=${1:-build}
regex=${2:-.}
printf '%-45s %8s %6s %s\n' test wall_s cores result
ctest --test-dir "$build" -N -R "$regex" | awk '/Test +#/{print $3}' |
  while read -r t; do
    times=$(mktemp)
    if /usr/bin/time -f '%e %U %S' -o "$times" \
      ctest --test-dir "$build" -R "^${t}\$" --timeout 600 >/dev/null 2>&1; then
      result=passed
    else
      result=FAILED
    fi
    read -r wall user sys <"$times"
    rm -f "$times"
    awk -v t="$t" -v w="$wall" -v u="$user" -v s="$sys" -v r="$result" \
      'BEGIN { printf "%-45s %8.1f %6.2f %s\n", t, w, (w > 0 ? (u + s) / w : 0), r }'
  done
