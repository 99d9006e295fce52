"""Raw text to the model's source tokens and its tokens back to text, as the recipe makes them
(examples/wmt14_en_de/prepare.sh and evaluate.sh), whether the files come from a prepared work
directory (:mod:`~fairseq_rope_tools.deploy.work_dir`) or from an exported bundle
(:mod:`~fairseq_rope_tools.deploy.exported`).

Source side: Moses punctuation normalisation, removal of non-printing characters and Moses
tokenisation ``-a -no-escape`` (fairseq_rope_tools.text_steps' RecipeTokenizer; none for a
corpus prepared with --no-tokenize), then subword-nmt BPE (codes, the source vocabulary and its
threshold, as ``subword-nmt apply-bpe -c CODES --vocabulary VOCAB --vocabulary-threshold T``) or
sentencepiece. Target side: the BPE removed as fairseq-generate's ``--remove-bpe`` does, then
Moses detokenisation.

Standard library at import: subword-nmt, sentencepiece and sacremoses load when used, and never
torch or fairseq.
"""

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from fairseq_rope_tools.cli import UserError
from fairseq_rope_tools.text_steps import RecipeTokenizer

BPE_TYPES = ("subword_nmt", "sentencepiece")
OUTPUT_FORMATS = ("detok", "tok", "bpe")

#: the tokenisation text_steps.RecipeTokenizer applies, as a bundle records it
MOSES_RECIPE = {"kind": "moses", "normalize_punctuation": True, "remove_non_printing": True,
                "aggressive_dash_splits": True, "escape": False}


@dataclass(frozen=True)
class Segmentation:
    """How the model's text was segmented, and where its files are."""

    source: str                          # source language (the tokenizer's)
    target: Optional[str]                # target language (the detokenizer's)
    tokenize: bool                       # False: the corpus was prepared with --no-tokenize
    bpe_type: str                        # one of BPE_TYPES
    codes: Optional[Path] = None         # subword-nmt
    vocabulary: Optional[Path] = None    # subword-nmt: the source side's
    vocabulary_threshold: int = 50
    spm_model: Optional[Path] = None     # sentencepiece
    origin: str = ""                     # what holds the files, for messages: "--work-dir W" ...
    remedy: str = ""                     # what to do when one of them is unreadable

    def files(self) -> Dict[str, Path]:
        """The files the source side reads, by role."""
        if self.bpe_type == "subword_nmt":
            return {"codes": self.codes, "vocabulary": self.vocabulary}
        return {"model": self.spm_model}


def remove_bpe(line: str, bpe_type: str) -> str:
    """fairseq's --remove-bpe (fairseq.data.data_utils.post_process) for the recipe's two BPE kinds;
    kept here so that the CTranslate2 path needs no fairseq (tests/tools/deploy/test_translate.py checks both
    agree)."""
    if bpe_type == "sentencepiece":
        return line.replace(" ", "").replace("\u2581", " ").strip()
    return (line + " ").replace("@@ ", "").rstrip()


def first_line(error, limit=200) -> str:
    """An exception's message, shortened to fit in a one-line refusal."""
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return text if len(text) <= limit else text[:limit] + "..."


@contextlib.contextmanager
def unreadable_as_refused(segmentation: Segmentation, path, kind):
    """A BPE file that its library cannot read (binary, truncated, another format) is refused by name."""
    try:
        yield
    except (UnicodeDecodeError, ValueError, IndexError, RuntimeError, OSError) as e:
        raise UserError(f"{segmentation.origin}: {path} is not {kind} ({first_line(e)}): "
                        f"{segmentation.remedy}") from None


class Segmenter:
    """raw line -> the source tokens the model was trained on."""

    def __init__(self, segmentation: Segmentation):
        self.segmentation = segmentation
        if segmentation.bpe_type == "subword_nmt":
            from subword_nmt.apply_bpe import BPE, read_vocabulary

            vocab, codes = segmentation.vocabulary, segmentation.codes
            with unreadable_as_refused(segmentation, vocab, "a subword-nmt vocabulary"):
                with open(vocab, encoding="utf-8") as v:
                    vocabulary = read_vocabulary(v, segmentation.vocabulary_threshold)
            with unreadable_as_refused(segmentation, codes, "subword-nmt BPE codes"):
                with open(codes, encoding="utf-8") as c:
                    self.bpe = BPE(c, vocab=vocabulary)  # as `subword-nmt apply-bpe -c --vocabulary ...`
        else:
            import sentencepiece

            with unreadable_as_refused(segmentation, segmentation.spm_model, "a sentencepiece model"):
                self.spm = sentencepiece.SentencePieceProcessor(model_file=str(segmentation.spm_model))
        self.tokenize = RecipeTokenizer(segmentation.source) if segmentation.tokenize else None

    def __call__(self, line: str) -> List[str]:
        if self.tokenize is not None:
            line = self.tokenize(line)
        else:
            line = " ".join(line.split())
        if not line:
            return []
        if self.segmentation.bpe_type == "subword_nmt":
            return self.bpe.process_line(line).split()
        return self.spm.encode(line, out_type=str)


def desegment(hypotheses: List[List[str]], output_format: str, bpe_type: Optional[str],
              target: Optional[str]) -> List[str]:
    """Token lists -> text lines: ``bpe`` the tokens as they are; ``tok`` the BPE removed (as
    evaluate.sh's hyp.tok.TGT); ``detok`` Moses-detokenized too (the detokenizer evaluate.sh
    scores with)."""
    lines = [" ".join(tokens) for tokens in hypotheses]
    if output_format == "bpe":
        return lines
    lines = [remove_bpe(line, bpe_type) for line in lines]
    if output_format == "detok":
        from fairseq_rope_tools.metrics import moses_detokenize

        lines = moses_detokenize(lines, target)
    return lines
