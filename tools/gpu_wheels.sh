#!/bin/bash
# The Python packages seqpar's GPU checks (make test-gpu, python -m seqpar.bench gpu) need beyond a CUDA build of
# torch + transformers, downloaded here for a GPU machine with no network (Python 3.12, x86-64 Linux).
#   tools/gpu_wheels.sh DIR     then on the GPU machine:  tools/gpu_install.sh DIR /tmp/site
# Wheels over 8 MB are unpacked and packed again as .tar.xz: tilelang and z3 shrink from 77 to 36 MB, so the whole
# set stays under 48 MB (some machines take at most 64 MB of files per call).
# flash-linear-attention runs the Qwen3.5 hybrid's recurrent layers on their kernels; on Hopper with Triton < 3.7.1
# its gated backward needs tilelang (FLA refuses otherwise, because Triton miscompiles it there).
set -euo pipefail
DIR=${1:?usage: tools/gpu_wheels.sh DIR}
mkdir -p "$DIR"
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# One version each: pip --target refuses two. Versions are the ones the 2026-11 runs used (docs/gpu.md).
PKGS=(pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5
      typing_extensions==4.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
      flash-linear-attention==0.6.0 fla-core==0.6.0
      tilelang==0.1.15 apache-tvm-ffi==0.1.12 torch-c-dlpack-ext==0.1.5 z3-solver==4.15.4.0)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
    -d "$DIR" "${PKGS[@]}"
for whl in "$DIR"/*.whl; do
    [ "$(stat -c %s "$whl")" -gt 8000000 ] || continue
    tmp=$(mktemp -d)
    python3 -m zipfile -e "$whl" "$tmp"
    rm -rf "$tmp"/*.data  # console scripts / binaries (z3's 22 MB solver executable): not imported
    tar -C "$tmp" -cf - . | xz -9 -T0 > "${whl%.whl}.tar.xz"
    rm -rf "$tmp" "$whl"
done
du -ch "$DIR"/* | tail -1
