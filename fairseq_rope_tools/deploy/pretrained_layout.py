#!/usr/bin/env python3
"""Put a trained checkpoint in fairseq's pretrained-model layout: the directory from which
fairseq's hub interface (``TransformerModel.from_pretrained``) and ``fairseq-interactive``
translate raw text, tokenized and BPE'd as the recipe prepared the training data.

    fairseq-rope-pretrained-layout --work-dir work/wmt14_en_de \\
        --checkpoint work/wmt14_en_de/checkpoints/transformer_rope_wmt_en_de/checkpoint.avg5.pt
    # -> .../transformer_rope_wmt_en_de/pretrained_checkpoint.avg5/

examples/wmt14_en_de/average.sh runs it for every average it writes. The directory holds, under
the names fairseq's hub looks for:

  model.pt                  a relative symbolic link to the checkpoint (so that a new average is
                            what it holds; copy the directory with ``cp -rL`` or ``tar -h``)
  dict.SRC.txt dict.TGT.txt the data-bin's dictionaries
  bpecodes                  the subword-nmt merges (from_pretrained finds them by this name)
  bpevocab.SRC              the source side's subword-nmt vocabulary, prepare.sh's vocabulary
                            threshold applied: what --bpe subword_nmt_vocabulary needs to split
                            exactly as prepare.sh did (fairseq's subword_nmt applies no vocabulary)
  sentencepiece.bpe.model   instead of both, for a work dir prepared with --bpe sentencepiece
  README.md                 the fairseq-interactive command and the from_pretrained call for it

With the commands of README.md (docs/usage.md#raw-text-through-fairseqs-own-tools), fairseq
translates raw text exactly as ``fairseq-rope-translate --engine fairseq --work-dir WORK_DIR``
does. The directory is written as a whole, atomically, and is skipped when it already holds the
same files; an existing directory that holds anything else, or any of the inputs, is refused.
"""

import argparse
import os
import re
import shlex
from pathlib import Path

from fairseq_rope_base.files import outputs_over_inputs_problem, replace_directory, replaced_dir_problem
from fairseq_rope_tools.cli import ArgumentParser, UserError, command, sayer
from fairseq_rope_tools.deploy.segmentation import Segmenter
from fairseq_rope_tools.deploy.work_dir import (
    bpe_type_of,
    data_bin_bpe_problem,
    has_bpe_step,
    languages_of,
    segmentation_of,
)

say = sayer("pretrained")
TOOL = "fairseq-rope-pretrained-layout"  # also python -m fairseq_rope_tools.deploy.pretrained_layout
CHECKPOINT_LINK = "model.pt"
# the names fairseq's hub_utils.from_pretrained looks for in a model directory
SUBWORD_NMT_CODES = "bpecodes"
SENTENCEPIECE_MODEL = "sentencepiece.bpe.model"
# fairseq-interactive's decoding, as fairseq-rope-translate's defaults (and in batches of 64 lines)
DECODING = ["--beam", "4", "--lenpen", "0.6", "--buffer-size", "64", "--batch-size", "64"]
WRITTEN = re.compile(rf"{re.escape(CHECKPOINT_LINK)}|README\.md|{re.escape(SUBWORD_NMT_CODES)}|"
                     rf"{re.escape(SENTENCEPIECE_MODEL)}|dict\.[^/]+\.txt|bpevocab\.[^/]+")


def default_output_dir(checkpoint) -> Path:
    """``pretrained_NAME`` beside the checkpoint ``NAME.pt``."""
    checkpoint = Path(checkpoint)
    name = checkpoint.name[:-len(".pt")] if checkpoint.name.endswith(".pt") else checkpoint.name
    return checkpoint.parent / f"pretrained_{name}"


def source_vocabulary(name) -> str:
    return f"bpevocab.{name}"


def fairseq_options(directory, src, tgt, bpe_type, tokenize):
    """``(fairseq-interactive's arguments, from_pretrained's keyword arguments)`` that translate
    raw text with the layout ``directory`` as prepare.sh prepared the training data. The user dir,
    beam and length penalty are the caller's."""
    directory = str(directory)
    args = [directory, "--path", os.path.join(directory, CHECKPOINT_LINK), "--source-lang", src, "--target-lang", tgt]
    kwargs = dict(source_lang=src, target_lang=tgt)
    if tokenize:  # the recipe never escapes (&apos; ...): fairseq's moses does unless told
        args += ["--tokenizer", "moses_normalized", "--moses-no-escape"]
        kwargs.update(tokenizer="moses_normalized", moses_no_escape=True)
    vocabulary = os.path.join(directory, source_vocabulary(src))
    if bpe_type == "subword_nmt":
        args += ["--bpe", "subword_nmt_vocabulary", "--bpe-codes", os.path.join(directory, SUBWORD_NMT_CODES),
                 "--bpe-vocabulary", vocabulary]
        kwargs.update(bpe="subword_nmt_vocabulary", bpe_vocabulary=vocabulary)  # bpe_codes: found by its name
    else:
        args += ["--bpe", "sentencepiece", "--sentencepiece-model", os.path.join(directory, SENTENCEPIECE_MODEL)]
        kwargs.update(bpe="sentencepiece")  # sentencepiece_model: found by its name
    return args, kwargs


def readme(directory, src, tgt, bpe_type, tokenize) -> str:
    args, kwargs = fairseq_options("$DIR", src, tgt, bpe_type, tokenize)
    shown = " ".join(("\\\n    " if a in ("--tokenizer", "--bpe") else "")
                     + (f'"{a}"' if a.startswith("$DIR") else shlex.quote(a)) for a in args)
    python_kwargs = ",\n    ".join(f'{k}=f"{{DIR}}{v[len("$DIR"):]}"' if str(v).startswith("$DIR") else f"{k}={v!r}"
                                  for k, v in kwargs.items())
    text_kind = ("raw text in, detokenized text out" if tokenize else
                 "text tokenized as the training data (prepared with --no-tokenize) in, tokenized text out")
    return f"""# {src} -> {tgt}, in fairseq's pretrained-model layout

Written by `{TOOL}` (examples/wmt14_en_de/average.sh); {text_kind}, as
`fairseq-rope-translate --engine fairseq` translates it (docs/usage.md#raw-text-through-fairseqs-own-tools).
`model.pt` is a link to the checkpoint: copy this directory with `cp -rL` or `tar -h`.

```bash
DIR={shlex.quote(final_path(directory))}
fairseq-interactive {shown} \\
    --user-dir "$(fairseq-rope-user-dir)" {" ".join(DECODING)} \\
    < input.{src} | grep '^D-' | cut -f3 > output.{tgt}
```

```python
from fairseq.models.transformer import TransformerModel
from fairseq_rope_tools.user_dir import plugin_dir

DIR = {final_path(directory)!r}
model = TransformerModel.from_pretrained(
    DIR,
    user_dir=plugin_dir(),
    {python_kwargs},
    lenpen=0.6)
print(model.translate(["..."], beam=4))  # translate() decodes with beam 5 unless given one
```
"""


def layout(checkpoint, work_dir, data_bin, output_dir, src, tgt):
    """``(files, link)``: the layout's files as {name: bytes} and model.pt's target; raises
    UserError naming what is missing or does not belong together."""
    for lang in (src, tgt):
        if not (data_bin / f"dict.{lang}.txt").is_file():
            raise UserError(f"--data-bin {data_bin} has no dict.{lang}.txt: give the data-bin of this model")
    if not has_bpe_step(work_dir):
        raise UserError(f"--work-dir {work_dir} has no complete bpe/ step (bpe/.done): run prepare.sh first")
    bpe_type = bpe_type_of(data_bin, work_dir)
    if bpe_type is None:
        raise UserError(f"--work-dir {work_dir}: cannot tell its BPE kind ({data_bin}/bpe_type is missing): is it "
                        "a directory prepare.sh wrote?")
    segmentation = segmentation_of(work_dir, src, tgt, bpe_type)
    problem = data_bin_bpe_problem(data_bin, segmentation)
    if problem:
        raise UserError(problem)
    segmenter = Segmenter(segmentation)  # reads the files as fairseq-rope-translate does: refuses unreadable ones
    files = {f"dict.{lang}.txt": (data_bin / f"dict.{lang}.txt").read_bytes() for lang in (src, tgt)}
    if bpe_type == "subword_nmt":
        files[SUBWORD_NMT_CODES] = segmentation.codes.read_bytes()
        kept = segmenter.bpe.vocab  # the recorded threshold applied
        with open(segmentation.vocabulary, encoding="utf-8") as vocabulary:
            lines = [line for line in vocabulary if line.strip("\r\n ").split(" ")[0] in kept]
        files[source_vocabulary(src)] = "".join(lines).encode("utf-8")
    else:
        files[SENTENCEPIECE_MODEL] = segmentation.spm_model.read_bytes()
    files["README.md"] = readme(output_dir, src, tgt, bpe_type, segmentation.tokenize).encode("utf-8")
    link = os.path.relpath(os.path.realpath(checkpoint), final_path(output_dir))
    return files, link


def final_path(output_dir) -> str:
    """Where the directory ends up (replace_directory replaces a symlink's target)."""
    output_dir = os.path.abspath(output_dir)
    if os.path.lexists(output_dir):
        return os.path.realpath(output_dir)
    return os.path.join(os.path.realpath(os.path.dirname(output_dir)), os.path.basename(output_dir))


def up_to_date(output_dir, files, link) -> bool:
    directory = Path(final_path(output_dir))
    if not directory.is_dir() or sorted(os.listdir(directory)) != sorted([*files, CHECKPOINT_LINK]):
        return False
    model = directory / CHECKPOINT_LINK
    if not model.is_symlink() or os.readlink(model) != link:
        return False
    return all((directory / name).is_file() and not (directory / name).is_symlink()
               and (directory / name).read_bytes() == data for name, data in files.items())


def write_layout(output_dir, files, link) -> None:
    def write(tmp):
        for name, data in files.items():
            Path(tmp, name).write_bytes(data)
        os.symlink(link, os.path.join(tmp, CHECKPOINT_LINK))

    try:
        replace_directory(output_dir, write)
    except OSError as e:
        raise UserError(f"--output-dir {output_dir}: cannot write it ({e.strerror or e}): free some space or make "
                        "its parent writable, or give another --output-dir", status=1) from e


def parse_args(argv):
    p = ArgumentParser(prog=TOOL, description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="the fairseq checkpoint (.pt), e.g. checkpoint.avg5.pt")
    p.add_argument("--work-dir", required=True,
                   help="the directory prepare.sh wrote for the model: tok/, bpe/, data-bin/")
    p.add_argument("--data-bin", help="the model's data-bin (default: WORK_DIR/data-bin)")
    p.add_argument("--output-dir",
                   help="the layout's directory (default: pretrained_NAME beside the checkpoint NAME.pt)")
    p.add_argument("--src", help="source language (default: as recorded in the data-bin)")
    p.add_argument("--tgt", help="target language (default: as recorded in the data-bin)")
    return p.parse_args(argv)


@command(label="[pretrained]")  # as its progress lines, in average.sh's output
def main(argv=None):
    args = parse_args(argv)
    checkpoint, work_dir = Path(args.checkpoint), Path(args.work_dir)
    if not checkpoint.is_file():
        raise UserError(f"--checkpoint {checkpoint} is not a file")
    if not work_dir.is_dir():
        raise UserError(f"--work-dir {work_dir} is not a directory")
    data_bin = Path(args.data_bin) if args.data_bin else work_dir / "data-bin"
    if not data_bin.is_dir():
        raise UserError(f"--data-bin {data_bin} is not a directory: run prepare.sh first (or give --data-bin)")
    output_dir = Path(args.output_dir) if args.output_dir else default_output_dir(checkpoint)
    recorded_src, recorded_tgt = languages_of(data_bin)
    src, tgt = args.src or recorded_src, args.tgt or recorded_tgt
    if not (src and tgt):
        raise UserError(f"--data-bin {data_bin} does not record its languages: pass --src and --tgt")

    inputs = {"--checkpoint": checkpoint, "--data-bin": data_bin, "--work-dir's bpe": work_dir / "bpe",
              "--work-dir's tok/.done": work_dir / "tok" / ".done"}
    problem = (outputs_over_inputs_problem({"--output-dir": output_dir}, inputs)
               or replaced_dir_problem("--output-dir", output_dir, "the pretrained layout",
                                       lambda name: WRITTEN.fullmatch(name) is not None))
    if problem:
        raise UserError(problem)
    files, link = layout(checkpoint, work_dir, data_bin, output_dir, src, tgt)
    if up_to_date(output_dir, files, link):
        say(f"{output_dir} is up to date")
        return
    write_layout(output_dir, files, link)
    say(f"wrote {output_dir}: fairseq's pretrained-model layout of {checkpoint.name} ({src} -> {tgt}); "
        f"its README.md has the fairseq-interactive command and the from_pretrained call")


if __name__ == "__main__":
    main()
