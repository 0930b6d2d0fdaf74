#!/usr/bin/env bash
# Installs the Debian packages dp builds with (only those missing), then configures and builds.
# Usage: scripts/setup.sh [build-dir] [extra cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-build}
shift || true

packages=(cmake ninja-build g++ pkg-config ccache clang-format libgtest-dev libopenblas-dev libfmt-dev nlohmann-json3-dev
          libcli11-dev zlib1g-dev libdnnl-dev python3-matplotlib dataset-fashion-mnist clang-14 libclang-rt-14-dev librandom123-dev
          openmpi-bin libopenmpi-dev libgloo-dev python3-torchvision libpng-dev libjpeg62-turbo-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${#missing[@]} Debian package(s): ${missing[*]}" >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# nvcc lives outside PATH on a stock CUDA install; CMake finds it here and builds the cuda backend.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi

launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
echo "setup: configuring $build_dir" >&2
cmake -S . -B "$build_dir" -G Ninja "${launcher[@]}" "$@"
echo "setup: building $build_dir with $(nproc) jobs (from a cold cache about 10 minutes on 2 cores with CUDA;" \
  "ccache makes later builds fast)" >&2
cmake --build "$build_dir" -j "$(nproc)"
