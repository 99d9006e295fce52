#!/usr/bin/env bash
# The whole WMT14 En-De recipe in order: prepare -> train -> average -> evaluate.
# Every step skips work that is already complete, so rerunning after an interruption resumes.
#
#   bash examples/wmt14_en_de/run_all.sh                         # RoPE (transformer_rope_wmt_en_de)
#   ARCH=transformer_wmt_en_de bash examples/wmt14_en_de/run_all.sh   # sinusoidal baseline
#   bash examples/wmt14_en_de/run_all.sh --raw-dir /data/wmt14   # arguments go to prepare.sh
#
# Knobs: those of prepare.sh, train.sh, average.sh and evaluate.sh (all environment variables);
# TRAIN_ARGS adds fairseq-train arguments, e.g. TRAIN_ARGS="--rope-theta 20000".
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" run_all
export ARCH  # with its default from common.sh: every step works on the same model
read -r -a EXTRA <<< "${TRAIN_ARGS:-}"
bash "$HERE/prepare.sh" "$@"
bash "$HERE/train.sh" "${EXTRA[@]}"
bash "$HERE/average.sh"
bash "$HERE/evaluate.sh"
