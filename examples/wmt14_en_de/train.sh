#!/usr/bin/env bash
# Train a Transformer-base with RoPE (transformer_rope_wmt_en_de) on prepared WMT14 En-De, with the
# hyper-parameters of Vaswani et al. (2017) that the RoFormer paper keeps:
#   Adam (0.9, 0.98), lr 5e-4, linear warm-up from 1e-7 over 4000 updates, inverse square root
#   decay, label smoothing 0.1, dropout 0.1, shared embeddings, ~25k target tokens per update.
#
#   bash examples/wmt14_en_de/train.sh                                  # RoPE
#   ARCH=transformer_wmt_en_de bash examples/wmt14_en_de/train.sh       # sinusoidal baseline
#   bash examples/wmt14_en_de/train.sh --rope-theta 20000               # extra args go to fairseq-train
#   CONCAT_MAX_SENTENCES=3 bash examples/wmt14_en_de/train.sh           # concatenation training, for long inputs
#   INIT_FROM=wmt_model/model.pt MAX_UPDATE=5000 bash examples/wmt14_en_de/train.sh  # start from a trained model
#
# The batch: MAX_TOKENS per GPU x GPUs x UPDATE_FREQ ~= TOKENS_PER_UPDATE. UPDATE_FREQ is computed
# from the number of GPUs (all visible ones, times NNODES) unless you set it. --fp16 on GPU.
# Multi-node: run this script on every node with NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT
# set; it starts one process per GPU with torchrun and fairseq's env:// initialisation.
# Every knob below is an environment variable with the default shown; so are WORK_DIR, SRC, TGT,
# ARCH, DATA_BIN and SAVE_DIR (common.sh).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" train
model_paths

MAX_TOKENS="${MAX_TOKENS:-4096}"
TOKENS_PER_UPDATE="${TOKENS_PER_UPDATE:-25000}"
LR="${LR:-5e-4}"
WARMUP_UPDATES="${WARMUP_UPDATES:-4000}"
WARMUP_INIT_LR="${WARMUP_INIT_LR:-1e-07}"
DROPOUT="${DROPOUT:-0.1}"
LABEL_SMOOTHING="${LABEL_SMOOTHING:-0.1}"
WEIGHT_DECAY="${WEIGHT_DECAY:-0.0}"
CLIP_NORM="${CLIP_NORM:-0.0}"
MAX_UPDATE="${MAX_UPDATE:-100000}"         # Vaswani base: 100k updates (12 h on 8 P100)
SAVE_INTERVAL_UPDATES="${SAVE_INTERVAL_UPDATES:-2000}"
KEEP_INTERVAL_UPDATES="${KEEP_INTERVAL_UPDATES:-10}"   # keep enough for average.sh (last 5)
LOG_INTERVAL="${LOG_INTERVAL:-100}"
# concatenation training (--task translation_concat, docs/position_encodings.md): K > 1 joins a
# CONCAT_PROB share of the training pairs with 1 to K - 1 others, drawn anew every epoch, from
# epoch CONCAT_FROM_EPOCH on (the epochs before it: the pairs alone); 1: off
CONCAT_MAX_SENTENCES="${CONCAT_MAX_SENTENCES:-1}"
CONCAT_PROB="${CONCAT_PROB:-0.5}"
CONCAT_FROM_EPOCH="${CONCAT_FROM_EPOCH:-1}"
SEED="${SEED:-1}"
INIT_FROM="${INIT_FROM:-}"                 # a checkpoint to start from (--finetune-from-model), e.g. a sinusoidal model
NUM_WORKERS="${NUM_WORKERS:-1}"            # fairseq data-loader workers
CPU="${CPU:-auto}"                         # auto: CPU when no GPU is visible; 1: force CPU
FP16="${FP16:-auto}"                       # auto: --fp16 on GPU
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
LOG_FILE="${LOG_FILE:-$SAVE_DIR/train.log}"

[[ -f "$DATA_BIN/dict.$SRC.txt" && -f "$DATA_BIN/train.$SRC-$TGT.$TGT.bin" ]] \
    || die "no binarized $SRC-$TGT data in $DATA_BIN: run examples/wmt14_en_de/prepare.sh first (or set DATA_BIN)"
[[ "$CONCAT_MAX_SENTENCES" =~ ^[1-9][0-9]*$ ]] \
    || die "CONCAT_MAX_SENTENCES must be a whole number K >= 1 (1: no concatenation training), got '$CONCAT_MAX_SENTENCES'"
[[ "$CONCAT_FROM_EPOCH" =~ ^[1-9][0-9]*$ ]] \
    || die "CONCAT_FROM_EPOCH must be an epoch number >= 1, got '$CONCAT_FROM_EPOCH'"
[[ -z "$INIT_FROM" || -f "$INIT_FROM" ]] \
    || die "INIT_FROM=$INIT_FROM is not a file: give a checkpoint (model.pt of a pretrained-model directory, an average, a checkpoint*.pt)"
command -v fairseq-train >/dev/null || die "fairseq-train not on PATH: run 'make setup' and put .venv/bin first on PATH"

[[ "$CPU" != 1 ]] || GPUS="${GPUS:-0}"  # none to count: starting torch to count them takes seconds
GPUS="${GPUS:-$(python -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)}"
if [[ "$CPU" == auto ]]; then
    if [[ "$GPUS" -gt 0 ]]; then CPU=0; else CPU=1; fi
fi
DEVICE_ARGS=()
if [[ "$CPU" == 1 ]]; then
    DEVICES=1
    DEVICE_ARGS+=(--cpu)
    [[ "$FP16" == 1 ]] && die "FP16=1 needs a GPU"
else
    [[ "$GPUS" -gt 0 ]] || die "CPU=0 but no GPU is visible"
    DEVICES=$((GPUS * NNODES))
    if [[ "$FP16" != 0 ]]; then DEVICE_ARGS+=(--fp16); fi
fi
# --update-freq so that MAX_TOKENS x devices x UPDATE_FREQ ~= TOKENS_PER_UPDATE (at least 1)
UPDATE_FREQ="${UPDATE_FREQ:-$(( (TOKENS_PER_UPDATE + MAX_TOKENS * DEVICES / 2) / (MAX_TOKENS * DEVICES) ))}"
[[ "$UPDATE_FREQ" -ge 1 ]] || UPDATE_FREQ=1

# The plugin registers transformer_rope_*; it also allow-lists argparse.Namespace for torch's
# safe checkpoint loading, which resuming a stock-fairseq checkpoint under torch >= 2.6 needs too,
# so it is loaded for the baseline as well (it changes nothing in stock architectures).
USER_DIR_ARGS=(--user-dir "$(plugin_dir)")

TASK_ARGS=()
if [[ "$CONCAT_MAX_SENTENCES" -gt 1 ]]; then
    TASK_ARGS+=(--task translation_concat --concat-max-sentences "$CONCAT_MAX_SENTENCES" --concat-prob "$CONCAT_PROB"
                --concat-from-epoch "$CONCAT_FROM_EPOCH")
fi

ARGS=(
    "$DATA_BIN" --source-lang "$SRC" --target-lang "$TGT" "${TASK_ARGS[@]}"
    --arch "$ARCH" --share-all-embeddings
    --optimizer adam --adam-betas "(0.9, 0.98)" --adam-eps 1e-09 --clip-norm "$CLIP_NORM"
    --lr "$LR" --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP_UPDATES" --warmup-init-lr "$WARMUP_INIT_LR"
    --dropout "$DROPOUT" --weight-decay "$WEIGHT_DECAY"
    --criterion label_smoothed_cross_entropy --label-smoothing "$LABEL_SMOOTHING"
    --max-tokens "$MAX_TOKENS" --update-freq "$UPDATE_FREQ" --max-update "$MAX_UPDATE"
    --save-dir "$SAVE_DIR" --save-interval-updates "$SAVE_INTERVAL_UPDATES"
    --keep-interval-updates "$KEEP_INTERVAL_UPDATES" --no-epoch-checkpoints
    --log-format simple --log-interval "$LOG_INTERVAL" --seed "$SEED" --num-workers "$NUM_WORKERS"
    "${DEVICE_ARGS[@]}" "${USER_DIR_ARGS[@]}"
)
# fairseq takes the start only without a checkpoint_last.pt: a resume goes on from that
[[ -z "$INIT_FROM" ]] || ARGS+=(--finetune-from-model "$INIT_FROM")

mkdir -p "$SAVE_DIR"
if [[ -f "$SAVE_DIR/checkpoint_last.pt" ]]; then
    log "resuming from $SAVE_DIR/checkpoint_last.pt"
elif [[ -n "$INIT_FROM" ]]; then
    log "starting from the weights of $INIT_FROM (a fresh optimizer, learning-rate schedule and data order)"
fi
log "$ARCH on $( [[ "$CPU" == 1 ]] && echo CPU || echo "$DEVICES GPU(s)"): max-tokens $MAX_TOKENS x $DEVICES device(s) x update-freq $UPDATE_FREQ = $((MAX_TOKENS * DEVICES * UPDATE_FREQ)) tokens per update; log $LOG_FILE"
if [[ "$CONCAT_MAX_SENTENCES" -gt 1 ]]; then
    log "concatenation training: a share $CONCAT_PROB of the training pairs joined with 1 to $((CONCAT_MAX_SENTENCES - 1)) others, from epoch $CONCAT_FROM_EPOCH"
fi
if [[ "$NNODES" -gt 1 ]]; then
    command -v torchrun >/dev/null || die "torchrun not on PATH (it comes with torch)"
    torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS" \
        --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
        -m fairseq_cli.train "${ARGS[@]}" "$@" 2>&1 | tee -a "$LOG_FILE"
else
    fairseq-train "${ARGS[@]}" "$@" 2>&1 | tee -a "$LOG_FILE"
fi
