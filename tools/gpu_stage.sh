#!/usr/bin/env bash
# Stages the checkout for a GPU call, whose copy of the working tree (tracked files and untracked
# ones git does not ignore) must stay under 64 MiB, and puts it back after. Three steps:
#
#   tools/gpu_stage.sh            # 1. moves models/*/model.safetensors aside (all but models/target's),
#                                 #    checks the copy's size, prints the device command
#   <the device call>             # 2. the printed command (docs/gpu.md, "The first GPU call")
#   tools/gpu_stage.sh restore    # 3. puts the weights back: `git status` as before step 1
#
#   tools/gpu_stage.sh stage target draft   # keep these models' weights (default: target)
#   tools/gpu_stage.sh stage none           # move every model's weights aside
#   tools/gpu_stage.sh size                 # the copy's size now, moving nothing
#
# The weights go to build/gpu_stage/ (ignored by git, so not copied; the same file system, so a
# move is a rename and `git status` is clean again after restore). While staged, tests that read
# models/draft or models/eagle3 fail: restore right after the call.
set -euo pipefail

cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
STASH=build/gpu_stage
LIMIT=$((64 * 1024 * 1024))

copy_bytes() {  # what the device's copy carries: tracked files present and untracked files not ignored
    git ls-files -z --cached --others --exclude-standard | sort -zu |
        while IFS= read -r -d '' f; do [ -f "$f" ] && [ ! -L "$f" ] && printf '%s\0' "$f"; done |
        xargs -0 -r du -cb | tail -1 | cut -f1
}

report_size() {
    local bytes
    bytes=$(copy_bytes)
    awk -v b="$bytes" -v l="$LIMIT" 'BEGIN { printf "the copy: %d bytes = %.1f MiB of %.0f MiB\n", b, b / 1048576, l / 1048576 }'
    [ "$bytes" -le "$LIMIT" ]
}

stage() {
    local keep=("$@")
    [ ${#keep[@]} -eq 0 ] && keep=(target)
    if [ -d "$STASH" ] && [ -n "$(find "$STASH" -name model.safetensors -print -quit)" ]; then
        echo "already staged ($STASH holds weights): run '$0 restore' first" >&2
        exit 1
    fi
    mkdir -p "$STASH"
    local moved=0
    for f in models/*/model.safetensors; do
        [ -f "$f" ] || continue
        local model
        model=$(basename "$(dirname "$f")")
        if [[ " ${keep[*]} " == *" $model "* ]]; then
            echo "kept   $f ($(du -b "$f" | cut -f1) bytes)"
            continue
        fi
        mkdir -p "$STASH/$model"
        mv "$f" "$STASH/$model/model.safetensors"
        echo "moved  $f -> $STASH/$model/model.safetensors"
        moved=$((moved + 1))
    done
    echo "$moved weight file(s) moved aside"
    if ! report_size; then
        echo "over the limit: restoring; stage with fewer weights kept ('$0 stage none')" >&2
        restore
        exit 1
    fi
    local sha
    sha=$(git rev-parse --short HEAD)
    if [ -n "$(git status --porcelain --untracked-files=no | grep -v ' models/[^/]*/model.safetensors$' || true)" ]; then
        echo "note: tracked files differ from $sha; the copy carries them, SPECSERVE_COMMIT names $sha"
    fi
    cat <<EOF
now the device call (run's timeout_s 570), then '$0 restore':
export PYTHONUNBUFFERED=1 SPECSERVE_COMMIT=$sha; set -o pipefail; timeout 540 python -m bench gpu --plan first --out \$OUT 2>&1 | tee \$OUT/gpu_log.txt
EOF
}

restore() {
    local back=0
    if [ -d "$STASH" ]; then
        for f in "$STASH"/*/model.safetensors; do
            [ -f "$f" ] || continue
            local model
            model=$(basename "$(dirname "$f")")
            if [ -e "models/$model/model.safetensors" ]; then
                echo "models/$model/model.safetensors exists: left $f where it is" >&2
                continue
            fi
            mv "$f" "models/$model/model.safetensors"
            rmdir "$STASH/$model" 2>/dev/null || true
            echo "restored models/$model/model.safetensors"
            back=$((back + 1))
        done
        rmdir "$STASH" 2>/dev/null || true
    fi
    echo "$back weight file(s) restored"
    local missing
    missing=$(git ls-files --deleted -- 'models/*/model.safetensors')
    if [ -n "$missing" ]; then
        echo "still missing: $missing" >&2
        exit 1
    fi
}

case "${1:-stage}" in
    stage) shift || true; stage "$@" ;;
    restore) restore ;;
    size) report_size ;;
    *) echo "usage: $0 [stage [MODEL ... | none]] | restore | size" >&2; exit 2 ;;
esac
