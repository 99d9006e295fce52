#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv inside the checkout and install everything
# fairseq-rope needs, idempotently: a second run skips what is already installed.
#
# Order matters on Python 3.11 (see docs/usage.md, "Install"):
#   torch -> numpy + cython -> fairseq-fixed (no build isolation, no deps) -> fairseq's runtime
#   deps by name -> tokenisers, scoring, plotting, the service's aiohttp and prometheus-client (the serve extra) ->
#   Triton -> this package (a regular install).
# Into an environment that already has torch and fairseq, `pip install .` is enough instead
# (docs/usage.md, "Into an existing environment").
# A torch already present in the venv (for example a CUDA build a GPU user installed first) is
# kept and pinned, so no later step can pull a second torch; so is the Triton it brought.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" setup
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
FAIRSEQ_SPEC="${FAIRSEQ_SPEC:-fairseq-fixed==0.12.3.1}"
STAMP="$VENV/.fairseq_rope_installed"
# Used only when torch's metadata names no Triton (the CPU wheel): the version that the CUDA build
# of torch 2.13 requires, so the kernel is tested with the Triton GPU users run it with.
TRITON_FALLBACK_SPEC="${TRITON_FALLBACK_SPEC:-triton==3.9.0}"

log() { printf '[setup] %s\n' "$*"; }  # on stdout, not common.sh's stderr: make setup's own report

if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating virtual environment $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }
# Triton ships wheels for Linux only; elsewhere the fused rotation is simply unavailable.
triton_wanted() { [[ "$(uname -s)" == Linux ]]; }
complete_check() {
    if triton_wanted; then "$PY" -c "import fairseq, fairseq_rope, fairseq_rope_tools, aiohttp, prometheus_client, triton"; else "$PY" -c "import fairseq, fairseq_rope, fairseq_rope_tools, aiohttp, prometheus_client"; fi
}

# The stamp records the inputs of the last complete install (this script, pyproject.toml and
# the packages' sources, the recipe's installed copy included); same inputs -> nothing to do.
WANT="$(cd "$ROOT" && cat pyproject.toml scripts/setup_env.sh $(find fairseq_rope fairseq_rope_tools examples -name '*.py' -o -name '*.sh' | LC_ALL=C sort) | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] && complete_check 2>/dev/null; then
    log "environment $VENV is complete; nothing to install"
    exit 0
fi

if "$PY" -c "import torch" 2>/dev/null; then
    log "keeping installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
    log "installing $TORCH_SPEC"
    pip_install "$TORCH_SPEC"
fi
# Pin the torch we have: no later requirement may replace it or pull a CUDA build.
CONSTRAINTS="$VENV/torch-constraint.txt"
"$PY" -c 'import torch; print("torch==" + torch.__version__)' > "$CONSTRAINTS"

pip_install -c "$CONSTRAINTS" numpy cython setuptools wheel

if "$PY" -c "import fairseq" 2>/dev/null; then
    log "fairseq already installed"
else
    log "building $FAIRSEQ_SPEC (compiles C++/Cython extensions; a few minutes on 2 cores, cached by pip afterwards)"
    pip_install -c "$CONSTRAINTS" --no-build-isolation --no-deps "$FAIRSEQ_SPEC"
fi

log "installing fairseq runtime dependencies and tools"
pip_install -c "$CONSTRAINTS" \
    hydra-core==1.3.2 omegaconf==2.3.0 bitarray sacrebleu regex "tqdm>=4.66" cffi scikit-learn \
    sentencepiece subword-nmt sacremoses "sentencex>=1.0" matplotlib pytest pytest-xdist ruff "ctranslate2>=4.6.3,<5" \
    "onnxruntime>=1.17" "onnx>=1.15" "aiohttp>=3.9,<4" "prometheus-client>=0.17"

# Triton runs the fused rotation: compiled on CUDA, and in the tests under its interpreter
# (TRITON_INTERPRET=1) on CPU tensors, which also compiles it ahead of time for sm_80/sm_90.
# A CUDA build of torch requires one exact Triton and names it in its metadata: that one is
# installed. The CPU wheel names none; then TRITON_FALLBACK_SPEC, the version CUDA torch 2.13
# requires. --no-deps and the torch constraint: Triton never brings a second torch. A Triton
# already installed (the one a GPU user's CUDA torch brought) is kept.
if ! triton_wanted; then
    log "no Triton wheels for $(uname -s): the fused rotation kernel stays unavailable"
elif "$PY" -c "import triton" 2>/dev/null; then
    log "keeping installed triton $("$PY" -c 'import triton; print(triton.__version__)')"
else
    TRITON_SPEC="$("$PY" - <<'PYTHON'
import importlib.metadata
import re

for requirement in importlib.metadata.requires("torch") or []:
    match = re.match(r"\s*triton\s*==\s*([^\s;,]+)", requirement, re.IGNORECASE)
    if match:
        print("triton==" + match.group(1))
        break
PYTHON
)"
    TRITON_SPEC="${TRITON_SPEC:-$TRITON_FALLBACK_SPEC}"
    log "installing $TRITON_SPEC (about 285 MB)"
    pip_install -c "$CONSTRAINTS" --no-deps "$TRITON_SPEC"
fi

# A regular (not editable) install of the plugin fairseq_rope/, the tools' fairseq_rope_tools/
# and their fairseq-rope-* commands (fairseq-rope-user-dir: the plugin's directory for --user-dir).
# --no-deps: the steps above installed what pyproject.toml lists, and what fairseq needs, which it
# does not list (tests/e2e/test_install.py checks that nothing is missing).
log "installing fairseq_rope and fairseq_rope_tools"
rm -rf "$ROOT/build"
pip_install -c "$CONSTRAINTS" --no-build-isolation --no-deps --force-reinstall "$ROOT"
rm -rf "$ROOT/build"

"$PY" -c "import torch, fairseq, fairseq_rope; print('[setup] torch', torch.__version__, '| fairseq', fairseq.__version__)"
echo "$WANT" > "$STAMP.tmp" && mv "$STAMP.tmp" "$STAMP"
log "done: $VENV"
