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
# Steps, each in its own directory under WORK_DIR, skipped when already complete for the same
# inputs and options:
#   orig/      the five archives, verified with gzip -t and tar -t
#   raw/       extracted plain text train/valid/test.{SRC,TGT} (SGML stripped), one sentence per
#              line: split only at \n, a CRLF end read as \n, and \r, \v, \f, \x1c-\x1e, U+0085,
#              U+2028, U+2029 inside a line replaced by a space; strictly UTF-8 (an invalid byte
#              stops the script with the file and line, unless --replace-invalid-utf8)
#   tok/       punctuation normalisation, non-printing characters removed, Moses tokenisation
#              with aggressive hyphen splitting (sacremoses)
#   clean/     training pairs with 1..250 tokens per side and length ratio <= 1.5
#   bpe/       joint BPE (subword-nmt, BPE_SIZE merges; or sentencepiece, BPE_SIZE pieces)
#   data-bin/  fairseq-preprocess --joined-dictionary
# A step builds into DIR.tmp and renames it to DIR after writing DIR.tmp/.done last, so an
# interrupted run never leaves a directory that a rerun would trust. DIR/.done records the
# options that shape the step and the size and sha256 of its input files; a rerun redoes a step
# whose record differs, saying why, and with it every later step. After every step both sides
# must still have as many lines as the step's input, or the script stops naming the files.
# Archive members are extracted only if they are regular files: a symbolic or hard link is
# refused, naming the archive and the member. One prepare.sh at a time works in a WORK_DIR: a
# second one stops, naming the first (WORK_DIR/.prepare.pid).
#
# Options, each also an environment variable (in brackets); flags win:
#   --work-dir DIR [WORK_DIR]          everything goes here (default work/wmt14_en_de)
#   --raw-dir DIR [RAW_DIR]            the WMT14 .tgz archives are already here: no download
#   --src L --tgt L [SRC, TGT]         source and target language (en, de)
#   --train-prefix P --valid-prefix P --test-prefix P [TRAIN_PREFIX, VALID_PREFIX, TEST_PREFIX]
#                                      bring your own corpus: the files P.SRC and P.TGT
#   --bpe KIND [BPE]                   subword-nmt (default) or sentencepiece
#   --bpe-size N [BPE_SIZE]            subword-nmt merges / sentencepiece pieces (40000)
#   --bpe-vocab-threshold N|auto [BPE_VOCAB_THRESHOLD]  subword-nmt apply-bpe threshold (auto:
#                                      50 with at least 400 training words per merge, else 0 = off)
#   --no-tokenize [TOKENIZE=0]         the text is already tokenized: only copy it
#   --clean-min MIN --clean-max MAX --clean-ratio R [CLEAN_MIN, CLEAN_MAX, CLEAN_RATIO]
#                                      training pairs kept: MIN..MAX tokens a side, length ratio
#                                      <= R (1, 250, 1.5)
#   --replace-invalid-utf8 [REPLACE_INVALID_UTF8=1]  replace invalid UTF-8 bytes in the input with
#                                      U+FFFD (reported per file) instead of stopping
#   --workers N [WORKERS]              processes (default: all cores)
#   [PROGRESS_INTERVAL]                seconds between the lines that say how many merges BPE
#                                      learning has reached (60)
#   [PYTHON, WMT14_URL, WMT13_URL]     the python to run, download mirrors
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" prepare   # HERE, ROOT, log, die, usage; WORK_DIR, SRC, TGT
PYTHON="${PYTHON:-python}"

RAW_DIR="${RAW_DIR:-}"               # directory holding the WMT14 .tgz archives (no download)
TRAIN_PREFIX="${TRAIN_PREFIX:-}"     # bring your own corpus: PREFIX.SRC and PREFIX.TGT files
VALID_PREFIX="${VALID_PREFIX:-}"
TEST_PREFIX="${TEST_PREFIX:-}"
BPE="${BPE:-subword-nmt}"            # subword-nmt | sentencepiece
BPE_SIZE="${BPE_SIZE:-40000}"        # subword-nmt merges / sentencepiece vocabulary size
BPE_VOCAB_THRESHOLD="${BPE_VOCAB_THRESHOLD:-auto}"  # subword-nmt apply-bpe --vocabulary-threshold
TOKENIZE="${TOKENIZE:-1}"            # 0: the text is already tokenized; only copy it
CLEAN_MIN="${CLEAN_MIN:-1}"
CLEAN_MAX="${CLEAN_MAX:-250}"
CLEAN_RATIO="${CLEAN_RATIO:-1.5}"
REPLACE_INVALID_UTF8="${REPLACE_INVALID_UTF8:-0}"  # 1: invalid UTF-8 -> U+FFFD instead of an error
WORKERS="${WORKERS:-$(nproc 2>/dev/null || echo 1)}"
PROGRESS_INTERVAL="${PROGRESS_INTERVAL:-60}"  # seconds between the progress lines of BPE learning
WMT14_URL="${WMT14_URL:-https://www.statmt.org/wmt14}"
WMT13_URL="${WMT13_URL:-https://www.statmt.org/wmt13}"

# an option's value: present, not empty, not the next option
need_value() {
    [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value (see --help)"
    [[ "$2" != --* ]] || die "$1 needs a value, not the option '$2' (a path that starts with '-' is written ./$2)"
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --work-dir) need_value "$@"; WORK_DIR="$2"; shift 2 ;;
        --raw-dir) need_value "$@"; RAW_DIR="$2"; shift 2 ;;
        --src) need_value "$@"; SRC="$2"; shift 2 ;;
        --tgt) need_value "$@"; TGT="$2"; shift 2 ;;
        --train-prefix) need_value "$@"; TRAIN_PREFIX="$2"; shift 2 ;;
        --valid-prefix) need_value "$@"; VALID_PREFIX="$2"; shift 2 ;;
        --test-prefix) need_value "$@"; TEST_PREFIX="$2"; shift 2 ;;
        --bpe) need_value "$@"; BPE="$2"; shift 2 ;;
        --bpe-size) need_value "$@"; BPE_SIZE="$2"; shift 2 ;;
        --bpe-vocab-threshold) need_value "$@"; BPE_VOCAB_THRESHOLD="$2"; shift 2 ;;
        --clean-min) need_value "$@"; CLEAN_MIN="$2"; shift 2 ;;
        --clean-max) need_value "$@"; CLEAN_MAX="$2"; shift 2 ;;
        --clean-ratio) need_value "$@"; CLEAN_RATIO="$2"; shift 2 ;;
        --workers) need_value "$@"; WORKERS="$2"; shift 2 ;;
        --no-tokenize) TOKENIZE=0; shift ;;
        --replace-invalid-utf8) REPLACE_INVALID_UTF8=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown option '$1' (see --help)" ;;
    esac
done

case "$BPE" in subword-nmt|sentencepiece) ;; *) die "--bpe (BPE) must be subword-nmt or sentencepiece, not '$BPE'" ;; esac
[[ "$BPE_SIZE" =~ ^[1-9][0-9]*$ ]] || die "--bpe-size (BPE_SIZE) must be a positive whole number, not '$BPE_SIZE'"
[[ "$BPE_VOCAB_THRESHOLD" == auto || "$BPE_VOCAB_THRESHOLD" =~ ^[0-9]+$ ]] \
    || die "--bpe-vocab-threshold (BPE_VOCAB_THRESHOLD) must be a whole number or auto, not '$BPE_VOCAB_THRESHOLD'"
[[ "$WORKERS" =~ ^[1-9][0-9]*$ ]] || die "--workers (WORKERS) must be a positive whole number, not '$WORKERS'"
[[ "$CLEAN_MIN" =~ ^[0-9]+$ ]] || die "--clean-min (CLEAN_MIN) must be a whole number, not '$CLEAN_MIN'"
[[ "$CLEAN_MAX" =~ ^[1-9][0-9]*$ ]] || die "--clean-max (CLEAN_MAX) must be a positive whole number, not '$CLEAN_MAX'"
(( 10#$CLEAN_MIN <= 10#$CLEAN_MAX )) || die "--clean-min ($CLEAN_MIN) must not exceed --clean-max ($CLEAN_MAX)"
[[ "$CLEAN_RATIO" =~ ^[0-9]+(\.[0-9]+)?$ && ! "$CLEAN_RATIO" =~ ^0+(\.0+)?$ ]] \
    || die "--clean-ratio (CLEAN_RATIO) must be a positive number such as 1.5, not '$CLEAN_RATIO'"
[[ "$TOKENIZE" == 0 || "$TOKENIZE" == 1 ]] || die "TOKENIZE must be 0 or 1, not '$TOKENIZE'"
[[ "$REPLACE_INVALID_UTF8" == 0 || "$REPLACE_INVALID_UTF8" == 1 ]] \
    || die "REPLACE_INVALID_UTF8 must be 0 or 1, not '$REPLACE_INVALID_UTF8'"
[[ "$SRC" =~ ^[A-Za-z0-9_-]+$ ]] || die "--src (SRC) must be a language code such as en, not '$SRC'"
[[ "$TGT" =~ ^[A-Za-z0-9_-]+$ ]] || die "--tgt (TGT) must be a language code such as de, not '$TGT'"
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
dash_safe WORK_DIR RAW_DIR TRAIN_PREFIX VALID_PREFIX TEST_PREFIX   # -x -> ./-x: a path, not an option
mkdir -p "$WORK_DIR"
WORK_DIR="$(cd "$WORK_DIR" && pwd)"

# --- one run per work dir -------------------------------------------------------------------
# Two runs on one WORK_DIR would rebuild the same step directories under each other. This shell
# holds an flock on WORK_DIR itself (descriptor 9), which the system releases when the last
# process holding the descriptor ends, a kill -9 included: a crashed run leaves no stale lock.
# WORK_DIR/.prepare.pid names the holder while it runs.
exec 9<"$WORK_DIR"
LOCK_STATUS=0
"$PYTHON" -c 'import fcntl, sys
try:
    fcntl.flock(9, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    sys.exit(3)' || LOCK_STATUS=$?
if [[ "$LOCK_STATUS" == 3 ]]; then
    die "another prepare.sh ($(head -n 1 "$WORK_DIR/.prepare.pid" 2>/dev/null || echo 'PID unknown')) is preparing $WORK_DIR: wait for it to finish or stop it, or give another --work-dir"
fi
[[ "$LOCK_STATUS" == 0 ]] || die "cannot lock $WORK_DIR with $PYTHON (status $LOCK_STATUS)"
PROGRESS_PID=""  # a step's progress reporter, stopped with the script whatever ends it
trap 'rm -f "$WORK_DIR/.prepare.pid"; [[ -z "$PROGRESS_PID" ]] || kill "$PROGRESS_PID" 2>/dev/null || true' EXIT
printf 'PID %s on %s\n' "$$" "$(hostname 2>/dev/null || uname -n)" > "$WORK_DIR/.prepare.pid"
export TEXT_TOOLS_PREFIX=prepare     # fairseq-rope-text errors read "[prepare] error: ..."
UTF8_ARGS=()
[[ "$REPLACE_INVALID_UTF8" == 0 ]] || UTF8_ARGS=(--replace-invalid-utf8)
tool() { "$PYTHON" -m fairseq_rope_tools.data.text_tools "$@"; }

# --- step bookkeeping -----------------------------------------------------------------------
RECORD=""
record() {  # record STEP DIR RECORD-ARGS...: sets RECORD (what DIR/.done is to hold) and STATUS
    local out
    out="$(tool record --step "$1" --marker "$2/.done" --base "$WORK_DIR" "${@:3}")" || exit 1
    STATUS="${out%%$'\n'*}"
    RECORD="${out#*$'\n'}"
}
up_to_date() {  # up_to_date STEP DIR RECORD-ARGS...: true (and says so) when DIR/.done records
                # exactly these options (--option K=V) and input files (--input KEY=PATH)
    record "$@"
    case "$STATUS" in
        same) log "$1: complete, skipping ($2)"; return 0 ;;
        new) return 1 ;;
        *) log "$1: $STATUS, rebuilding"; return 1 ;;
    esac
}
begin() { rm -rf "$1.tmp"; mkdir -p "$1.tmp"; }
commit() {
    { printf '%s\n' "$RECORD"; date -u '+# completed %FT%TZ'; } > "$1.tmp/.done"
    rm -rf "$1"; mv "$1.tmp" "$1"
}
nlines() {  # lines as the text tools count them: the "\n"s, plus a last line without one
    local n
    n="$(wc -l < "$1" | tr -d ' ')"
    if [[ -s "$1" && "$(tail -c 1 "$1" | od -An -tx1 | tr -d ' \n')" != 0a ]]; then n=$((n + 1)); fi
    echo "$n"
}
bpe_progress() {  # bpe_progress CODES: every PROGRESS_INTERVAL s, how many merges CODES holds
    # (subword-nmt writes each merge as it learns it, in buffered chunks); run in the background
    local started=$SECONDS n
    while sleep "$PROGRESS_INTERVAL" < /dev/null > /dev/null 2>&1 && kill -0 $$ 2>/dev/null; do
        n=0
        [[ ! -f "$1" ]] || n=$(wc -l < "$1")
        log "bpe: $(( n > 0 ? n - 1 : 0 )) of $BPE_SIZE merges learned after $(( SECONDS - started )) s"
    done
}
check_parallel() {  # check_parallel STEP A B: both exist, are not empty and have as many lines
    local a b
    [[ -s "$2" ]] || die "$1: missing or empty file $2"
    [[ -s "$3" ]] || die "$1: missing or empty file $3"
    a="$(nlines "$2")"; b="$(nlines "$3")"
    [[ "$a" == "$b" ]] || die "$1: $2 ($a lines) and $3 ($b lines) are not parallel"
}
check_lines() {  # check_lines STEP OUT N INPUT...: OUT has the N lines of its INPUT(s)
    local n
    n="$(nlines "$2")"
    [[ "$n" == "$3" ]] || die "$1: $2 has $n lines but its input (${*:4}) has $3; stopping"
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

# --- step 1: archives or your corpus -> raw text ----------------------------------------------
# normalize (fairseq-rope-text) is the first reader of your text: from here on every file has one
# sentence per line, split only at \n, strictly UTF-8, so no later tool can split a line in two.
split_prefix() { case "$1" in train) echo "$TRAIN_PREFIX" ;; valid) echo "$VALID_PREFIX" ;; test) echo "$TEST_PREFIX" ;; esac; }

step_raw() {
    local raw="$WORK_DIR/raw" split prefix l n
    local -a rec=(--option "SRC=$SRC" --option "TGT=$TGT" --option "REPLACE_INVALID_UTF8=$REPLACE_INVALID_UTF8")
    if [[ "$BYO" == 1 ]]; then
        rec+=(--option CORPUS=own)
        for split in train valid test; do
            prefix="$(split_prefix "$split")"
            for l in "$SRC" "$TGT"; do
                [[ -f "$prefix.$l" ]] || die "raw: your corpus has no file $prefix.$l"
                rec+=(--input "$split.$l=$prefix.$l")
            done
        done
        if up_to_date raw "$raw" "${rec[@]}"; then return; fi
        begin "$raw"
        log "raw: copying your corpus ($TRAIN_PREFIX, $VALID_PREFIX, $TEST_PREFIX)"
        for split in train valid test; do
            prefix="$(split_prefix "$split")"
            check_parallel raw "$prefix.$SRC" "$prefix.$TGT"
            n="$(nlines "$prefix.$SRC")"
            for l in "$SRC" "$TGT"; do
                tool normalize "${UTF8_ARGS[@]}" --output "$raw.tmp/$split.$l" "$prefix.$l"
                check_lines raw "$raw.tmp/$split.$l" "$n" "$prefix.$l"
            done
        done
        commit "$raw"
        return
    fi
    local name archive dir ex m
    local -a members
    dir="${RAW_DIR:-$WORK_DIR/orig}"
    rec+=(--option CORPUS=wmt14)
    # archives deleted since raw/ was built from them are taken to be the same ones
    for name in "${ARCHIVES[@]}"; do rec+=(--optional-input "$name=$dir/$name"); done
    if up_to_date raw "$raw" "${rec[@]}"; then return; fi
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
    record raw "$raw" "${rec[@]}"   # again, now that every archive is there
    begin "$raw"
    ex="$raw.tmp/extract"
    mkdir -p "$ex"
    extract() {  # extract ARCHIVE MEMBER...: regular files only (a link would copy any file of the machine)
        local a="$dir/$1"; shift
        log "extracting $* from $a"
        tool extract --archive "$a" --dest "$ex" "$@" || exit 1
    }
    extract training-parallel-europarl-v7.tgz "${TRAIN_MEMBERS[0]}".{de,en}
    extract training-parallel-commoncrawl.tgz "${TRAIN_MEMBERS[1]}".{de,en}
    extract training-parallel-nc-v9.tgz "${TRAIN_MEMBERS[2]}".{de,en}
    extract dev.tgz "$VALID_MEMBER".{de,en}
    extract test-full.tgz "$(test_member "$SRC")" "$(test_member "$TGT")"
    n=0
    for m in "${TRAIN_MEMBERS[@]}"; do
        check_parallel raw "$ex/$m.$SRC" "$ex/$m.$TGT"
        n=$((n + $(nlines "$ex/$m.$SRC")))
    done
    check_parallel raw "$ex/$VALID_MEMBER.$SRC" "$ex/$VALID_MEMBER.$TGT"
    for l in "$SRC" "$TGT"; do
        members=()
        for m in "${TRAIN_MEMBERS[@]}"; do members+=("$ex/$m.$l"); done
        tool normalize "${UTF8_ARGS[@]}" --output "$raw.tmp/train.$l" "${members[@]}"
        check_lines raw "$raw.tmp/train.$l" "$n" "${members[@]}"
        tool normalize "${UTF8_ARGS[@]}" --output "$raw.tmp/valid.$l" "$ex/$VALID_MEMBER.$l"
        check_lines raw "$raw.tmp/valid.$l" "$(nlines "$ex/$VALID_MEMBER.$l")" "$ex/$VALID_MEMBER.$l"
        tool sgm2txt "${UTF8_ARGS[@]}" "$ex/$(test_member "$l")" "$raw.tmp/test.$l"
    done
    for split in train valid test; do check_parallel raw "$raw.tmp/$split.$SRC" "$raw.tmp/$split.$TGT"; done
    rm -rf "$ex"
    log "raw: train $(nlines "$raw.tmp/train.$SRC"), valid $(nlines "$raw.tmp/valid.$SRC"), test $(nlines "$raw.tmp/test.$SRC") pairs"
    commit "$raw"
}

# --- step 2: normalise + tokenise -----------------------------------------------------------
step_tok() {
    local tok="$WORK_DIR/tok" split l in
    local -a rec=(--option "TOKENIZE=$TOKENIZE" --option "SRC=$SRC" --option "TGT=$TGT")
    for split in train valid test; do
        for l in "$SRC" "$TGT"; do rec+=(--input "raw/$split.$l=$WORK_DIR/raw/$split.$l"); done
    done
    if up_to_date tok "$tok" "${rec[@]}"; then return; fi
    begin "$tok"
    for split in train valid test; do
        for l in "$SRC" "$TGT"; do
            in="$WORK_DIR/raw/$split.$l"
            if [[ "$TOKENIZE" == 1 ]]; then
                tool tokenize --lang "$l" --workers "$WORKERS" "$in" "$tok.tmp/$split.$l"
            else
                cp "$in" "$tok.tmp/$split.$l"
            fi
            check_lines tok "$tok.tmp/$split.$l" "$(nlines "$in")" "$in"
        done
        check_parallel tok "$tok.tmp/$split.$SRC" "$tok.tmp/$split.$TGT"
    done
    commit "$tok"
}

# --- step 3: clean the training data --------------------------------------------------------
step_clean() {
    local clean="$WORK_DIR/clean" l n kept
    local -a rec=(--option "CLEAN_MIN=$CLEAN_MIN" --option "CLEAN_MAX=$CLEAN_MAX" --option "CLEAN_RATIO=$CLEAN_RATIO"
                  --option "SRC=$SRC" --option "TGT=$TGT")
    for l in "$SRC" "$TGT"; do rec+=(--input "tok/train.$l=$WORK_DIR/tok/train.$l"); done
    if up_to_date clean "$clean" "${rec[@]}"; then return; fi
    begin "$clean"
    tool clean --src "$SRC" --tgt "$TGT" --min "$CLEAN_MIN" --max "$CLEAN_MAX" \
        --ratio "$CLEAN_RATIO" "$WORK_DIR/tok/train" "$clean.tmp/train"
    [[ -s "$clean.tmp/train.$SRC" ]] \
        || die "clean: no training pair has $CLEAN_MIN..$CLEAN_MAX tokens a side and a length ratio <= $CLEAN_RATIO"
    check_parallel clean "$clean.tmp/train.$SRC" "$clean.tmp/train.$TGT"
    n="$(nlines "$WORK_DIR/tok/train.$SRC")"; kept="$(nlines "$clean.tmp/train.$SRC")"
    (( kept <= n )) || die "clean: $clean.tmp/train.$SRC has $kept lines, more than its input $WORK_DIR/tok/train.$SRC ($n)"
    commit "$clean"
}

# --- step 4: joint BPE ----------------------------------------------------------------------
bpe_input() { if [[ "$1" == train ]]; then echo "$WORK_DIR/clean/train.$2"; else echo "$WORK_DIR/tok/$1.$2"; fi; }

# apply-bpe --vocabulary-threshold T splits again every subword unit seen fewer than T times in
# the BPE'd training text. 50 suits WMT-scale data, where such units are rare words; when the
# corpus is small for its number of merges, common words are seen fewer than 50 times and are split
# (a 30k-pair corpus with 8000 merges, 17.7 words a sentence: 27.3 tokens with 50, 22.9 without).
# auto: 50 from AUTO_THRESHOLD_WORDS_PER_MERGE training words (both sides, cleaned) per merge,
# where 50 lengthened the text by 2-3 % in our measurement (docs/harness.md), else 0.
AUTO_THRESHOLD_WORDS_PER_MERGE=400
vocab_threshold() {  # sets VOCAB_THRESHOLD from BPE_VOCAB_THRESHOLD and says why
    local words per_merge
    if [[ "$BPE_VOCAB_THRESHOLD" != auto ]]; then
        VOCAB_THRESHOLD="$BPE_VOCAB_THRESHOLD"
        log "bpe: vocabulary threshold $VOCAB_THRESHOLD (--bpe-vocab-threshold)"
        return
    fi
    words="$(cat "$WORK_DIR/clean/train.$SRC" "$WORK_DIR/clean/train.$TGT" | wc -w | tr -d ' ')"
    per_merge=$(( words / BPE_SIZE ))
    if (( per_merge >= AUTO_THRESHOLD_WORDS_PER_MERGE )); then
        VOCAB_THRESHOLD=50
        log "bpe: vocabulary threshold 50 (auto: $words training words for $BPE_SIZE merges, $per_merge per merge, at least $AUTO_THRESHOLD_WORDS_PER_MERGE: only rare units are split)"
    else
        VOCAB_THRESHOLD=0
        log "bpe: vocabulary threshold 0 (auto: $words training words for $BPE_SIZE merges, $per_merge per merge, fewer than $AUTO_THRESHOLD_WORDS_PER_MERGE: a threshold of 50 would split common words)"
    fi
}

step_bpe() {
    local bpe="$WORK_DIR/bpe" split l input started
    local -a rec=(--option "BPE=$BPE" --option "BPE_SIZE=$BPE_SIZE")
    if [[ "$BPE" == subword-nmt ]]; then
        vocab_threshold
        rec+=(--option "BPE_VOCAB_THRESHOLD=$VOCAB_THRESHOLD")  # the value used (translate.py reads it)
    fi
    for split in train valid test; do
        for l in "$SRC" "$TGT"; do
            input="$(bpe_input "$split" "$l")"
            rec+=(--input "${input#"$WORK_DIR/"}=$input")
        done
    done
    if up_to_date bpe "$bpe" "${rec[@]}"; then return; fi
    begin "$bpe"
    if [[ "$BPE" == subword-nmt ]]; then
        log "bpe: learning $BPE_SIZE joint subword-nmt merges"
        started=$SECONDS
        bpe_progress "$bpe.tmp/codes" 9>&- &  # not holding the work dir's lock (fd 9) a moment too long
        PROGRESS_PID=$!
        subword-nmt learn-joint-bpe-and-vocab --input "$WORK_DIR/clean/train.$SRC" "$WORK_DIR/clean/train.$TGT" \
            -s "$BPE_SIZE" -o "$bpe.tmp/codes" \
            --write-vocabulary "$bpe.tmp/vocab.$SRC" "$bpe.tmp/vocab.$TGT"
        kill "$PROGRESS_PID" 2>/dev/null || true
        PROGRESS_PID=""
        # codes: a "#version" line, then one merge a line (fewer than asked when no pair repeats)
        log "bpe: learned $(( $(nlines "$bpe.tmp/codes") - 1 )) merges in $(( SECONDS - started )) s"
    else
        log "bpe: learning a $BPE_SIZE-piece joint sentencepiece model"
        tool spm-train --vocab-size "$BPE_SIZE" --model-prefix "$bpe.tmp/spm" \
            --workers "$WORKERS" "$WORK_DIR/clean/train.$SRC" "$WORK_DIR/clean/train.$TGT"
    fi
    for split in train valid test; do
        for l in "$SRC" "$TGT"; do
            input="$(bpe_input "$split" "$l")"
            log "bpe: applying to $split.$l"
            if [[ "$BPE" == subword-nmt ]]; then
                subword-nmt apply-bpe -c "$bpe.tmp/codes" --vocabulary "$bpe.tmp/vocab.$l" \
                    --vocabulary-threshold "$VOCAB_THRESHOLD" --num-workers "$WORKERS" \
                    < "$input" > "$bpe.tmp/$split.$l"
            else
                tool spm-encode --model "$bpe.tmp/spm.model" "$input" "$bpe.tmp/$split.$l"
            fi
            check_lines bpe "$bpe.tmp/$split.$l" "$(nlines "$input")" "$input"
        done
        check_parallel bpe "$bpe.tmp/$split.$SRC" "$bpe.tmp/$split.$TGT"
    done
    commit "$bpe"
}

# --- step 5: binarize -----------------------------------------------------------------------
step_binarize() {
    local bin="$WORK_DIR/data-bin" split l n m
    local -a rec=(--option "BPE=$BPE" --option "SRC=$SRC" --option "TGT=$TGT")
    for split in train valid test; do
        for l in "$SRC" "$TGT"; do rec+=(--input "bpe/$split.$l=$WORK_DIR/bpe/$split.$l"); done
    done
    if [[ "$BPE" == subword-nmt ]]; then rec+=(--input "bpe/codes=$WORK_DIR/bpe/codes")
    else rec+=(--input "bpe/spm.model=$WORK_DIR/bpe/spm.model"); fi
    if up_to_date data-bin "$bin" "${rec[@]}"; then return; fi
    rm -rf "$bin.tmp"
    log "data-bin: fairseq-preprocess --joined-dictionary"
    fairseq-preprocess --source-lang "$SRC" --target-lang "$TGT" \
        --trainpref "$WORK_DIR/bpe/train" --validpref "$WORK_DIR/bpe/valid" --testpref "$WORK_DIR/bpe/test" \
        --destdir "$bin.tmp" --joined-dictionary --workers "$WORKERS" > "$WORK_DIR/preprocess.log" 2>&1 \
        || { tail -n 20 "$WORK_DIR/preprocess.log" >&2; die "fairseq-preprocess failed (log: $WORK_DIR/preprocess.log)"; }
    for split in train valid test; do
        for l in "$SRC" "$TGT"; do
            n="$(nlines "$WORK_DIR/bpe/$split.$l")"
            m="$(tool idx-count "$bin.tmp/$split.$SRC-$TGT.$l.idx")"
            [[ "$m" == "?" || "$m" == "$n" ]] \
                || die "data-bin: $bin.tmp/$split.$SRC-$TGT.$l has $m sentences but its input $WORK_DIR/bpe/$split.$l has $n lines; stopping"
        done
    done
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
