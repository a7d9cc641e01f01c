#!/usr/bin/env bash
# Installs NVIDIA's CUDA 13.0 compiler from PyPI (no GPU needed) and prints
# the nvcc path. build.rs finds it through NVCC. Stay on 13.0: the H200's
# driver is CUDA 13.0 and rejects PTX from a newer nvcc.
set -euo pipefail
python3 -m pip install --quiet --disable-pip-version-check \
  "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-crt==13.0.*" \
  "nvidia-nvvm==13.0.*" "nvidia-cuda-cccl==13.0.*" >&2
nvcc=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "bin", "nvcc"))')
"$nvcc" --version >&2
echo "$nvcc"
