#!/usr/bin/env bash
# Average the last NUM checkpoints of a training run into one (Vaswani et al.: the last 5,
# written at regular intervals). Skipped when the average exists and is newer than every input.
# Then, beside it, fairseq's pretrained-model layout of the average (PRETRAINED_DIR: model.pt, a
# link to it, the dictionaries and WORK_DIR's BPE files, README.md with the commands), from which
# fairseq-interactive and TransformerModel.from_pretrained translate raw text as
# fairseq-rope-translate --engine fairseq does (docs/usage.md#raw-text-through-fairseqs-own-tools);
# left out, with a note, when WORK_DIR is not the directory prepare.sh wrote.
#
#   bash examples/wmt14_en_de/average.sh                          # last 5 update checkpoints
#   NUM=10 SAVE_DIR=work/wmt14_en_de/checkpoints/transformer_wmt_en_de bash examples/wmt14_en_de/average.sh
#
# Knobs (environment, defaults shown): WORK_DIR, ARCH, DATA_BIN, SAVE_DIR (common.sh), NUM=5,
# KIND=update|epoch, UPPER_BOUND (ignore checkpoints after this update/epoch),
# OUTPUT=$SAVE_DIR/checkpoint.avg$NUM.pt, PRETRAINED_DIR=pretrained_NAME beside OUTPUT (NAME.pt)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" average
model_paths

NUM="${NUM:-5}"
KIND="${KIND:-update}"
UPPER_BOUND="${UPPER_BOUND:-}"
OUTPUT="${OUTPUT:-$SAVE_DIR/checkpoint.avg$NUM.pt}"
PRETRAINED_DIR="${PRETRAINED_DIR:-$(dirname "$OUTPUT")/pretrained_$(basename "$OUTPUT" .pt)}"
dash_safe OUTPUT PRETRAINED_DIR

[[ -d "$SAVE_DIR" ]] || die "no checkpoint directory $SAVE_DIR: run train.sh first (or set SAVE_DIR)"
case "$KIND" in
    update) PATTERN='checkpoint_*_*.pt'; FLAG=--num-update-checkpoints ;;
    epoch) PATTERN='checkpoint[0-9]*.pt'; FLAG=--num-epoch-checkpoints ;;
    *) die "KIND must be update or epoch, not '$KIND'" ;;
esac

if [[ -f "$OUTPUT" && -z "$(find "$SAVE_DIR" -maxdepth 1 -name "$PATTERN" -newer "$OUTPUT" | head -n 1)" ]]; then
    log "$OUTPUT is up to date, skipping the averaging"
else
    ARGS=(--inputs "$SAVE_DIR" "$FLAG" "$NUM" --output "$OUTPUT")
    [[ -z "$UPPER_BOUND" ]] || ARGS+=(--checkpoint-upper-bound "$UPPER_BOUND")
    fairseq-rope-average "${ARGS[@]}"
    log "averaged the last $NUM $KIND checkpoints of $SAVE_DIR into $OUTPUT"
fi

# the pretrained layout: cheap, and skipped by the tool itself when it holds the same files
if [[ -f "$WORK_DIR/bpe/.done" && -d "$DATA_BIN" ]]; then
    fairseq-rope-pretrained-layout --checkpoint "$OUTPUT" --work-dir "$WORK_DIR" \
        --data-bin "$DATA_BIN" --output-dir "$PRETRAINED_DIR"
else
    log "no pretrained layout beside $OUTPUT: $WORK_DIR is not a directory prepare.sh wrote (no bpe/.done or data-bin/); set WORK_DIR to the model's"
fi
