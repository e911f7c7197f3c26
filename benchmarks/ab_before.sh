#!/usr/bin/env bash
# Writes the given files as they were at a commit under .ab/before/ (ignored by git), for
# gpu_session.sh's ab_sweep mode: carry [".ab"] with the call.
# Usage: bash benchmarks/ab_before.sh <commit> <path>...
set -euo pipefail
commit=${1:?usage: ab_before.sh <commit> <path>...}; shift
[ $# -gt 0 ] || { echo "ab_before.sh: name at least one path" >&2; exit 2; }
rm -rf .ab/before
for path in "$@"; do
  mkdir -p ".ab/before/$(dirname "$path")"
  git show "$commit:$path" > ".ab/before/$path"
done
echo "ab_before.sh: $# file(s) of $commit under .ab/before/"
