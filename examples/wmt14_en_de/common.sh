# What the recipe's scripts share. Sourced, never run: first thing after `set -euo pipefail`, with
# the name that prefixes the script's messages,
#   source "$(dirname "${BASH_SOURCE[0]}")/common.sh" NAME
# It sets HERE (this directory); ROOT, log, die and usage (scripts/common.sh); and the defaults
# every step agrees on, each an environment variable with the default shown below.
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/../../scripts/common.sh" "$1"

WORK_DIR="${WORK_DIR:-$ROOT/work/wmt14_en_de}"
dash_safe WORK_DIR
SRC="${SRC:-en}"
TGT="${TGT:-de}"
ARCH="${ARCH:-transformer_rope_wmt_en_de}"

# The data-bin prepare.sh writes and the checkpoints of ARCH. A function, so that a step which
# takes --work-dir derives them from its final WORK_DIR.
model_paths() {
    DATA_BIN="${DATA_BIN:-$WORK_DIR/data-bin}"
    SAVE_DIR="${SAVE_DIR:-$WORK_DIR/checkpoints/$ARCH}"
    dash_safe DATA_BIN SAVE_DIR
}
