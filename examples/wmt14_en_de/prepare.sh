#!/usr/bin/env bash
# Prepare WMT14 English-German (the data of Vaswani et al. 2017 and the RoFormer paper), or any
# parallel corpus you bring, into a fairseq data-bin with a joint BPE vocabulary.
#
#   bash examples/wmt14_en_de/prepare.sh                       # download WMT14 (~1.6 GB) and prepare
#   bash examples/wmt14_en_de/prepare.sh --raw-dir /data/wmt14 # use the .tgz archives already there
#   bash examples/wmt14_en_de/prepare.sh --train-prefix c/train --valid-prefix c/valid \
#        --test-prefix c/test --src en --tgt de --work-dir work/mycorpus   # bring your own corpus
#
# WMT14 data: Europarl v7 + Common Crawl + News Commentary v9 (~4.5M pairs) for training,
# newstest2013 for validation, newstest2014 "full" (3003 sentences) for test. (fairseq's own
# examples/translation/prepare-wmt14en2de.sh builds WMT17 data unless given --icml17.)
#
# Steps, each in its own directory under WORK_DIR, skipped when already complete:
#   orig/      the five archives, verified with gzip -t and tar -t
#   raw/       extracted plain text train/valid/test.{SRC,TGT} (SGML stripped)
#   tok/       punctuation normalisation, non-printing characters removed, Moses tokenisation
#              with aggressive hyphen splitting (sacremoses)
#   clean/     training pairs with 1..250 tokens per side and length ratio <= 1.5
#   bpe/       joint BPE (subword-nmt, BPE_SIZE merges; or sentencepiece, BPE_SIZE pieces)
#   data-bin/  fairseq-preprocess --joined-dictionary
# A step builds into DIR.tmp and renames it to DIR after writing DIR.tmp/.done last, so an
# interrupted run never leaves a directory that a rerun would trust.
#
# Every option is also an environment variable (in brackets); flags win.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-python}"

WORK_DIR="${WORK_DIR:-$ROOT/work/wmt14_en_de}"
RAW_DIR="${RAW_DIR:-}"               # directory holding the WMT14 .tgz archives (no download)
SRC="${SRC:-en}"
TGT="${TGT:-de}"
TRAIN_PREFIX="${TRAIN_PREFIX:-}"     # bring your own corpus: PREFIX.SRC and PREFIX.TGT files
VALID_PREFIX="${VALID_PREFIX:-}"
TEST_PREFIX="${TEST_PREFIX:-}"
BPE="${BPE:-subword-nmt}"            # subword-nmt | sentencepiece
BPE_SIZE="${BPE_SIZE:-40000}"        # subword-nmt merges / sentencepiece vocabulary size
BPE_VOCAB_THRESHOLD="${BPE_VOCAB_THRESHOLD:-50}"  # subword-nmt apply-bpe --vocabulary-threshold
TOKENIZE="${TOKENIZE:-1}"            # 0: the text is already tokenized; only copy it
CLEAN_MIN="${CLEAN_MIN:-1}"
CLEAN_MAX="${CLEAN_MAX:-250}"
CLEAN_RATIO="${CLEAN_RATIO:-1.5}"
WORKERS="${WORKERS:-$(nproc 2>/dev/null || echo 1)}"
WMT14_URL="${WMT14_URL:-https://www.statmt.org/wmt14}"
WMT13_URL="${WMT13_URL:-https://www.statmt.org/wmt13}"

usage() { sed -n '2,28p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
die() { printf '[prepare] error: %s\n' "$*" >&2; exit 1; }
log() { printf '[prepare] %s\n' "$*" >&2; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --work-dir) WORK_DIR="$2"; shift 2 ;;
        --raw-dir) RAW_DIR="$2"; shift 2 ;;
        --src) SRC="$2"; shift 2 ;;
        --tgt) TGT="$2"; shift 2 ;;
        --train-prefix) TRAIN_PREFIX="$2"; shift 2 ;;
        --valid-prefix) VALID_PREFIX="$2"; shift 2 ;;
        --test-prefix) TEST_PREFIX="$2"; shift 2 ;;
        --bpe) BPE="$2"; shift 2 ;;
        --bpe-size) BPE_SIZE="$2"; shift 2 ;;
        --bpe-vocab-threshold) BPE_VOCAB_THRESHOLD="$2"; shift 2 ;;
        --no-tokenize) TOKENIZE=0; shift ;;
        --workers) WORKERS="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown option '$1' (see --help)" ;;
    esac
done

case "$BPE" in subword-nmt|sentencepiece) ;; *) die "--bpe must be subword-nmt or sentencepiece, not '$BPE'" ;; esac
[[ "$BPE_SIZE" =~ ^[0-9]+$ ]] || die "--bpe-size must be a number, not '$BPE_SIZE'"
[[ "$SRC" != "$TGT" ]] || die "--src and --tgt must differ"
BYO=0
if [[ -n "$TRAIN_PREFIX$VALID_PREFIX$TEST_PREFIX" ]]; then
    [[ -n "$TRAIN_PREFIX" && -n "$VALID_PREFIX" && -n "$TEST_PREFIX" ]] \
        || die "bring-your-own corpus needs all of --train-prefix, --valid-prefix and --test-prefix"
    [[ -z "$RAW_DIR" ]] || die "--raw-dir (WMT14 archives) and --train-prefix (your corpus) exclude each other"
    BYO=1
elif [[ "$SRC-$TGT" != "en-de" && "$SRC-$TGT" != "de-en" ]]; then
    die "WMT14 En-De needs --src/--tgt en/de or de/en (got $SRC/$TGT); use --train-prefix ... for other pairs"
fi
mkdir -p "$WORK_DIR"
WORK_DIR="$(cd "$WORK_DIR" && pwd)"
TOOLS="$HERE/text_tools.py"

# --- step bookkeeping -----------------------------------------------------------------------
is_done() { [[ -f "$1/.done" ]]; }
begin() { rm -rf "$1.tmp"; mkdir -p "$1.tmp"; }
commit() { date -u +%FT%TZ > "$1.tmp/.done"; rm -rf "$1"; mv "$1.tmp" "$1"; }
lines() { wc -l < "$1" | tr -d ' '; }
same_length() {  # same_length A B: both files exist and have the same number of lines
    [[ -s "$1" ]] || die "missing or empty file $1"
    [[ -s "$2" ]] || die "missing or empty file $2"
    [[ "$(lines "$1")" == "$(lines "$2")" ]] \
        || die "$1 ($(lines "$1") lines) and $2 ($(lines "$2") lines) are not parallel"
}

# --- WMT14 archives: name | URL | members (SRC/TGT files use {L} for the language) ----------
ARCHIVES=(training-parallel-europarl-v7.tgz training-parallel-commoncrawl.tgz
          training-parallel-nc-v9.tgz dev.tgz test-full.tgz)
archive_url() {
    case "$1" in
        training-parallel-europarl-v7.tgz|training-parallel-commoncrawl.tgz) echo "$WMT13_URL/$1" ;;
        *) echo "$WMT14_URL/$1" ;;
    esac
}
TRAIN_MEMBERS=(training/europarl-v7.de-en commoncrawl.de-en training/news-commentary-v9.de-en)
VALID_MEMBER=dev/newstest2013
# newstest2014 full: the source side of the en->de direction is ...-src.en.sgm, its reference
# ...-ref.de.sgm (and the other way round for de->en)
test_member() { if [[ "$1" == "$SRC" ]]; then echo "test-full/newstest2014-deen-src.$1.sgm"; else echo "test-full/newstest2014-deen-ref.$1.sgm"; fi; }

verify_archive() {  # verify_archive FILE: gzip and tar both read it to the end
    local f="$1"
    if ! gzip -t "$f" 2>/dev/null || ! tar -tzf "$f" >/dev/null 2>&1; then
        return 1
    fi
}

download() {
    local name="$1" url dest part
    url="$(archive_url "$name")"
    dest="$WORK_DIR/orig/$name"
    part="$dest.part"
    log "downloading $url"
    if command -v curl >/dev/null; then
        curl -fL --retry 3 --connect-timeout 30 -o "$part" "$url" || { rm -f "$part"; die "download of $url failed; check your connection and rerun, or download it yourself and pass --raw-dir DIR"; }
    elif command -v wget >/dev/null; then
        wget -q -O "$part" "$url" || { rm -f "$part"; die "download of $url failed; check your connection and rerun, or download it yourself and pass --raw-dir DIR"; }
    else
        die "neither curl nor wget is installed: download $url yourself and pass --raw-dir DIR"
    fi
    verify_archive "$part" || { rm -f "$part"; die "downloaded $name from $url is corrupt or truncated; rerun to download it again"; }
    mv "$part" "$dest"
}

# --- step 1: archives -> raw text -----------------------------------------------------------
step_raw() {
    local raw="$WORK_DIR/raw"
    if is_done "$raw"; then log "raw: complete, skipping ($raw)"; return; fi
    begin "$raw"
    if [[ "$BYO" == 1 ]]; then
        log "raw: copying your corpus ($TRAIN_PREFIX, $VALID_PREFIX, $TEST_PREFIX)"
        local split prefix
        for split in train valid test; do
            case "$split" in train) prefix="$TRAIN_PREFIX" ;; valid) prefix="$VALID_PREFIX" ;; test) prefix="$TEST_PREFIX" ;; esac
            same_length "$prefix.$SRC" "$prefix.$TGT"
            cp "$prefix.$SRC" "$raw.tmp/$split.$SRC"
            cp "$prefix.$TGT" "$raw.tmp/$split.$TGT"
        done
        commit "$raw"
        return
    fi
    local name archive dir
    mkdir -p "$WORK_DIR/orig"
    for name in "${ARCHIVES[@]}"; do
        if [[ -n "$RAW_DIR" ]]; then
            archive="$RAW_DIR/$name"
            [[ -f "$archive" ]] || die "--raw-dir $RAW_DIR has no $name (download it from $(archive_url "$name"))"
            log "checking $archive"
            verify_archive "$archive" || die "archive $archive is corrupt or truncated (gzip/tar cannot read it to the end); download it again from $(archive_url "$name")"
        else
            archive="$WORK_DIR/orig/$name"
            if [[ -f "$archive" ]]; then
                verify_archive "$archive" || die "archive $archive is corrupt or truncated; delete it and rerun to download it again"
            else
                download "$name"
            fi
        fi
    done
    dir="${RAW_DIR:-$WORK_DIR/orig}"
    local ex="$raw.tmp/extract" m l
    mkdir -p "$ex"
    extract() {  # extract ARCHIVE MEMBER...
        local a="$dir/$1"; shift
        log "extracting $* from $a"
        tar -xzf "$a" -C "$ex" "$@" 2>"$ex/tar.err" \
            || die "cannot extract $* from $a: $(tail -n 2 "$ex/tar.err" | tr '\n' ' ')(is it the WMT14 archive?)"
    }
    extract training-parallel-europarl-v7.tgz "${TRAIN_MEMBERS[0]}".{de,en}
    extract training-parallel-commoncrawl.tgz "${TRAIN_MEMBERS[1]}".{de,en}
    extract training-parallel-nc-v9.tgz "${TRAIN_MEMBERS[2]}".{de,en}
    extract dev.tgz "$VALID_MEMBER".{de,en}
    extract test-full.tgz "$(test_member "$SRC")" "$(test_member "$TGT")"
    for l in "$SRC" "$TGT"; do
        : > "$raw.tmp/train.$l"
        for m in "${TRAIN_MEMBERS[@]}"; do
            cat "$ex/$m.$l" >> "$raw.tmp/train.$l"
        done
        cp "$ex/$VALID_MEMBER.$l" "$raw.tmp/valid.$l"
        "$PYTHON" "$TOOLS" sgm2txt "$ex/$(test_member "$l")" "$raw.tmp/test.$l"
    done
    for m in "${TRAIN_MEMBERS[@]}"; do same_length "$ex/$m.$SRC" "$ex/$m.$TGT"; done
    for split in train valid test; do same_length "$raw.tmp/$split.$SRC" "$raw.tmp/$split.$TGT"; done
    rm -rf "$ex"
    log "raw: train $(lines "$raw.tmp/train.$SRC"), valid $(lines "$raw.tmp/valid.$SRC"), test $(lines "$raw.tmp/test.$SRC") pairs"
    commit "$raw"
}

# --- step 2: normalise + tokenise -----------------------------------------------------------
step_tok() {
    local tok="$WORK_DIR/tok" split l
    if is_done "$tok"; then log "tok: complete, skipping ($tok)"; return; fi
    begin "$tok"
    for split in train valid test; do
        for l in "$SRC" "$TGT"; do
            if [[ "$TOKENIZE" == 1 ]]; then
                "$PYTHON" "$TOOLS" tokenize --lang "$l" --workers "$WORKERS" "$WORK_DIR/raw/$split.$l" "$tok.tmp/$split.$l"
            else
                cp "$WORK_DIR/raw/$split.$l" "$tok.tmp/$split.$l"
            fi
        done
        same_length "$tok.tmp/$split.$SRC" "$tok.tmp/$split.$TGT"
    done
    commit "$tok"
}

# --- step 3: clean the training data --------------------------------------------------------
step_clean() {
    local clean="$WORK_DIR/clean"
    if is_done "$clean"; then log "clean: complete, skipping ($clean)"; return; fi
    begin "$clean"
    "$PYTHON" "$TOOLS" clean --src "$SRC" --tgt "$TGT" --min "$CLEAN_MIN" --max "$CLEAN_MAX" \
        --ratio "$CLEAN_RATIO" "$WORK_DIR/tok/train" "$clean.tmp/train"
    same_length "$clean.tmp/train.$SRC" "$clean.tmp/train.$TGT"
    commit "$clean"
}

# --- step 4: joint BPE ----------------------------------------------------------------------
step_bpe() {
    local bpe="$WORK_DIR/bpe" split l input
    if is_done "$bpe"; then log "bpe: complete, skipping ($bpe)"; return; fi
    begin "$bpe"
    if [[ "$BPE" == subword-nmt ]]; then
        log "bpe: learning $BPE_SIZE joint subword-nmt merges"
        subword-nmt learn-joint-bpe-and-vocab --input "$WORK_DIR/clean/train.$SRC" "$WORK_DIR/clean/train.$TGT" \
            -s "$BPE_SIZE" -o "$bpe.tmp/codes" \
            --write-vocabulary "$bpe.tmp/vocab.$SRC" "$bpe.tmp/vocab.$TGT"
    else
        log "bpe: learning a $BPE_SIZE-piece joint sentencepiece model"
        "$PYTHON" "$TOOLS" spm-train --vocab-size "$BPE_SIZE" --model-prefix "$bpe.tmp/spm" \
            --workers "$WORKERS" "$WORK_DIR/clean/train.$SRC" "$WORK_DIR/clean/train.$TGT"
    fi
    for split in train valid test; do
        for l in "$SRC" "$TGT"; do
            if [[ "$split" == train ]]; then input="$WORK_DIR/clean/train.$l"; else input="$WORK_DIR/tok/$split.$l"; fi
            log "bpe: applying to $split.$l"
            if [[ "$BPE" == subword-nmt ]]; then
                subword-nmt apply-bpe -c "$bpe.tmp/codes" --vocabulary "$bpe.tmp/vocab.$l" \
                    --vocabulary-threshold "$BPE_VOCAB_THRESHOLD" --num-workers "$WORKERS" \
                    < "$input" > "$bpe.tmp/$split.$l"
            else
                "$PYTHON" "$TOOLS" spm-encode --model "$bpe.tmp/spm.model" "$input" "$bpe.tmp/$split.$l"
            fi
        done
        same_length "$bpe.tmp/$split.$SRC" "$bpe.tmp/$split.$TGT"
    done
    commit "$bpe"
}

# --- step 5: binarize -----------------------------------------------------------------------
step_binarize() {
    local bin="$WORK_DIR/data-bin"
    if is_done "$bin"; then log "data-bin: complete, skipping ($bin)"; return; fi
    rm -rf "$bin.tmp"
    log "data-bin: fairseq-preprocess --joined-dictionary"
    fairseq-preprocess --source-lang "$SRC" --target-lang "$TGT" \
        --trainpref "$WORK_DIR/bpe/train" --validpref "$WORK_DIR/bpe/valid" --testpref "$WORK_DIR/bpe/test" \
        --destdir "$bin.tmp" --joined-dictionary --workers "$WORKERS" > "$WORK_DIR/preprocess.log" 2>&1 \
        || { tail -n 20 "$WORK_DIR/preprocess.log" >&2; die "fairseq-preprocess failed (log: $WORK_DIR/preprocess.log)"; }
    # what evaluate.sh needs to undo the segmentation
    if [[ "$BPE" == subword-nmt ]]; then
        echo subword_nmt > "$bin.tmp/bpe_type"; cp "$WORK_DIR/bpe/codes" "$bin.tmp/bpe.codes"
    else
        echo sentencepiece > "$bin.tmp/bpe_type"; cp "$WORK_DIR/bpe/spm.model" "$bin.tmp/spm.model"
    fi
    commit "$bin"
}

command -v fairseq-preprocess >/dev/null || die "fairseq-preprocess not on PATH: run 'make setup' and put .venv/bin first on PATH"
command -v subword-nmt >/dev/null || [[ "$BPE" != subword-nmt ]] || die "subword-nmt not on PATH: run 'make setup' and put .venv/bin first on PATH"
log "work dir $WORK_DIR ($SRC->$TGT, $BPE $BPE_SIZE)"
step_raw
step_tok
step_clean
step_bpe
step_binarize
log "done: $WORK_DIR/data-bin"
