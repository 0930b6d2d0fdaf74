#!/usr/bin/env bash
# Fails when a C++ or CUDA source of the tree differs from what .clang-format makes of it
# (clang-format 14, Debian's). With --fix, rewrites the files instead.
set -euo pipefail
cd "$(dirname "$0")/.."
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files '*.h' '*.cpp' '*.cu')
else
  mapfile -t files < <(find dp kernels models bench examples tools tests -name '*.h' -o -name '*.cpp' -o -name '*.cu')
fi
if [ "${1:-}" = "--fix" ]; then
  clang-format -i "${files[@]}"
  exit 0
fi
clang-format --dry-run --Werror "${files[@]}"
echo "format: ${#files[@]} files follow .clang-format"
