#!/bin/bash
# Install what tools/gpu_wheels.sh downloaded into SITE, with no network: wheels through pip, packed wheels by
# unpacking (a wheel's contents unpacked into a site directory are its install). Then: export PYTHONPATH=SITE
set -euo pipefail
DIR=${1:?usage: tools/gpu_install.sh DIR SITE}
SITE=${2:?usage: tools/gpu_install.sh DIR SITE}
mkdir -p "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$DIR"/*.whl
for pack in "$DIR"/*.tar.xz; do
    if [ -e "$pack" ]; then tar -C "$SITE" -xJf "$pack"; fi
done
