# The two device calls of prepare.sh, here on the CPU, from a copy laid out as there, with
# the venv's packages limited to the image's (dry_site/sitecustomize.py) and the image's
# transformers / huggingface_hub versions; small sizes (ARGS). Needs CHECKOUT/.gpu.
#
#   bash benchmarks/gpu_kit/dry_run.sh CHECKOUT [WORKDIR]
set -eu
G=$(cd "$1/.gpu" && pwd)
W=${2:-/tmp/gpu-dry}
HERE=$(cd "$(dirname "$0")" && pwd)
VENV_PY=${VENV_PY:-$(cd "$HERE/../.." && pwd)/.venv/bin/python}
rm -rf "$W" && mkdir -p "$W/repo/.gpu" "$W/out" "$W/overlay" "$W/image"
cp -r "$G"/* "$W/repo/.gpu/"
# the image's versions of the Hugging Face stack (pure Python)
"$VENV_PY" -m pip download -q --no-deps --only-binary=:all: -d "$W/image" \
  transformers==5.17.0 huggingface_hub==1.33.0
"$VENV_PY" -m pip install -q --no-deps --no-index --target "$W/image/site" "$W/image"/*.whl
# the carried binary wheels are for CPython 3.12; here the same versions for this python
"$VENV_PY" -m pip download -q --no-deps --only-binary=:all: -d "$W/overlay" \
  blake3==1.0.11 pydantic_core==2.50.5
"$VENV_PY" -m pip wheel -q --no-deps -w "$W/overlay" pycosat==0.6.6
printf '#!/bin/sh\nPYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}%s" exec %s "$@"\n' \
  "$HERE/dry_site" "$VENV_PY" > "$W/py" && chmod +x "$W/py"
cd "$W/repo"
PY=$W/py SITE=$W/site SMOL=$W/smol PIPX="--python-version 3.12 --only-binary=:all:" \
  DRY_OVERLAY=$W/overlay CHECK_PATH=$W/site:$W/image/site bash .gpu/step1.sh
PY=$W/py SITE=$W/site:$W/image/site SMOL=$W/smol DEVICE=cpu OUT=$W/out \
  XDG_CACHE_HOME=$W/cache \
  ARGS="${ARGS:---batches 8 --new-tokens 16 --check-batch 8 --check-new-tokens 16}" \
  bash .gpu/step2.sh
