"""What a directory prepared by examples/wmt14_en_de/prepare.sh says about the model trained on it,
read without torch or fairseq: the languages and BPE kind of its data-bin, its dictionaries, and
the segmentation of its ``tok/`` and ``bpe/`` steps (each step's options recorded in DIR/.done).

fairseq-rope-export bundles this segmentation with the model; fairseq-rope-translate reads it
from ``--work-dir`` when it is given.
"""

from pathlib import Path
from typing import List, Optional, Tuple

from fairseq_rope_base.files import file_fingerprint
from fairseq_rope_tools.cli import UserError
from fairseq_rope_tools.deploy.segmentation import BPE_TYPES, Segmentation, first_line
from fairseq_rope_tools.text_steps import parse_step_record

FAIRSEQ_SPECIALS = ["<s>", "<blank>", "</s>", "<unk>"]  # a fairseq Dictionary's first symbols, as CTranslate2
# lists them (its converter renames <pad> to <blank>)
RERUN = "rerun prepare.sh, or give the work dir the model was trained on"


def step_options(directory, name) -> Optional[dict]:
    """The options prepare.sh recorded for step ``name`` (``DIR/.done``), or None without a record."""
    return step_record(directory, name)[0]


def step_record(directory, name) -> Tuple[Optional[dict], dict]:
    """(options, inputs {key: (size, sha256, path)}) that prepare.sh recorded in ``DIR/.done``;
    (None, {}) without the file."""
    marker = Path(directory) / ".done"
    if not marker.is_file():
        return None, {}
    parsed = parse_step_record(marker.read_text(encoding="utf-8", errors="replace"))
    if parsed is None:
        raise UserError(f"{marker} does not record the options of the {name} step (written by an older "
                        "prepare.sh): rerun prepare.sh")
    return parsed


def dict_tokens(path) -> List[str]:
    """The tokens of a fairseq dict.L.txt in order, read as fairseq's Dictionary.add_from_file
    reads them ("token count [#fairseq:overwrite]" per line, universal newlines)."""
    tokens = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                word, _, count = line.rstrip().rpartition(" ")
                if count == "#fairseq:overwrite":
                    word, _, count = word.rpartition(" ")
                if not count.isdigit():
                    raise ValueError(f"line {number} is not 'token count'")
                tokens.append(word)
    except (UnicodeDecodeError, ValueError) as e:
        raise UserError(f"--data-bin: {path} is not a fairseq dictionary ({first_line(e)}): rerun prepare.sh") from None
    return tokens


def languages_of(data_bin) -> Tuple[Optional[str], Optional[str]]:
    """(src, tgt) as prepare.sh recorded them in data-bin/.done, else from fairseq-preprocess's
    file names (SPLIT.SRC-TGT.L.idx), else (None, None)."""
    if data_bin is None or not Path(data_bin).is_dir():
        return None, None
    try:
        options = step_options(data_bin, "data-bin") or {}
    except UserError:  # a record of an older prepare.sh: the file names tell
        options = {}
    if options.get("SRC") and options.get("TGT"):
        return options["SRC"], options["TGT"]
    pairs = set()
    for idx in Path(data_bin).glob("*.idx"):
        parts = idx.name.split(".")  # train . en-de . en . idx
        if len(parts) >= 4 and "-" in parts[-3]:
            pairs.add(tuple(parts[-3].split("-", 1)))
    return pairs.pop() if len(pairs) == 1 else (None, None)


def bpe_type_of(data_bin, work_dir) -> Optional[str]:
    """The BPE kind: the data-bin's ``bpe_type`` file (prepare.sh writes it), else the work dir's
    bpe step record; None when neither tells."""
    if data_bin is not None and (Path(data_bin) / "bpe_type").is_file():
        kind = (Path(data_bin) / "bpe_type").read_text(encoding="utf-8").strip()
        if kind not in BPE_TYPES:
            raise UserError(f"{data_bin}/bpe_type: unknown BPE kind {kind!r} (expected {' or '.join(BPE_TYPES)})")
        return kind
    if work_dir is not None:
        bpe = (step_options(Path(work_dir) / "bpe", "bpe") or {}).get("BPE")
        return {"subword-nmt": "subword_nmt", "sentencepiece": "sentencepiece"}.get(bpe)
    return None


def is_tokenized(work_dir) -> bool:
    """Whether prepare.sh Moses-tokenized the text (False: prepared with --no-tokenize)."""
    return (step_options(Path(work_dir) / "tok", "tok") or {}).get("TOKENIZE", "1") != "0"


def has_bpe_step(work_dir) -> bool:
    return (Path(work_dir) / "bpe" / ".done").is_file()


def segmentation_of(work_dir, src, tgt, bpe_type, flag="--work-dir") -> Segmentation:
    """The segmentation prepare.sh applied in ``work_dir`` to the source language ``src``; UserError
    naming the missing file when the bpe/ step is incomplete."""
    work_dir = Path(work_dir)
    origin = f"{flag} {work_dir}"
    if not has_bpe_step(work_dir):
        raise UserError(f"{origin} has no complete bpe/ step (bpe/.done): run prepare.sh first")
    bpe_dir = work_dir / "bpe"
    common = dict(source=src, target=tgt, tokenize=is_tokenized(work_dir), bpe_type=bpe_type, origin=origin,
                  remedy=RERUN)
    if bpe_type == "subword_nmt":
        codes, vocab = bpe_dir / "codes", bpe_dir / f"vocab.{src}"
        for path in (codes, vocab):
            if not path.is_file():
                raise UserError(f"{origin}: no {path} (subword-nmt BPE): is it the directory prepare.sh wrote for "
                                f"this model, and --src {src} right?")
        threshold = (step_options(bpe_dir, "bpe") or {}).get("BPE_VOCAB_THRESHOLD", "50")
        if not threshold.isdigit():
            raise UserError(f"{bpe_dir / '.done'} records the vocabulary threshold {threshold!r}, not a number: "
                            "rerun prepare.sh")
        return Segmentation(codes=codes, vocabulary=vocab, vocabulary_threshold=int(threshold), **common)
    model = bpe_dir / "spm.model"
    if not model.is_file():
        raise UserError(f"{origin}: no {model} (sentencepiece BPE)")
    return Segmentation(spm_model=model, **common)


def data_bin_bpe_problem(data_bin, segmentation: Segmentation) -> Optional[str]:
    """Why the data-bin was not binarized from the BPE of ``segmentation``, as one line, or None:
    prepare.sh records the sha256 of bpe/codes (or bpe/spm.model) in data-bin/.done; a data-bin
    that records none (made by hand, or by an older prepare.sh) is taken on trust."""
    try:
        _, inputs = step_record(data_bin, "data-bin")
    except UserError:  # a record of an older prepare.sh, without inputs
        return None
    key, path = (("bpe/codes", segmentation.codes) if segmentation.bpe_type == "subword_nmt"
                 else ("bpe/spm.model", segmentation.spm_model))
    recorded = inputs.get(key)
    if recorded is None or recorded[1] == file_fingerprint(path)[1]:
        return None
    return (f"{segmentation.origin}: {path} is not the BPE that --data-bin {data_bin} was binarized with (its "
            f".done records another {key}): give the work dir and data-bin of one prepare.sh run")


def vocabulary_problem(vocab: List[str], vocab_path, dictionary) -> Optional[str]:
    """Why the model's ``vocab`` (CTranslate2's list, read from ``vocab_path``) is not fairseq's
    ``dictionary`` file token for token in order, as the middle of a one-line refusal, or None: a
    model's token ids are positions in its vocabulary, so another dictionary, or the same tokens
    in another order, would translate into garbage without a word."""
    expected = FAIRSEQ_SPECIALS + dict_tokens(dictionary)
    if vocab == expected:
        return None
    index = next((i for i, (a, b) in enumerate(zip(vocab, expected)) if a != b), min(len(vocab), len(expected)))
    return (f"token {index} of {vocab_path} is {_token_at(vocab, index)}, of {dictionary} "
            f"{_token_at(expected, index, dictionary=True)}")


def _token_at(tokens, index, dictionary=False):
    if index >= len(tokens):
        return f"past its end ({len(tokens)} tokens)"
    line = index - len(FAIRSEQ_SPECIALS) + 1  # dict.L.txt lists the tokens after the special ones
    return repr(tokens[index]) + (f" (line {line})" if dictionary and line > 0 else "")
