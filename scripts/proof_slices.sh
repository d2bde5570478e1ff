#!/usr/bin/env bash
# Runs a preset as slices over several days with one pinned build, keeping the finished cells
# in the repository so that a later checkout continues where this one stopped.
#
#   scripts/proof_slices.sh build               # a build of the pinned revision → results/bin-<rev>/onepass
#   scripts/proof_slices.sh restore             # committed slices and world cache → results/, .cache/
#   scripts/proof_slices.sh run [i …]           # run (or resume) slices i (default: every unfinished one), in order
#   scripts/proof_slices.sh keep                # finished cells of every slice → docs/results/slices/<name>/
#   scripts/proof_slices.sh merge               # every slice finished → onepass merge + report + check
#
# Set PRESET (default experiments/deploy/online-proof.toml), N (slices, default 8), REV (the
# pinned revision, default 6c8cb6f), THREADS (default 2), SET (--set overrides, one KEY=VALUE a
# line, passed to every run and to the merge) and NAME (the folders' name, default the preset's).
# e.g. the bf16 proof: REV=e4cc6cd NAME=online-proof-bf16 \
#   SET=$'policy.dtype="bf16"\nfeatures.dtype="bf16"' scripts/proof_slices.sh run
# The run's identity holds the
# revision and digests of its data (the generated responses and their φ), so every slice must
# come from one build of REV and read the same world: `restore` copies the committed cache into
# .cache/ before anything runs. Only what `onepass merge` reads is kept: slice.json, plan.json,
# resume.json, spec.resolved.toml, each finished cell's checkpoints/<cell>.done and its tb/
# files — a cell still running is left out and starts again on resume.
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET=${PRESET:-experiments/deploy/online-proof.toml}
N=${N:-8}
REV=${REV:-6c8cb6f}
THREADS=${THREADS:-2}
NAME=${NAME:-$(basename "$PRESET" .toml)}
SETS=()
while IFS= read -r kv; do [[ -n "$kv" ]] && SETS+=(--set "$kv"); done <<<"${SET:-}"

KEEP=${KEEP:-docs/results/slices/$NAME}
WORK=${WORK:-results/slices-$NAME}
BIN=results/bin-$REV/onepass

# the slice's run directory, or nothing (not an error: `d=$(slice_dir i)` runs under set -e)
slice_dir() { find "$WORK/s$1" -mindepth 1 -maxdepth 1 -type d 2>/dev/null | head -n 1 || true; }

case "${1:-}" in
build)
    wt=$(mktemp -d)/onepass-$REV
    git worktree add --detach "$wt" "$REV"
    # the checkout's target dir: the dependencies are built once; the workspace's crates of the
    # worktree build apart (another path), and the binary is copied out before anything relinks it
    root=$(pwd)
    (cd "$wt" && CARGO_TARGET_DIR="$root/target" cargo build --release -p runner)
    mkdir -p "$(dirname "$BIN")" && cp "$root/target/release/onepass" "$BIN"
    git worktree remove --force "$wt"
    "$BIN" --version
    ;;
restore)
    mkdir -p .cache "$WORK"
    if [[ -d "$KEEP/cache" ]]; then cp -r "$KEEP/cache/." .cache/; fi
    for s in "$KEEP"/s*/; do
        [[ -d "$s" ]] || continue
        i=$(basename "$s")
        mkdir -p "$WORK/$i"
        cp -r "$s". "$WORK/$i/"
        for d in "$WORK/$i"/*/; do mkdir -p "$d/theta" "$d/checkpoints"; done
    done
    ;;
run)
    shift
    [[ -x "$BIN" ]] || { echo "proof_slices: $BIN: not built (run: scripts/proof_slices.sh build)" >&2; exit 2; }
    todo=("$@")
    if [[ ${#todo[@]} -eq 0 ]]; then todo=($(seq 0 $((N - 1)))); fi
    for i in "${todo[@]}"; do
        d=$(slice_dir "$i")
        if [[ -n "$d" ]]; then
            if "$BIN" cells "$d" --json 2>/dev/null | python3 -c 'import json,sys; c=[x for x in json.load(sys.stdin)["cells"] if x["state"] != "another slice"]; sys.exit(0 if c and all(x["state"] == "finished" for x in c) else 1)'; then
                echo "proof_slices: slice $i/$N finished"
                continue
            fi
            "$BIN" run "$PRESET" --cells "$i/$N" --resume "$d" --threads "$THREADS" "${SETS[@]}"
        else
            mkdir -p "$WORK/s$i"
            "$BIN" run "$PRESET" --cells "$i/$N" --out "$WORK/s$i" --threads "$THREADS" "${SETS[@]}"
        fi
    done
    ;;
keep)
    for s in "$WORK"/s*/; do
        i=$(basename "$s")
        d=$(slice_dir "${i#s}")
        [[ -n "$d" ]] || continue
        ls "$d"/checkpoints/*.done >/dev/null 2>&1 || continue
        dst="$KEEP/$i/$(basename "$d")"
        mkdir -p "$dst/checkpoints" "$dst/tb"
        cp "$d"/{slice.json,plan.json,resume.json,spec.resolved.toml} "$dst/"
        for done in "$d"/checkpoints/*.done; do
            cell=$(basename "$done" .done)
            cp "$done" "$dst/checkpoints/"
            if [[ -d "$d/tb/$cell" ]]; then mkdir -p "$dst/tb/$cell" && cp "$d/tb/$cell"/* "$dst/tb/$cell/"; fi
        done
        echo "proof_slices: kept $(ls "$dst"/checkpoints/*.done | wc -l) finished cells of slice ${i#s} in $dst"
    done
    ;;
merge)
    dirs=()
    for i in $(seq 0 $((N - 1))); do
        d=$(slice_dir "$i")
        [[ -n "$d" ]] || { echo "proof_slices: slice $i/$N: not run" >&2; exit 1; }
        dirs+=("$d")
    done
    run=$("$BIN" merge "$PRESET" "${dirs[@]}" --out results "${SETS[@]}" | tail -n 1)
    "$BIN" report "$run"
    python3 scripts/check_policy_stats.py "$run"
    echo "$run"
    ;;
*)
    sed -n '2,17p' "$0" >&2
    exit 2
    ;;
esac
