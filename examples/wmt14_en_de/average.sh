#!/usr/bin/env bash
# Average the last NUM checkpoints of a training run into one (Vaswani et al.: the last 5,
# written at regular intervals). Skipped when the average exists and is newer than every input.
#
#   bash examples/wmt14_en_de/average.sh                          # last 5 update checkpoints
#   NUM=10 SAVE_DIR=work/wmt14_en_de/checkpoints/transformer_wmt_en_de bash examples/wmt14_en_de/average.sh
#
# Knobs (environment, defaults shown): WORK_DIR, ARCH, SAVE_DIR (common.sh), NUM=5,
# KIND=update|epoch, UPPER_BOUND (ignore checkpoints after this update/epoch),
# OUTPUT=$SAVE_DIR/checkpoint.avg$NUM.pt
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" average
model_paths

NUM="${NUM:-5}"
KIND="${KIND:-update}"
UPPER_BOUND="${UPPER_BOUND:-}"
OUTPUT="${OUTPUT:-$SAVE_DIR/checkpoint.avg$NUM.pt}"

[[ -d "$SAVE_DIR" ]] || die "no checkpoint directory $SAVE_DIR: run train.sh first (or set SAVE_DIR)"
case "$KIND" in
    update) PATTERN='checkpoint_*_*.pt'; FLAG=--num-update-checkpoints ;;
    epoch) PATTERN='checkpoint[0-9]*.pt'; FLAG=--num-epoch-checkpoints ;;
    *) die "KIND must be update or epoch, not '$KIND'" ;;
esac

if [[ -f "$OUTPUT" ]]; then
    newer=$(find "$SAVE_DIR" -maxdepth 1 -name "$PATTERN" -newer "$OUTPUT" | head -n 1)
    if [[ -z "$newer" ]]; then
        log "$OUTPUT is up to date, skipping"
        exit 0
    fi
fi
ARGS=(--inputs "$SAVE_DIR" "$FLAG" "$NUM" --output "$OUTPUT")
[[ -z "$UPPER_BOUND" ]] || ARGS+=(--checkpoint-upper-bound "$UPPER_BOUND")
fairseq-rope-average "${ARGS[@]}"
log "averaged the last $NUM $KIND checkpoints of $SAVE_DIR into $OUTPUT"
