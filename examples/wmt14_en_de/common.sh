# What the recipe's scripts share. Sourced, never run: first thing after `set -euo pipefail`, with
# the name that prefixes the script's messages,
#   source "$(dirname "${BASH_SOURCE[0]}")/common.sh" NAME
# It sets
#   HERE    this directory
#   ROOT    the checkout, where work/ goes by default (the current directory for the copy of the
#           recipe installed with the tools, which run it with every path given)
#   log     "[NAME] MESSAGE" on stderr
#   die     "[NAME] error: MESSAGE" on stderr, then exit 1
#   usage   the script's header comment: its lines after the #! line, up to the first that is
#           not a comment
#   dash_safe VAR...  make each named variable's path ./-x if it is -x, so that no command
#           (mkdir, cd, cp, ...) takes a path that starts with "-" for one of its options
#   plugin_dir  prints the plugin's directory, for fairseq's --user-dir: `fairseq-rope-user-dir`,
#           the form the docs give, with the recipe's message when it is not installed
#   TQDM_DISABLE=1, exported when stderr is not a terminal (below)
# and the defaults every step agrees on, each an environment variable with the default shown below.
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
[[ -d "$ROOT/examples" ]] || ROOT="$PWD"
MESSAGE_NAME="$1"

log() { printf '[%s] %s\n' "$MESSAGE_NAME" "$*" >&2; }
die() { printf '[%s] error: %s\n' "$MESSAGE_NAME" "$*" >&2; exit 1; }
usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }
dash_safe() { local var; for var in "$@"; do [[ "${!var}" != -* ]] || printf -v "$var" './%s' "${!var}"; done; }
# A tqdm progress bar (subword-nmt learn-joint-bpe-and-vocab's, ...) redraws one line with
# carriage returns: in a log, one endless line. Unless stderr is a terminal, the steps run with
# tqdm off (tqdm >= 4.66 reads TQDM_DISABLE) and say their progress in plain lines instead.
[[ -t 2 ]] || export TQDM_DISABLE=1

plugin_dir() {
    command -v fairseq-rope-user-dir >/dev/null \
        || die "fairseq-rope-user-dir not on PATH: run 'make setup' and put .venv/bin first on PATH"
    fairseq-rope-user-dir
}

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
