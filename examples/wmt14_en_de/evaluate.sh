#!/usr/bin/env bash
# Translate the test set with a checkpoint and score it.
#   fairseq-generate --beam 4 --lenpen 0.6 --remove-bpe  (Vaswani et al.'s decoding)
#   -> tokenized BLEU with compound splitting (the convention behind the paper's 27.3 / 27.5)
#   -> sacreBLEU on detokenized output, with its signature
# Files written to OUT_DIR: generate.out (fairseq's full output), hyp.tok.TGT (tokenized
# hypotheses in test order), hyp.detok.TGT, scores.json, scores.txt.
# Skipped when OUT_DIR/scores.json exists and is newer than the checkpoint.
#
#   bash examples/wmt14_en_de/evaluate.sh
#   CHECKPOINT=work/wmt14_en_de/checkpoints/transformer_wmt_en_de/checkpoint_best.pt bash examples/wmt14_en_de/evaluate.sh
#
# Knobs (environment, defaults shown below).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
WORK_DIR="${WORK_DIR:-$ROOT/work/wmt14_en_de}"
DATA_BIN="${DATA_BIN:-$WORK_DIR/data-bin}"
ARCH="${ARCH:-transformer_rope_wmt_en_de}"
SAVE_DIR="${SAVE_DIR:-$WORK_DIR/checkpoints/$ARCH}"
CHECKPOINT="${CHECKPOINT:-$SAVE_DIR/checkpoint.avg5.pt}"
SRC="${SRC:-en}"
TGT="${TGT:-de}"
SUBSET="${SUBSET:-test}"
BEAM="${BEAM:-4}"
LENPEN="${LENPEN:-0.6}"
MAX_TOKENS="${MAX_TOKENS:-8000}"
BATCH_SIZE="${BATCH_SIZE:-128}"
REF_TOK="${REF_TOK:-$WORK_DIR/tok/$SUBSET.$TGT}"   # Moses-tokenized reference
REF_RAW="${REF_RAW:-$WORK_DIR/raw/$SUBSET.$TGT}"   # untokenized reference (sacreBLEU)
OUT_DIR="${OUT_DIR:-$SAVE_DIR/eval_$(basename "$CHECKPOINT" .pt)_$SUBSET}"
CPU="${CPU:-auto}"
FP16="${FP16:-auto}"

die() { printf '[evaluate] error: %s\n' "$*" >&2; exit 1; }
log() { printf '[evaluate] %s\n' "$*" >&2; }

[[ -f "$CHECKPOINT" ]] || die "no checkpoint $CHECKPOINT: run train.sh and average.sh first (or set CHECKPOINT)"
[[ -f "$DATA_BIN/dict.$TGT.txt" ]] || die "no data-bin at $DATA_BIN: run prepare.sh first (or set DATA_BIN)"
[[ -f "$REF_TOK" ]] || die "no tokenized reference $REF_TOK (set REF_TOK)"
[[ -f "$REF_RAW" ]] || die "no raw reference $REF_RAW (set REF_RAW)"

if [[ -f "$OUT_DIR/scores.json" && "$OUT_DIR/scores.json" -nt "$CHECKPOINT" ]]; then
    log "$OUT_DIR/scores.json is newer than $CHECKPOINT, skipping generation"
    cat "$OUT_DIR/scores.txt"
    exit 0
fi
mkdir -p "$OUT_DIR"

BPE_TYPE="$(cat "$DATA_BIN/bpe_type" 2>/dev/null || echo subword_nmt)"
case "$BPE_TYPE" in
    subword_nmt) REMOVE_BPE=(--remove-bpe) ;;
    sentencepiece) REMOVE_BPE=(--remove-bpe sentencepiece) ;;
    *) die "unknown BPE type '$BPE_TYPE' in $DATA_BIN/bpe_type" ;;
esac
DEVICE_ARGS=()
if [[ "$CPU" == auto ]]; then
    if python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then CPU=0; else CPU=1; fi
fi
if [[ "$CPU" == 1 ]]; then DEVICE_ARGS+=(--cpu); elif [[ "$FP16" != 0 ]]; then DEVICE_ARGS+=(--fp16); fi

log "translating $SUBSET with $CHECKPOINT (beam $BEAM, lenpen $LENPEN)"
# --user-dir: registers transformer_rope and allow-lists what torch's safe loading needs.
# --required-batch-size-multiple 1: with fairseq's default of 8, fairseq 0.12 drops the
# last (longest) batch of the test set without a word; the line count check below catches that.
fairseq-generate "$DATA_BIN" --source-lang "$SRC" --target-lang "$TGT" --gen-subset "$SUBSET" \
    --path "$CHECKPOINT" --user-dir "$ROOT/fairseq_rope" \
    --beam "$BEAM" --lenpen "$LENPEN" "${REMOVE_BPE[@]}" \
    --max-tokens "$MAX_TOKENS" --batch-size "$BATCH_SIZE" --required-batch-size-multiple 1 "${DEVICE_ARGS[@]}" \
    > "$OUT_DIR/generate.out.tmp" 2> "$OUT_DIR/generate.log" \
    || { tail -n 20 "$OUT_DIR/generate.log" >&2; die "fairseq-generate failed (log: $OUT_DIR/generate.log)"; }
mv "$OUT_DIR/generate.out.tmp" "$OUT_DIR/generate.out"

# hypotheses back in test-set order (fairseq prints them by batch)
grep '^H-' "$OUT_DIR/generate.out" | sed 's/^H-//' | sort -n -k1,1 | cut -f3 > "$OUT_DIR/hyp.tok.$TGT"
n_hyp=$(wc -l < "$OUT_DIR/hyp.tok.$TGT"); n_ref=$(wc -l < "$REF_TOK")
[[ "$n_hyp" -eq "$n_ref" ]] || die "$n_hyp hypotheses but $n_ref reference lines in $REF_TOK"

python "$ROOT/scripts/score_bleu.py" --hyp "$OUT_DIR/hyp.tok.$TGT" --ref "$REF_TOK" --raw-ref "$REF_RAW" \
    --lang "$TGT" --detok-out "$OUT_DIR/hyp.detok.$TGT" --out-json "$OUT_DIR/scores.json.part" \
    | tee "$OUT_DIR/scores.txt"
mv "$OUT_DIR/scores.json.part" "$OUT_DIR/scores.json"
log "hypotheses and scores in $OUT_DIR"
