#!/usr/bin/env bash
# `just reproduce-<setting> PRESET [ARGS...]`: run experiments/<setting>/<PRESET>.toml, then
# `onepass report` on it. ARGS go to `onepass run` as they were typed (each one word, quotes
# kept: `--set 'deploy.policy=["rloo"]'` reaches onepass as one argument). The run directory is
# the last line printed.
set -euo pipefail
cd "$(dirname "$0")/.."
setting=$1
preset=$2
shift 2
spec=experiments/$setting/$preset.toml
if [[ ! -f "$spec" ]]; then
    echo "no preset $preset in experiments/$setting/; presets:" $(ls "experiments/$setting" | sed 's/\.toml$//') >&2
    exit 2
fi
if grep -q '"models/' "$spec"; then scripts/fetch_models.sh >&2; fi
# ONEPASS_FEATURES=cuda (or metal) builds the GPU binary: a preset with device = "cuda" needs it
cargo build --quiet --release -p runner ${ONEPASS_FEATURES:+--features "$ONEPASS_FEATURES"}
# the binary where cargo put it (CARGO_TARGET_DIR, build.target-dir), not ./target
bin="$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')/release/onepass"
# stdout (the final table, then the run directory) is shown on stderr; no `tee /dev/stderr`,
# which re-opens (and truncates) a log file that stderr is redirected to
t0=$(date +%s.%N)
out=$("$bin" run "$spec" "$@")
printf '%s\n' "$out" >&2
dir=$(printf '%s\n' "$out" | tail -n 1)
# the run's wall time (generation and φ read from the caches where they hold them)
awk -v t0="$t0" -v t1="$(date +%s.%N)" -v p="$setting/$preset" \
    'BEGIN { printf "reproduce: %s ran in %.1f s (wall; caches: .cache/)\n", p, t1 - t0 }' >&2
"$bin" report "$dir" >&2
echo "$dir"
