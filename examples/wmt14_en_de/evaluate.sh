#!/usr/bin/env bash
# Translate the test set with a checkpoint and score it.
#   ENGINE=fairseq (default): fairseq-generate --beam 4 --lenpen 0.6 --remove-bpe (Vaswani et al.'s decoding)
#   ENGINE=ctranslate2: export the checkpoint to CTranslate2 (fairseq-rope-export, into
#     CT2_DIR; skipped when CT2_DIR was exported from this same checkpoint: size and sha256 in its
#     export_info.json; CT2_DIR is replaced only if it holds an earlier export: any other directory,
#     e.g. SAVE_DIR, is refused and left as it is) and decode the BPE'd test source
#     WORK_DIR/bpe/SUBSET.SRC with fairseq-rope-translate: the same beam, length penalty and
#     200-token limit, BPE removed the same way
#   ROPE_SCALING=dynamic-yarn (or another --rope-scaling kind, with ROPE_SCALING_FACTOR): decode
#     with that scaling; fairseq-generate takes it through --model-overrides, CTranslate2 through the
#     export: dynamic-yarn as one static-yarn model per length bucket (--length-buckets
#     LENGTH_BUCKETS), each sentence decoded by the model of its length
#   -> tokenized BLEU with compound splitting (the convention behind the paper's 27.3 / 27.5)
#   -> sacreBLEU on detokenized output, with its signature
# Files written to OUT_DIR: generate.out (fairseq's full output; fairseq engine), hyp.tok.TGT
# (tokenized hypotheses in test order), hyp.detok.TGT, scores.json, scores.txt, speed.txt
# (sentences per second of decoding, model loading excluded).
# Skipped when OUT_DIR/scores.json exists and is newer than the checkpoint.
#
#   bash examples/wmt14_en_de/evaluate.sh
#   bash examples/wmt14_en_de/evaluate.sh --engine ctranslate2      # or ENGINE=ctranslate2
#   CHECKPOINT=work/wmt14_en_de/checkpoints/transformer_wmt_en_de/checkpoint_best.pt bash examples/wmt14_en_de/evaluate.sh
#
# Knobs (environment, defaults shown below and, for WORK_DIR, SRC, TGT, ARCH, DATA_BIN and
# SAVE_DIR, in common.sh); --engine wins over ENGINE.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" evaluate

ENGINE="${ENGINE:-fairseq}"                # fairseq | ctranslate2
while [[ $# -gt 0 ]]; do
    case "$1" in
        --engine) [[ $# -ge 2 && -n "$2" ]] || die "--engine needs a value (fairseq or ctranslate2)"
                  ENGINE="$2"; shift 2 ;;
        --engine=*) ENGINE="${1#--engine=}"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown option '$1' (the knobs are environment variables; see --help)" ;;
    esac
done
model_paths
CHECKPOINT="${CHECKPOINT:-$SAVE_DIR/checkpoint.avg5.pt}"
SUBSET="${SUBSET:-test}"
BEAM="${BEAM:-4}"
LENPEN="${LENPEN:-0.6}"
MAX_TOKENS="${MAX_TOKENS:-8000}"
BATCH_SIZE="${BATCH_SIZE:-128}"
REF_TOK="${REF_TOK:-$WORK_DIR/tok/$SUBSET.$TGT}"   # Moses-tokenized reference
REF_RAW="${REF_RAW:-$WORK_DIR/raw/$SUBSET.$TGT}"   # untokenized reference (sacreBLEU)
CPU="${CPU:-auto}"
FP16="${FP16:-auto}"
THREADS="${THREADS:-${OMP_NUM_THREADS:-}}"         # CPU threads of either engine (empty: its default)
# ENGINE=ctranslate2 only:
BPE_SRC="${BPE_SRC:-$WORK_DIR/bpe/$SUBSET.$SRC}"   # the BPE'd source the data-bin's SUBSET was made from
QUANTIZATION="${QUANTIZATION:-none}"               # export: none, int8, int8_float32, float16, bfloat16
COMPUTE_TYPE="${COMPUTE_TYPE:-}"                   # empty: as exported (float16 on GPU unless FP16=0)
# either engine: inputs longer than in training (docs/position_encodings.md)
ROPE_SCALING="${ROPE_SCALING:-none}"               # none, linear, ntk, yarn, dynamic-ntk, dynamic-yarn
ROPE_SCALING_FACTOR="${ROPE_SCALING_FACTOR:-}"     # s of linear, ntk and yarn
LENGTH_BUCKETS="${LENGTH_BUCKETS:-}"               # ctranslate2 with dynamic-yarn: factors (empty: 1.5 2 3 4)
[[ "$ROPE_SCALING" =~ ^[a-z-]+$ ]] || die "ROPE_SCALING must be a --rope-scaling kind (none, yarn, dynamic-yarn, ...), not '$ROPE_SCALING'"
[[ -z "$ROPE_SCALING_FACTOR" || "$ROPE_SCALING_FACTOR" =~ ^[0-9]+(\.[0-9]+)?$ ]] \
    || die "ROPE_SCALING_FACTOR must be a number, not '$ROPE_SCALING_FACTOR'"
[[ -z "$LENGTH_BUCKETS" || "$LENGTH_BUCKETS" =~ ^[0-9.\ ]+$ ]] \
    || die "LENGTH_BUCKETS must be factors separated by spaces (e.g. '1.5 2 3 4'), not '$LENGTH_BUCKETS'"
[[ -z "$LENGTH_BUCKETS" || "$ROPE_SCALING" == dynamic-yarn ]] || die "LENGTH_BUCKETS goes with ROPE_SCALING=dynamic-yarn"
SCALING_ARGS=()                                    # the exporter's flags of the scaling
OVERRIDES=""                                       # fairseq-generate's --model-overrides of it
SCALING_SUFFIX=""
if [[ "$ROPE_SCALING" != none ]]; then
    SCALING_ARGS=(--rope-scaling "$ROPE_SCALING" ${ROPE_SCALING_FACTOR:+--rope-scaling-factor "$ROPE_SCALING_FACTOR"})
    OVERRIDES="{'rope_scaling': '$ROPE_SCALING'${ROPE_SCALING_FACTOR:+, 'rope_scaling_factor': $ROPE_SCALING_FACTOR}}"
    SCALING_SUFFIX="_$ROPE_SCALING${ROPE_SCALING_FACTOR:+x$ROPE_SCALING_FACTOR}"
    if [[ "$ROPE_SCALING" == dynamic-yarn ]]; then
        # CTranslate2 has one scaling per model: plain RoPE and static yarn per length bucket
        read -r -a BUCKET_FACTORS <<< "$LENGTH_BUCKETS"
        SCALING_ARGS=(--length-buckets "${BUCKET_FACTORS[@]}")
        SCALING_SUFFIX="${SCALING_SUFFIX}${LENGTH_BUCKETS:+_$(tr ' ' _ <<< "$LENGTH_BUCKETS")}"
    fi
fi
case "$ENGINE" in
    fairseq) ENGINE_SUFFIX="" ;;
    ctranslate2) ENGINE_SUFFIX="_ct2$([[ "$QUANTIZATION" == none ]] || echo "_$QUANTIZATION")${COMPUTE_TYPE:+_$COMPUTE_TYPE}" ;;
    *) die "--engine (ENGINE) must be fairseq or ctranslate2, not '$ENGINE'" ;;
esac
CT2_DIR="${CT2_DIR:-$SAVE_DIR/ct2_$(basename "$CHECKPOINT" .pt)$([[ "$QUANTIZATION" == none ]] || echo "_$QUANTIZATION")$SCALING_SUFFIX}"
OUT_DIR="${OUT_DIR:-$SAVE_DIR/eval_$(basename "$CHECKPOINT" .pt)_$SUBSET$ENGINE_SUFFIX$SCALING_SUFFIX}"

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
if [[ "$CPU" == auto ]]; then
    if [[ "$ENGINE" == ctranslate2 ]]; then
        probe='import ctranslate2, sys; sys.exit(0 if ctranslate2.get_cuda_device_count() else 1)'
    else
        probe='import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'
    fi
    if python -c "$probe" 2>/dev/null; then CPU=0; else CPU=1; fi
fi
[[ -z "$THREADS" || "$THREADS" =~ ^[1-9][0-9]*$ ]] || die "THREADS must be a positive whole number, not '$THREADS'"
n_ref=$(wc -l < "$REF_TOK")

if [[ "$ENGINE" == fairseq ]]; then
    DEVICE_ARGS=()
    if [[ "$CPU" == 1 ]]; then DEVICE_ARGS+=(--cpu); elif [[ "$FP16" != 0 ]]; then DEVICE_ARGS+=(--fp16); fi
    log "translating $SUBSET with $CHECKPOINT (fairseq, beam $BEAM, lenpen $LENPEN)"
    # --user-dir: registers transformer_rope and allow-lists what torch's safe loading needs.
    # --required-batch-size-multiple 1: with fairseq's default of 8, fairseq 0.12 drops the
    # last (longest) batch of the test set without a word; the line count check below catches that.
    THREAD_ENV=()
    [[ -z "$THREADS" ]] || THREAD_ENV=(env OMP_NUM_THREADS="$THREADS" MKL_NUM_THREADS="$THREADS")
    USER_DIR="$(plugin_dir)"  # assigned first: a failure here stops the script
    "${THREAD_ENV[@]}" fairseq-generate "$DATA_BIN" --source-lang "$SRC" --target-lang "$TGT" --gen-subset "$SUBSET" \
        --path "$CHECKPOINT" --user-dir "$USER_DIR" \
        --beam "$BEAM" --lenpen "$LENPEN" "${REMOVE_BPE[@]}" \
        --max-tokens "$MAX_TOKENS" --batch-size "$BATCH_SIZE" --required-batch-size-multiple 1 "${DEVICE_ARGS[@]}" \
        ${OVERRIDES:+--model-overrides "$OVERRIDES"} \
        > "$OUT_DIR/generate.out.tmp" 2> "$OUT_DIR/generate.log" \
        || { tail -n 20 "$OUT_DIR/generate.log" >&2; die "fairseq-generate failed (log: $OUT_DIR/generate.log)"; }
    mv "$OUT_DIR/generate.out.tmp" "$OUT_DIR/generate.out"

    # hypotheses back in test-set order (fairseq prints them by batch)
    grep '^H-' "$OUT_DIR/generate.out" | sed 's/^H-//' | sort -n -k1,1 | cut -f3 > "$OUT_DIR/hyp.tok.$TGT"
    # fairseq-generate's own timing: the decoding of the whole set, model loading excluded
    # ("Translated 3,003 sentences (86,817 tokens) in 41.2s (72.89 sentences/s, ...)")
    sed -n 's/.*Translated \([0-9,]*\) sentences ([0-9,]* tokens) in [0-9.]*s (\([0-9.]*\) sentences\/s.*/\1 \2/p' \
        "$OUT_DIR/generate.log" | tail -n 1 | tr -d , \
        | awk -v b="$BEAM" -v t="${THREADS:-default}" '{ printf "fairseq: %d sentences in %.2f s of decoding, %.2f sentences/s (beam %s, threads %s)\n", $1, ($2 > 0 ? $1 / $2 : 0), $2, b, t }' \
        > "$OUT_DIR/speed.txt"
else
    python -c 'import ctranslate2' 2>/dev/null || die "ENGINE=ctranslate2 needs the ctranslate2 package: run 'make setup'"
    [[ -f "$BPE_SRC" ]] || die "no BPE'd source $BPE_SRC: run prepare.sh first (or set BPE_SRC)"
    n_src=$(wc -l < "$BPE_SRC")
    [[ "$n_src" -eq "$n_ref" ]] || die "$BPE_SRC has $n_src lines but the reference $REF_TOK has $n_ref"

    # 1. export, unless CT2_DIR already holds this very checkpoint (size, sha256) at this quantization.
    # --force replaces an earlier export only; the exporter's one-line refusal is the message
    fairseq-rope-export --checkpoint "$CHECKPOINT" --data-bin "$DATA_BIN" \
        --output-dir "$CT2_DIR" --quantization "$QUANTIZATION" "${SCALING_ARGS[@]}" --if-changed --force \
        > "$OUT_DIR/export.log" 2>&1 \
        || { refusal="$(sed -n 's/^fairseq-rope-export: error: //p' "$OUT_DIR/export.log" | tail -n 1)"
             [[ -z "$refusal" ]] || die "export to CTranslate2 refused (CT2_DIR is its --output-dir): $refusal"
             grep -v -e '^INFO' -e tensorboardX "$OUT_DIR/export.log" | tail -n 5 >&2
             die "export to CTranslate2 failed (log: $OUT_DIR/export.log)"; }
    grep -v -e '^INFO' -e tensorboardX "$OUT_DIR/export.log" | tail -n 1 | sed 's/^/[evaluate] /' >&2

    # 2. decode the BPE'd source: tokenized hypotheses, BPE removed as fairseq-generate does
    DEVICE=cpu
    if [[ "$CPU" == 0 ]]; then
        DEVICE=cuda
        if [[ -z "$COMPUTE_TYPE" && "$FP16" != 0 ]]; then COMPUTE_TYPE=float16; fi
    fi
    log "translating $SUBSET with $CT2_DIR (ctranslate2 on $DEVICE, beam $BEAM, lenpen $LENPEN)"
    fairseq-rope-translate --engine ctranslate2 --model-dir "$CT2_DIR" --data-bin "$DATA_BIN" \
        --src "$SRC" --tgt "$TGT" --input-format bpe --output-format tok --beam "$BEAM" --lenpen "$LENPEN" \
        --batch-size "$BATCH_SIZE" --device "$DEVICE" --compute-type "${COMPUTE_TYPE:-default}" \
        ${THREADS:+--threads "$THREADS"} --stats-json "$OUT_DIR/speed.json" \
        --output "$OUT_DIR/hyp.tok.$TGT" "$BPE_SRC" 2> "$OUT_DIR/translate.log" \
        || { tail -n 5 "$OUT_DIR/translate.log" >&2; die "CTranslate2 decoding failed (log: $OUT_DIR/translate.log)"; }
    grep -h '^\[translate\] length buckets' "$OUT_DIR/translate.log" | sed 's/^\[translate\]/[evaluate]/' >&2 || true
    python - "$OUT_DIR/speed.json" > "$OUT_DIR/speed.txt" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"ctranslate2: {s['sentences']} sentences in {s['seconds']:.2f} s of decoding, "
      f"{s['sentences_per_second'] or 0:.2f} sentences/s (beam {s['beam']}, threads {s['threads']})")
PY
fi
n_hyp=$(wc -l < "$OUT_DIR/hyp.tok.$TGT")
[[ "$n_hyp" -eq "$n_ref" ]] || die "$n_hyp hypotheses but $n_ref reference lines in $REF_TOK"

fairseq-rope-score --hyp "$OUT_DIR/hyp.tok.$TGT" --ref "$REF_TOK" --raw-ref "$REF_RAW" \
    --lang "$TGT" --detok-out "$OUT_DIR/hyp.detok.$TGT" --out-json "$OUT_DIR/scores.json.part" \
    | tee "$OUT_DIR/scores.txt"
mv "$OUT_DIR/scores.json.part" "$OUT_DIR/scores.json"
log "hypotheses and scores in $OUT_DIR"
