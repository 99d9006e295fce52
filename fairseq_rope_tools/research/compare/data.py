"""The data side of fairseq-rope-compare: which corpus, which test groups, which
references.

Every source ends as a :class:`TestData`: a fairseq data-bin to train on and decode, the test
groups as line ranges of its test set, the tokenized references (compound-split BLEU) and the
untokenized ones (sacreBLEU, chrF++) when the corpus has them, and the fairseq-generate
arguments that undo its subword segmentation.

* ``--prepared-dir WORK_DIR`` -- a corpus prepared by examples/wmt14_en_de/prepare.sh: trains on
  its BPE text, scores against its ``tok/`` and ``raw/`` references, exactly as evaluate.sh does;
* ``--quickstart-corpus`` -- fairseq-rope-generate-corpus's synthetic corpus, prepared by
  prepare.sh, then the same as ``--prepared-dir``;
* ``--raw-dir DIR`` -- whitespace-tokenized ``{train,valid,test}.{SRC,TGT}`` without subwords,
  binarized here with a joined dictionary;
* ``--data-bin DIR`` -- a data-bin as it is; references are fairseq-generate's own target lines.

With ``--length-split L`` (all but ``--data-bin``) training and validation keep the pairs whose
both sides have at most L words (tokens of the tokenized text, before subwords), and the test set
becomes the groups: up to L words, longer, and consecutive pairs joined N at a time for each N of
``--joined-groups`` (2 and 3 by default), ``test xN``. Each joined group knows the test-set lines
of the single sentences it joins (:attr:`TestData.joined`, ``data-bin/test_joined.json``): the
sentence-split oracle of a decode joins their hypotheses as the sources were joined.

The ``text/`` and ``data-bin/`` the harness binarizes into ``--out-dir`` hold a marker file
(:data:`MARKER`): each run replaces them as a whole, so it replaces only those it made
(:func:`out_dir_problem`).
"""

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from fairseq_rope_base.files import outputs_over_inputs_problem, replace_directory, write_lines_atomically
from fairseq_rope_tools.cli import UserError, run_logged
from fairseq_rope_tools.recipes import recipe_step
from fairseq_rope_tools.text_lines import read_lines

GROUPS_FILE = "test_groups.json"
JOINED_FILE = "test_joined.json"  # joined group -> [[the test-set line of each sentence joined] per line]
PREPARE_STEPS = ("raw", "tok", "clean", "bpe", "data-bin")
REMOVE_BPE = {"subword_nmt": ["--remove-bpe"], "sentencepiece": ["--remove-bpe", "sentencepiece"]}
# in every text/ and data-bin/ the harness makes: the directories it may replace on a later run
MARKER = ".made-by-fairseq-rope-compare"
BINARIZED = ("text", "data-bin")  # what binarize() writes in --out-dir, beside its preprocess.log
REMOVED_MARKERS = {"@@ ": "@@ ", "subword_nmt": "@@ ", "sentencepiece": "\u2581"}  # --remove-bpe KIND -> marker


@dataclass
class TestData:
    data_bin: Path
    groups: Dict[str, List[int]]        # name -> [first line, end) of the test set
    refs_tok: Optional[List[str]]       # None: fairseq-generate's T lines are the references
    refs_raw: Optional[List[str]]       # None: references are detokenized from refs_tok
    generate_args: List[str]            # e.g. --remove-bpe for subword-segmented data
    source_text: Optional[Path] = None  # the test source as the model reads it (BPE), line for line
    bpe_type: Optional[str] = None      # its segmentation (a data-bin's bpe_type), None for plain words
    # joined group -> for each of its lines, the test-set lines of the single sentences it joins
    joined: Dict[str, List[List[int]]] = field(default_factory=dict)


# A row is one sentence pair as (source, target) model input -- BPE text for prepared corpora --
# then (source, target) tokenized words, then the untokenized target (or None).
def row_words(row):
    return max(len(row[2].split()), len(row[3].split()))


def concatenated(rows, n):
    """Consecutive rows joined n at a time, field by field: test sentences n times as long."""
    return [tuple(None if None in fields else " ".join(fields) for fields in zip(*rows[i:i + n]))
            for i in range(0, len(rows) - n + 1, n)]


def read_pairs(raw_dir, split, src, tgt):
    """The sentence pairs of RAW_DIR/SPLIT.{SRC,TGT} as token lists, read strictly
    (fairseq_rope_tools/text_lines.py)."""
    src_path, tgt_path = Path(raw_dir) / f"{split}.{src}", Path(raw_dir) / f"{split}.{tgt}"
    sources, targets = read_lines(src_path), read_lines(tgt_path)
    if len(sources) != len(targets):
        raise UserError(f"{src_path} ({len(sources)} lines) and {tgt_path} ({len(targets)} lines) are not parallel",
                        status=1)
    return [(a.split(), b.split()) for a, b in zip(sources, targets)]


def _parallel(paths):
    """The lines of several files that must be parallel, as rows."""
    columns = [read_lines(p) for p in paths]
    for path, column in zip(paths[1:], columns[1:]):
        if len(column) != len(columns[0]):
            raise UserError(f"{paths[0]} ({len(columns[0])} lines) and {path} ({len(column)} lines) "
                            "are not parallel", status=1)
    return list(zip(*columns))


def split_by_length(train, valid, test, limit, joined=(2, 3)):
    """(train, valid, [(group name, rows)], {joined group: [[test-set line of each sentence it
    joins] per row]}) -- see the module docstring. The test set is the groups one after the other:
    the short sentences, the long ones, then the joined groups, ``joined`` sentences at a time."""
    if not limit:
        return train, valid, [("test", test)], {}
    short = lambda row: row_words(row) <= limit  # noqa: E731
    train, valid = [r for r in train if short(r)], [r for r in valid if short(r)]
    if not train or not valid:
        raise UserError(f"--length-split {limit} leaves no training or validation pairs", status=1)
    singles = [i for i, r in enumerate(test) if short(r)], [i for i, r in enumerate(test) if not short(r)]
    line = {pair: at for at, pair in enumerate(singles[0] + singles[1])}  # a single sentence's test-set line
    groups = [(f"test <= {limit}", [test[i] for i in singles[0]]), (f"test > {limit}", [test[i] for i in singles[1]])]
    parts = {}
    for n in joined:
        groups.append((f"test x{n}", concatenated(test, n)))
        parts[f"test x{n}"] = [[line[first + k] for k in range(n)] for first in range(0, len(test) - n + 1, n)]
    return train, valid, [(name, rows) for name, rows in groups if rows], {name: p for name, p in parts.items() if p}


def binarize(out_dir, train, valid, groups, src, tgt, dictionary=None, joined=None):
    """Write the rows' model text to OUT_DIR/text and binarize it into OUT_DIR/data-bin (joined
    dictionary: built from train, or ``dictionary``); the test set is the groups one after the
    other, their line ranges in data-bin/test_groups.json, the single sentences of the joined
    groups (``joined``) in data-bin/test_joined.json. Each directory is replaced as a whole,
    marked as the harness's (:func:`out_dir_problem` checked that the old ones were). Returns
    (data-bin, groups, test rows)."""
    text_dir, data_bin = out_dir / "text", out_dir / "data-bin"
    test = [row for _, rows in groups for row in rows]

    def write_text(directory):  # the splits as one: never new sources beside old targets
        for split, rows in (("train", train), ("valid", valid), ("test", test)):
            write_lines_atomically(Path(directory) / f"{split}.{src}", (r[0] for r in rows))
            write_lines_atomically(Path(directory) / f"{split}.{tgt}", (r[1] for r in rows))
        mark_as_made(directory)

    replace_directory(text_dir, write_text)
    ranges, start = {}, 0
    for name, rows in groups:
        ranges[name] = [start, start + len(rows)]
        start += len(rows)

    def write_data_bin(directory):  # an interrupted run leaves no data-bin that a rerun would use
        cmd = ["fairseq-preprocess", "--source-lang", src, "--target-lang", tgt, "--trainpref", text_dir / "train",
               "--validpref", text_dir / "valid", "--testpref", text_dir / "test", "--destdir", directory,
               "--joined-dictionary", "--workers", "1"]
        run_logged(cmd + (["--srcdict", dictionary] if dictionary else []), out_dir / "preprocess.log")
        (Path(directory) / GROUPS_FILE).write_text(json.dumps(ranges, indent=1))
        if joined:
            (Path(directory) / JOINED_FILE).write_text(json.dumps(joined))
        mark_as_made(directory)

    replace_directory(data_bin, write_data_bin)
    return data_bin, ranges, test


def mark_as_made(directory) -> None:
    (Path(directory) / MARKER).write_text("made by fairseq-rope-compare, which replaces this directory on each run\n")


def binarizes(args) -> bool:
    """Whether the corpus is binarized into --out-dir: text given without subwords, or split by length."""
    return bool(args.raw_dir or (args.length_split and not args.data_bin))


def written_paths(args) -> Dict[str, Path]:
    """What the data side writes in --out-dir, by how a message names it."""
    written = {}
    if binarizes(args):
        written.update({f"--out-dir's {name}/": args.out_dir / name for name in BINARIZED})
    if args.quickstart_corpus:
        written.update({f"--out-dir's {name}/": args.out_dir / name for name in ("corpus", "prepared")})
    return written


def read_paths(args) -> Dict[str, Optional[Path]]:
    """The inputs the command line names, by how a message names them; a prepared work dir's step
    directories also one by one: an output inside the work dir overwrites no input, one at its
    data-bin/ does."""
    read = {"--raw-dir": args.raw_dir, "--data-bin": args.data_bin, "--prepared-dir": args.prepared_dir}
    if args.prepared_dir:
        read.update({f"--prepared-dir's {step}/": args.prepared_dir / step for step in PREPARE_STEPS})
    return read


def out_dir_problem(args, written: Dict[str, Path]) -> Optional[str]:
    """Why the harness cannot write ``written`` (flag -> path: all it writes in --out-dir), as one
    line, or None: one of them is one of its inputs or holds one; --out-dir is a prepare.sh work
    dir; or it holds a text/ or data-bin/ that the harness would replace but did not make."""
    out = args.out_dir
    problem = outputs_over_inputs_problem(written, read_paths(args))
    if problem:
        return problem
    done = [f"{step}/.done" for step in PREPARE_STEPS if (out / step / ".done").is_file()]
    if done:
        return (f"--out-dir {out} is a prepare.sh work dir (it holds {', '.join(done)}): the comparison would write "
                "its own files among the corpus's; give another --out-dir (and this one as --prepared-dir)")
    for name in BINARIZED if binarizes(args) else ():
        if os.path.lexists(out / name) and not (out / name / MARKER).is_file():
            return (f"--out-dir {out} holds a {name}/ that fairseq-rope-compare did not make (it has no {MARKER}), "
                    f"and the comparison replaces {name}/ as a whole: give another --out-dir (or delete "
                    f"{out / name} if an older fairseq-rope-compare made it)")
    return None


def removed_marker_problem(args, refs_path, refs) -> Optional[str]:
    """Why --generate-args --remove-bpe cannot go with these references, as one line, or None:
    they carry the subword markers it removes from the hypotheses alone (text given without
    subwords, such as --raw-dir's, is scored as it is)."""
    marker = removed_marker(args.generate_args)
    marked = next((n for n, line in enumerate(refs, 1) if marker and marker in line + " "), None)
    if marked is None:
        return None
    return (f"{refs_path} carries subword markers ({marker.strip()!r}, line {marked}), which --generate-args "
            "--remove-bpe removes from the hypotheses only, so they would be scored against references that keep "
            "them: give --raw-dir text without subwords (or a prepare.sh work dir with --prepared-dir), or drop "
            "--remove-bpe")


def removed_marker(generate_args) -> Optional[str]:
    """The subword marker that fairseq-generate removes with these arguments (--remove-bpe [KIND]), or None."""
    for at, arg in enumerate(generate_args):
        option, equals, kind = arg.partition("=")
        if option == "--remove-bpe":
            following = generate_args[at + 1:at + 2]
            if not equals:  # --remove-bpe KIND, or alone: fairseq's "@@ "
                kind = following[0] if following and not following[0].startswith("-") else "@@ "
            return REMOVED_MARKERS.get(kind)
    return None


def from_raw_dir(args, log):
    src, tgt = args.source_lang, args.target_lang
    train, valid, test = ([(" ".join(a), " ".join(b), " ".join(a), " ".join(b), None)
                           for a, b in read_pairs(args.raw_dir, split, src, tgt)]
                          for split in ("train", "valid", "test"))
    problem = removed_marker_problem(args, Path(args.raw_dir) / f"test.{tgt}", (r[3] for r in test))
    if problem:
        raise UserError(problem)
    train, valid, groups, joined = split_by_length(train, valid, test, args.length_split, args.joined_groups)
    data_bin, ranges, test = binarize(args.out_dir, train, valid, groups, src, tgt, joined=joined)
    log(f"binarized {len(train)} train / {len(valid)} valid pairs; test groups "
        + ", ".join(f"{k}: {v[1] - v[0]}" for k, v in ranges.items()))
    return TestData(data_bin, ranges, [r[3] for r in test], None, [], args.out_dir / "text" / f"test.{src}",
                    joined=joined)


def from_prepared_dir(args, work_dir, log):
    """A work directory of prepare.sh: its BPE text, its data-bin and dictionary, and the
    tokenized (tok/) and untokenized (raw/) references that evaluate.sh scores against."""
    src, tgt = args.source_lang, args.target_lang
    work_dir = Path(work_dir).resolve()
    for step in PREPARE_STEPS:
        if not (work_dir / step / ".done").is_file():
            raise UserError(f"--prepared-dir {work_dir} has no complete {step}/ step ({step}/.done): "
                            "run examples/wmt14_en_de/prepare.sh --work-dir on it first", status=1)
    prepared_bin = work_dir / "data-bin"
    if not (prepared_bin / f"test.{src}-{tgt}.{src}.idx").is_file():
        raise UserError(f"--prepared-dir {work_dir} holds no {src}->{tgt} data-bin: give --source-lang and "
                        "--target-lang as prepare.sh was given --src and --tgt", status=1)
    bpe_type = ((prepared_bin / "bpe_type").read_text().strip() if (prepared_bin / "bpe_type").is_file()
                else "subword_nmt")
    if bpe_type not in REMOVE_BPE:
        raise UserError(f"{prepared_bin / 'bpe_type'} names an unknown segmentation {bpe_type!r}", status=1)

    def rows(split, words_dir, with_raw=False):
        paths = [work_dir / "bpe" / f"{split}.{src}", work_dir / "bpe" / f"{split}.{tgt}",
                 work_dir / words_dir / f"{split}.{src}", work_dir / words_dir / f"{split}.{tgt}"]
        if with_raw:
            return _parallel(paths + [work_dir / "raw" / f"{split}.{tgt}"])
        return [(*row, None) for row in _parallel(paths)]

    test = rows("test", "tok", with_raw=True)
    if not args.length_split:
        log(f"using {prepared_bin} ({len(test)} test sentences)")
        return TestData(prepared_bin, {"test": [0, len(test)]}, [r[3] for r in test], [r[4] for r in test],
                        REMOVE_BPE[bpe_type], work_dir / "bpe" / f"test.{src}", bpe_type)
    train, valid, groups, joined = split_by_length(rows("train", "clean"), rows("valid", "tok"), test,
                                                   args.length_split, args.joined_groups)
    data_bin, ranges, test = binarize(args.out_dir, train, valid, groups, src, tgt,
                                      dictionary=prepared_bin / f"dict.{src}.txt", joined=joined)
    log(f"length split of {work_dir}: {len(train)} train / {len(valid)} valid pairs; test groups "
        + ", ".join(f"{k}: {v[1] - v[0]}" for k, v in ranges.items()))
    return TestData(data_bin, ranges, [r[3] for r in test], [r[4] for r in test], REMOVE_BPE[bpe_type],
                    args.out_dir / "text" / f"test.{src}", bpe_type, joined=joined)


def quickstart_corpus(args, log, valid_size=300, test_size=500):
    """fairseq-rope-generate-corpus's corpus in OUT_DIR/corpus, prepared by prepare.sh into
    OUT_DIR/prepared (a rerun skips what is complete); returns the prepared work directory."""
    corpus, prepared = args.out_dir / "corpus", args.out_dir / "prepared"
    log(f"quickstart corpus: {args.corpus_train_size} training pairs, {args.corpus_bpe_size} BPE merges "
        f"(log: {args.out_dir / 'prepare.log'})")
    run_logged(["fairseq-rope-generate-corpus", "--out-dir", corpus,
                "--seed", args.corpus_seed, "--train-size", args.corpus_train_size, "--valid-size", valid_size,
                "--test-size", test_size, "--src", args.source_lang, "--tgt", args.target_lang],
               args.out_dir / "generate_corpus.log")
    run_logged(["bash", recipe_step("wmt14_en_de", "prepare.sh"), "--work-dir", prepared,
                "--train-prefix", corpus / "train", "--valid-prefix", corpus / "valid",
                "--test-prefix", corpus / "test",
                "--src", args.source_lang, "--tgt", args.target_lang, "--bpe-size", args.corpus_bpe_size,
                "--workers", args.threads], args.out_dir / "prepare.log",
               env={"PYTHON": sys.executable})
    return prepared


def from_data_bin(args, log):
    data_bin = args.data_bin.resolve()
    src_dict, tgt_dict = data_bin / f"dict.{args.source_lang}.txt", data_bin / f"dict.{args.target_lang}.txt"
    for path in (src_dict, tgt_dict):
        if not path.is_file():
            raise UserError(f"--data-bin {data_bin} has no {path.name}: is it a binarized "
                            f"{args.source_lang}-{args.target_lang} corpus (see --source-lang/--target-lang)?",
                            status=1)
    if src_dict.read_bytes() != tgt_dict.read_bytes():
        raise UserError(f"--data-bin {data_bin} has separate source and target dictionaries, but the recipe "
                        "(examples/wmt14_en_de/train.sh) shares all embeddings: binarize with fairseq-preprocess "
                        "--joined-dictionary, or give the text with --raw-dir or --prepared-dir", status=1)
    groups_file, joined_file = data_bin / GROUPS_FILE, data_bin / JOINED_FILE
    joined = {}
    if groups_file.is_file() and args.gen_subset == "test":  # a data-bin the harness made
        groups = json.loads(groups_file.read_text())
        joined = json.loads(joined_file.read_text()) if joined_file.is_file() else {}
    else:
        groups = {args.gen_subset: [0, None]}  # all of it; the decoding tells how many
    bpe_type = data_bin / "bpe_type"
    generate_args = REMOVE_BPE.get(bpe_type.read_text().strip(), []) if bpe_type.is_file() else []
    return TestData(data_bin, groups, None, None, generate_args, joined=joined)


def prepare(args, log):
    """The TestData of the corpus the command line names."""
    if args.data_bin:
        return from_data_bin(args, log)
    if args.raw_dir:
        return from_raw_dir(args, log)
    work_dir = args.prepared_dir or quickstart_corpus(args, log)
    return from_prepared_dir(args, work_dir, log)
