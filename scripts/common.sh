# What the scripts in scripts/ share. Sourced, never run: first
# thing after `set -euo pipefail`, with the name that prefixes the script's messages,
#   source "$(dirname "${BASH_SOURCE[0]}")/common.sh" NAME
# (always with NAME: without arguments, bash would hand this file the script's own). It sets
#   ROOT    the checkout (the parent of scripts/)
#   log     "[NAME] MESSAGE" on stderr
#   die     "[NAME] error: MESSAGE" on stderr, then exit 1
#   usage   the script's header comment: its lines after the #! line, up to the first that is
#           not a comment
#   dash_safe VAR...  make each named variable's path ./-x if it is -x, so that no command
#           (mkdir, cd, cp, ...) takes a path that starts with "-" for one of its options
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MESSAGE_NAME="$1"

log() { printf '[%s] %s\n' "$MESSAGE_NAME" "$*" >&2; }
die() { printf '[%s] error: %s\n' "$MESSAGE_NAME" "$*" >&2; exit 1; }
usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }
dash_safe() { local var; for var in "$@"; do [[ "${!var}" != -* ]] || printf -v "$var" './%s' "${!var}"; done; }
