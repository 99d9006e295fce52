#!/usr/bin/env bash
# Placeholder quickstart: replaced by the full offline pipeline (see examples/wmt14_en_de).
set -euo pipefail
echo "quickstart: not yet available" >&2
exit 1
