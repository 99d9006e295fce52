#!/usr/bin/env bash
# Quickstart: the whole WMT14-style pipeline, offline, on a laptop CPU, in a few minutes.
#
#   make demo                          # RoPE: transformer_rope_tiny
#   ARCH=transformer_tiny make demo    # the sinusoidal baseline, same settings
#
# 1. generate a synthetic English -> German-like corpus (fairseq-rope-generate-corpus: verb-final
#    subordinate clauses, verb brackets, inversion, agreement over distance, numbers)
# 2. prepare it like WMT14 (examples/wmt14_en_de/prepare.sh: Moses normalisation and
#    tokenisation, cleaning, joint BPE, fairseq-preprocess --joined-dictionary)
# 3. train on CPU (examples/wmt14_en_de/train.sh), checkpoints every SAVE_INTERVAL updates
# 4. average the last NUM_AVG checkpoints (examples/wmt14_en_de/average.sh)
# 5. beam-4, lenpen-0.6 decode of the test set and BLEU: tokenized compound-split BLEU and
#    sacreBLEU with its signature (examples/wmt14_en_de/evaluate.sh); then the averaged model is
#    exported to CTranslate2 and the same test set decoded with it (ENGINE=ctranslate2, same beam,
#    length penalty, batch size and thread count), and both engines' BLEU and sentences per second
#    (decoding only, model loading excluded) are printed side by side
# 6. a PNG plot of training and validation loss per update (fairseq-rope-plot-losses)
#
# Every step is skipped when its output is already complete, so a second run only reprints the
# results. Directory names carry the settings, so changing a knob redoes what it affects.
# Knobs (environment variables, defaults shown below); MODEL_ARGS adds fairseq-train arguments,
# e.g. MODEL_ARGS="--encoder-embed-dim 128 --decoder-embed-dim 128".
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" quickstart
RECIPE="$ROOT/examples/wmt14_en_de"

QUICKSTART_DIR="${QUICKSTART_DIR:-$ROOT/work/quickstart}"
ARCH="${ARCH:-transformer_rope_tiny}"
SEED="${SEED:-1}"
TRAIN_SIZE="${TRAIN_SIZE:-30000}"
VALID_SIZE="${VALID_SIZE:-500}"
TEST_SIZE="${TEST_SIZE:-500}"
BPE_SIZE="${BPE_SIZE:-2000}"
MAX_TOKENS="${MAX_TOKENS:-4096}"
MAX_UPDATE="${MAX_UPDATE:-1000}"
SAVE_INTERVAL="${SAVE_INTERVAL:-100}"
NUM_AVG="${NUM_AVG:-5}"
LR="${LR:-3e-3}"
WARMUP_UPDATES="${WARMUP_UPDATES:-200}"
DROPOUT="${DROPOUT:-0.1}"
LOG_INTERVAL="${LOG_INTERVAL:-25}"
MODEL_ARGS="${MODEL_ARGS:-}"
THREADS="${THREADS:-${OMP_NUM_THREADS:-$(nproc 2>/dev/null || echo 2)}}"
SHOW_EXAMPLES="${SHOW_EXAMPLES:-3}"

export OMP_NUM_THREADS="$THREADS" MKL_NUM_THREADS="$THREADS" PYTHONUNBUFFERED=1

START=$(date +%s)
say() { printf '[quickstart %4ss] %s\n' "$(( $(date +%s) - START ))" "$*"; }
progress() {  # condense fairseq-train's log to one line per logged update / validation
    local line re_upd='num_updates[= ]([0-9]+)'
    while IFS= read -r line; do
        if [[ "$line" == *train_inner* && "$line" =~ loss=([0-9.]+) ]]; then
            local loss="${BASH_REMATCH[1]}"; [[ "$line" =~ $re_upd ]]
            say "    update ${BASH_REMATCH[1]}/$MAX_UPDATE  train loss $loss"
        elif [[ "$line" == *"valid on 'valid' subset"* && "$line" =~ \|\ loss\ ([0-9.]+) ]]; then
            local loss="${BASH_REMATCH[1]}"; [[ "$line" =~ $re_upd ]]
            say "    update ${BASH_REMATCH[1]}/$MAX_UPDATE  valid loss $loss"
        elif [[ "$line" == *Traceback* || "$line" == *Error* || "$line" == *"error:"* ]]; then
            printf '%s\n' "$line" >&2
        fi
    done
}

for tool in python fairseq-train fairseq-preprocess fairseq-generate subword-nmt; do
    command -v "$tool" >/dev/null || die "$tool not on PATH: run 'make demo' (or 'make setup' and put .venv/bin first on PATH)"
done
python -c "import fairseq, fairseq_rope" 2>/dev/null || die "this python cannot import fairseq and fairseq_rope: run 'make setup'"
[[ $(( MAX_UPDATE / SAVE_INTERVAL )) -ge "$NUM_AVG" ]] \
    || die "MAX_UPDATE=$MAX_UPDATE / SAVE_INTERVAL=$SAVE_INTERVAL gives fewer than NUM_AVG=$NUM_AVG checkpoints to average"

CORPUS="$QUICKSTART_DIR/corpus-seed$SEED-n$TRAIN_SIZE-$VALID_SIZE-$TEST_SIZE"
PREP="$QUICKSTART_DIR/prep-seed$SEED-n$TRAIN_SIZE-$VALID_SIZE-$TEST_SIZE-bpe$BPE_SIZE"
RUN_NAME="$ARCH-u$MAX_UPDATE-t$MAX_TOKENS-lr$LR-s$SEED"
if [[ -n "$MODEL_ARGS" ]]; then RUN_NAME="$RUN_NAME-$(printf '%s' "$MODEL_ARGS" | cksum | cut -d' ' -f1)"; fi
SAVE_DIR="$PREP/checkpoints/$RUN_NAME"
mkdir -p "$QUICKSTART_DIR"
say "work dir $QUICKSTART_DIR | $ARCH | $THREADS CPU thread(s)"

# 1. corpus
if [[ -f "$CORPUS/.done" ]]; then
    say "1/6 corpus: $CORPUS exists, skipping"
else
    say "1/6 generating $TRAIN_SIZE/$VALID_SIZE/$TEST_SIZE synthetic sentence pairs (seed $SEED)"
    rm -rf "$CORPUS.tmp"
    fairseq-rope-generate-corpus --out-dir "$CORPUS.tmp" --seed "$SEED" \
        --train-size "$TRAIN_SIZE" --valid-size "$VALID_SIZE" --test-size "$TEST_SIZE"
    touch "$CORPUS.tmp/.done"; rm -rf "$CORPUS"; mv "$CORPUS.tmp" "$CORPUS"
fi
say "    e.g. EN: $(head -n 1 "$CORPUS/test.en")"
say "         DE: $(head -n 1 "$CORPUS/test.de")"

# 2. prepare (tokenise, clean, BPE, binarize)
say "2/6 preparing: Moses tokenisation, cleaning, $BPE_SIZE BPE merges, fairseq-preprocess"
WORK_DIR="$PREP" bash "$RECIPE/prepare.sh" --train-prefix "$CORPUS/train" --valid-prefix "$CORPUS/valid" \
    --test-prefix "$CORPUS/test" --src en --tgt de --bpe subword-nmt --bpe-size "$BPE_SIZE" \
    --workers "$THREADS" 2> "$QUICKSTART_DIR/prepare.log" \
    || { tail -n 20 "$QUICKSTART_DIR/prepare.log" >&2; die "prepare failed (log: $QUICKSTART_DIR/prepare.log)"; }
say "    vocabulary: $(wc -l < "$PREP/data-bin/dict.de.txt") joint BPE types"

# 3. train
if [[ -f "$SAVE_DIR/.train_done" ]]; then
    say "3/6 training: $SAVE_DIR already trained for $MAX_UPDATE updates, skipping"
else
    say "3/6 training $ARCH on CPU for $MAX_UPDATE updates of ~$MAX_TOKENS tokens (log: $SAVE_DIR/train.log)"
    read -r -a EXTRA <<< "$MODEL_ARGS"
    WORK_DIR="$PREP" SAVE_DIR="$SAVE_DIR" ARCH="$ARCH" CPU=1 MAX_TOKENS="$MAX_TOKENS" \
        TOKENS_PER_UPDATE="$MAX_TOKENS" UPDATE_FREQ=1 LR="$LR" WARMUP_UPDATES="$WARMUP_UPDATES" \
        DROPOUT="$DROPOUT" MAX_UPDATE="$MAX_UPDATE" SAVE_INTERVAL_UPDATES="$SAVE_INTERVAL" \
        KEEP_INTERVAL_UPDATES="$NUM_AVG" LOG_INTERVAL="$LOG_INTERVAL" SEED="$SEED" NUM_WORKERS=0 \
        bash "$RECIPE/train.sh" "${EXTRA[@]}" 2>&1 | progress
    [[ -f "$SAVE_DIR/checkpoint_last.pt" ]] || die "training left no checkpoint in $SAVE_DIR (log: $SAVE_DIR/train.log)"
    touch "$SAVE_DIR/.train_done"
fi

# 4. average
say "4/6 averaging the last $NUM_AVG checkpoints"
# WORK_DIR: the prepared data, whose dictionaries and BPE the pretrained layout beside the average takes
WORK_DIR="$PREP" SAVE_DIR="$SAVE_DIR" NUM="$NUM_AVG" KIND=update OUTPUT="$SAVE_DIR/checkpoint.avg$NUM_AVG.pt" \
    bash "$RECIPE/average.sh" 2>&1 | grep -v -e tensorboardX -e '^  ' || true
[[ -f "$SAVE_DIR/checkpoint.avg$NUM_AVG.pt" ]] || die "averaging failed"

# 5. decode + score
say "5/6 beam-4 decoding of the $TEST_SIZE test sentences and scoring"
EVAL_DIR="$SAVE_DIR/eval_avg${NUM_AVG}_test"
WORK_DIR="$PREP" SAVE_DIR="$SAVE_DIR" CHECKPOINT="$SAVE_DIR/checkpoint.avg$NUM_AVG.pt" CPU=1 \
    OUT_DIR="$EVAL_DIR" BEAM=4 LENPEN=0.6 SRC=en TGT=de THREADS="$THREADS" \
    bash "$RECIPE/evaluate.sh" > "$EVAL_DIR.log" 2>&1 \
    || { tail -n 20 "$EVAL_DIR.log" >&2; die "evaluation failed (log: $EVAL_DIR.log)"; }
# the same decoding with CTranslate2 (evaluate.sh exports the averaged model first)
CT2_EVAL_DIR="$SAVE_DIR/eval_avg${NUM_AVG}_test_ct2"
CT2_OK=0
if ! python -c "import ctranslate2" 2>/dev/null; then
    say "    CTranslate2 is not installed (run 'make setup'): no engine comparison"
else
    say "    exporting the averaged model to CTranslate2 and decoding the same test set with it"
    if WORK_DIR="$PREP" SAVE_DIR="$SAVE_DIR" CHECKPOINT="$SAVE_DIR/checkpoint.avg$NUM_AVG.pt" CPU=1 \
        ENGINE=ctranslate2 CT2_DIR="$SAVE_DIR/ct2_avg$NUM_AVG" OUT_DIR="$CT2_EVAL_DIR" \
        BEAM=4 LENPEN=0.6 SRC=en TGT=de THREADS="$THREADS" \
        bash "$RECIPE/evaluate.sh" > "$CT2_EVAL_DIR.log" 2>&1; then
        CT2_OK=1
    else  # e.g. a MODEL_ARGS option CTranslate2 cannot compute: the fairseq results still stand
        say "    CTranslate2 decoding failed, no engine comparison: $(grep -m 1 -i 'error' "$CT2_EVAL_DIR.log" || tail -n 1 "$CT2_EVAL_DIR.log")"
    fi
fi

# 6. plot
say "6/6 plotting the losses"
PNG="$SAVE_DIR/losses.png"
fairseq-rope-plot-losses "$SAVE_DIR/train.log" --output "$PNG" \
    --title "$ARCH on the synthetic En-De corpus" > /dev/null

if [[ "$SHOW_EXAMPLES" -gt 0 ]]; then
    say "examples from the test set:"
    paste -d '\t' "$PREP/raw/test.en" "$PREP/raw/test.de" "$EVAL_DIR/hyp.detok.de" | sed -n "1,${SHOW_EXAMPLES}p" \
        | while IFS=$'\t' read -r src ref hyp; do
            printf '    SRC %s\n    REF %s\n    HYP %s\n\n' "$src" "$ref" "$hyp"
        done
fi
echo "================================================================================"
echo "$ARCH, averaged last $NUM_AVG checkpoints, beam 4, lenpen 0.6, $TEST_SIZE test sentences:"
sed 's/^/  /' "$EVAL_DIR/scores.txt"
if [[ "$CT2_OK" == 1 ]]; then
    engine_row() {  # engine_row NAME EVAL_DIR: tokenized BLEU, sacreBLEU, sentences per second
        local tok sacre speed
        tok="$(sed -n 's/^Tokenized BLEU (compound split): \([0-9.]*\).*/\1/p' "$2/scores.txt")"
        sacre="$(sed -n 's/^sacreBLEU: \([0-9.]*\).*/\1/p' "$2/scores.txt")"
        speed="$(sed -n 's/.* \([0-9.]*\) sentences\/s.*/\1/p' "$2/speed.txt" 2>/dev/null)"
        printf '  %-12s %9s %10s %12s\n' "$1" "${tok:-?}" "${sacre:-?}" "${speed:-?}"
    }
    echo "Engines, same $TEST_SIZE sentences, beam 4, lenpen 0.6, $THREADS CPU thread(s), decoding time only:"
    printf '  %-12s %9s %10s %12s\n' engine "tok BLEU" sacreBLEU "sentences/s"
    engine_row fairseq "$EVAL_DIR"
    engine_row ctranslate2 "$CT2_EVAL_DIR"
    echo "CTranslate2: $SAVE_DIR/ct2_avg$NUM_AVG"
    echo "Translate:   fairseq-rope-translate --model-dir $SAVE_DIR/ct2_avg$NUM_AVG FILE"
fi
PRETRAINED_DIR="$SAVE_DIR/pretrained_checkpoint.avg$NUM_AVG"
[[ ! -d "$PRETRAINED_DIR" ]] || echo "Pretrained:  $PRETRAINED_DIR (fairseq-interactive, from_pretrained: its README.md)"
echo "Hypotheses:  $EVAL_DIR/hyp.detok.de"
echo "Loss plot:   $PNG"
echo "Total time:  $(( $(date +%s) - START )) s"
echo "================================================================================"
