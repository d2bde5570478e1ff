#!/usr/bin/env bash
# A run's cells as a SLURM job array: task i of N runs the cells k with k mod N = i of the spec
# (`onepass run --cells i/N`) into a slice directory; one merge step assembles the run directory,
# whose tables, θ and adapters are byte for byte those of a run in one process.
#
# Submit both steps at once (from the repository root, where the relative paths below point):
#
#   N=8 bash experiments/slurm/run-array.sh submit
#
# which makes the log folder ($LOGS), submits the array (--array=0-7) and then the merge step
# with --dependency=afterany on the array (it runs when every task has ended, finished or not),
# sized small (--cpus-per-task=1 --mem=4G --time=01:00:00 unless MERGE_SBATCH says otherwise).
# By hand, the same is
#
#   mkdir -p logs                                          # sbatch does not make --output's folder
#   sbatch --array=0-7 experiments/slurm/run-array.sh
#   sbatch --dependency=afterany:<array job id> --cpus-per-task=1 --mem=4G --time=01:00:00 \
#          --export=ALL,STEP=merge,N=8 experiments/slurm/run-array.sh
#
# The `--set` flags: SETS holds one `key=value` a line, each passed as one `--set` (a value may
# hold spaces, brackets, quotes and commas), or SETS_FILE names a file of such lines (blank lines
# and lines starting with # skipped). E.g.
#
#   export SETS=$'seeds=20\ndeploy.policy=["best-of-n", "rloo"]'
#   N=8 bash experiments/slurm/run-array.sh submit
#
# `submit` writes them to $WORK/n<N>/sets, which every task and the merge then read (sbatch's
# --export cannot carry commas, so pass them this way rather than on its command line).
#
# Slices live in $WORK/n<N>/task-<i>: a run resubmitted with another N starts afresh beside the
# first (a slice directory of one N is never resumed as a slice of another). A task that stopped
# (time limit, preemption, a full disk) resumes as that slice: resubmit it
# (`sbatch --array=<i> --export=ALL,N=<N> run-array.sh`, with the same SPEC; the SETS `submit`
# recorded are read again); it continues its directory (`--cells i/N --resume DIR`). The merge step checks every task's slice first: a task with no
# slice directory or with cells not yet finished is named (with what to resubmit) and the step
# exits 1 having written nothing; run it again (STEP=merge) once they are done. `onepass merge`
# itself checks that every cell finished in exactly one slice before it makes its directory.
# Every slice loads the world (data, generation, φ) from the shared caches: on a fresh cache, run
# `onepass features extract` first (experiments/slurm/extract-array.sh) or let one slice fill it.
#
# Edit the variables below (or set them in the environment; sbatch passes it on). Build once
# beforehand:
#   cargo build --release -p runner            # add --features cuda on GPU nodes
#
#SBATCH --job-name=onepass-run
#SBATCH --cpus-per-task=8
#SBATCH --mem=32G
#SBATCH --time=08:00:00
#SBATCH --output=logs/%x-%A_%a.out
set -euo pipefail

SPEC=${SPEC:-experiments/passive/synthetic.toml}
SETS=${SETS:-}                       # one key=value a line, e.g. $'seeds=20\nstream.samples=50000'
SETS_FILE=${SETS_FILE:-}             # or a file of such lines
WORK=${WORK:-results/slices}         # one directory per slice: $WORK/n<N>/task-<i>
OUT=${OUT:-results}
LOGS=${LOGS:-logs}
ONEPASS=${ONEPASS:-target/release/onepass}
MERGE_SBATCH=${MERGE_SBATCH:---cpus-per-task=1 --mem=4G --time=01:00:00}
STEP=${STEP:-${1:-slice}}

die() {
    echo "run-array.sh: $*" >&2
    exit 1
}

# The `--set` lines: SETS_FILE's, else SETS', else (neither given) those `submit` recorded for
# this N in $WORK/n<N>/sets (a task resubmitted by hand).
sets_text() {
    if [[ -n "$SETS_FILE" ]]; then
        [[ -f "$SETS_FILE" ]] || die "SETS_FILE=$SETS_FILE: no such file"
        cat "$SETS_FILE"
    elif [[ -z "$SETS" && -n "${N:-}" && -f "$WORK/n$N/sets" ]]; then
        cat "$WORK/n$N/sets"
    else
        printf '%s\n' "$SETS"
    fi
}

# EXTRA: one `--set LINE` pair per assignment line.
read_sets() {
    EXTRA=()
    local line
    while IFS= read -r line || [[ -n "$line" ]]; do
        line=${line%$'\r'}
        [[ -z "${line//[[:space:]]/}" || "$line" =~ ^[[:space:]]*# ]] && continue
        case "$line" in
        -*) die "SETS: \`$line\`: one key=value a line, without --set (e.g. SETS=\$'seeds=20\\nstream.samples=500')" ;;
        *=*) EXTRA+=(--set "$line") ;;
        *) die "SETS: \`$line\`: expected key=value" ;;
        esac
    done < <(sets_text)
}

case "$STEP" in
submit)
    : "${N:?N=<number of tasks> bash $0 submit}"
    [[ "$N" =~ ^[1-9][0-9]*$ ]] || die "N=$N: expected a whole number ≥ 1"
    read_sets
    command -v sbatch > /dev/null || die "sbatch not found: submit on a SLURM login node"
    mkdir -p "$LOGS" "$WORK/n$N"
    sets_text > "$WORK/n$N/sets.tmp"
    mv "$WORK/n$N/sets.tmp" "$WORK/n$N/sets"
    script=$(readlink -f "${BASH_SOURCE[0]}")
    export SPEC WORK OUT ONEPASS SETS_FILE="$WORK/n$N/sets" SETS=""
    array=$(sbatch --parsable --array="0-$((N - 1))" --output="$LOGS/%x-%A_%a.out" --export="ALL,STEP=slice,N=$N" "$script")
    array=${array%%;*}
    # shellcheck disable=SC2086  # MERGE_SBATCH is several flags
    merge=$(sbatch --parsable --dependency="afterany:$array" $MERGE_SBATCH --job-name=onepass-merge \
        --output="$LOGS/%x-%j.out" --export="ALL,STEP=merge,N=$N" "$script")
    echo "array job $array ($N tasks), merge job ${merge%%;*} (after the array, whatever its outcome); logs in $LOGS/"
    ;;
slice)
    : "${SLURM_ARRAY_TASK_ID:?run with sbatch --array=0-(N-1), or N=... bash $0 submit}"
    # N: given (a resubmitted task, whose own array is smaller), else the array's task count
    N=${N:-${SLURM_ARRAY_TASK_COUNT:?}}
    I=$SLURM_ARRAY_TASK_ID
    (( I < N )) || die "task $I of $N: a task resubmitted alone needs the first array's N (sbatch --array=$I --export=ALL,N=<N> …)"
    read_sets
    mkdir -p "$WORK/n$N/task-$I"
    DIR=$(find "$WORK/n$N/task-$I" -mindepth 1 -maxdepth 1 -type d | head -n 1)
    if [[ -n "$DIR" ]]; then
        # a slice resumes only as itself: onepass refuses another slice's directory
        "$ONEPASS" run "$SPEC" "${EXTRA[@]}" --cells "$I/$N" --resume "$DIR" --threads "${SLURM_CPUS_PER_TASK:-1}"
    else
        "$ONEPASS" run "$SPEC" "${EXTRA[@]}" --cells "$I/$N" --out "$WORK/n$N/task-$I" --threads "${SLURM_CPUS_PER_TASK:-1}"
    fi
    ;;
merge)
    if [[ -z "${N:-}" ]]; then
        # the only N under $WORK, else the caller must say which
        mapfile -t ns < <(find "$WORK" -mindepth 1 -maxdepth 1 -type d -name 'n[0-9]*' -printf '%f\n' 2> /dev/null | sort)
        [[ ${#ns[@]} -eq 1 ]] || die "merge: set N (the array's task count): $WORK holds ${#ns[@]} arrays (${ns[*]:-none})"
        N=${ns[0]#n}
    fi
    [[ "$N" =~ ^[1-9][0-9]*$ ]] || die "N=$N: expected a whole number ≥ 1"
    read_sets
    slices=()
    missing=()
    for ((i = 0; i < N; i++)); do
        mapfile -t dirs < <(find "$WORK/n$N/task-$i" -mindepth 1 -maxdepth 1 -type d 2> /dev/null)
        if [[ ${#dirs[@]} -ne 1 ]]; then
            missing+=("task $i (no slice directory in $WORK/n$N/task-$i)")
            continue
        fi
        # its cells: those still checkpointed or not started, or a .done that cannot be read
        if ! status=$("$ONEPASS" cells --json "${dirs[0]}" 2>&1); then
            missing+=("task $i (${dirs[0]}: $(printf '%s\n' "$status" | tail -n 1))")
            continue
        fi
        left=$(printf '%s\n' "$status" | { grep -oE '"state": ?"(checkpointed|not started|corrupt|unreadable)"' || true; } | wc -l)
        if [[ "$left" -gt 0 ]]; then
            missing+=("task $i ($left cells unfinished in ${dirs[0]})")
            continue
        fi
        slices+=("${dirs[0]}")
    done
    if [[ ${#missing[@]} -gt 0 ]]; then
        {
            echo "run-array.sh: merge: ${#missing[@]} of $N tasks did not finish; nothing merged:"
            printf '  %s\n' "${missing[@]}"
            echo "  resubmit them (sbatch --array=<i,…> --export=ALL,N=$N … with the same SPEC and SETS), then STEP=merge N=$N again"
        } >&2
        exit 1
    fi
    "$ONEPASS" merge "$SPEC" "${EXTRA[@]}" "${slices[@]}" --out "$OUT"
    ;;
*) die "STEP=$STEP: expected slice (an array task), merge or submit" ;;
esac
