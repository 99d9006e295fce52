"""A tokenizer and a BPE for fairseq-interactive and the hub interface that segment raw text as
the recipe's prepare.sh segmented the training data, so that ``from_pretrained(...).translate()``
and ``fairseq-interactive`` give the translations of ``fairseq-rope-translate --engine fairseq``.

fairseq's own encoders each leave out a step of the recipe:

- ``--tokenizer moses`` runs Moses' tokenizer alone; the recipe (as fairseq's own
  examples/translation/prepare-wmt14en2de.sh) first normalises punctuation
  (normalize-punctuation.perl: typographic quotes and dashes, spaces around punctuation, ...) and
  removes non-printing characters (remove-non-printing-char.perl). ``--tokenizer
  moses_normalized`` runs all three; its options are those of ``moses`` (``--moses-no-escape``:
  the recipe does not escape).
- ``--bpe subword_nmt`` applies the merges alone; the recipe applies them with a vocabulary
  (``subword-nmt apply-bpe --vocabulary vocab.SRC --vocabulary-threshold T``), which splits
  again every unit not seen at least T times on the source side of the BPE'd training text.
  ``--bpe subword_nmt_vocabulary`` takes that vocabulary (``--bpe-vocabulary``, with
  ``--bpe-vocabulary-threshold``). On the quickstart's test set, fairseq's ``subword_nmt``
  segments one sentence in ten otherwise.

Sentencepiece needs nothing new: fairseq's ``--bpe sentencepiece`` is the recipe's encoding.
Both are registered with fairseq when the plugin is imported (``patches.install_patches``).
"""

from dataclasses import dataclass, field
from typing import Optional

from fairseq import file_utils
from fairseq.data import encoders
from fairseq.data.encoders.moses_tokenizer import MosesTokenizer, MosesTokenizerConfig
from fairseq.data.encoders.subword_nmt_bpe import SubwordNMTBPE, SubwordNMTBPEConfig

from fairseq_rope_base.text import remove_non_printing

from .config_values import OptionError

MOSES_NORMALIZED = "moses_normalized"
SUBWORD_NMT_VOCABULARY = "subword_nmt_vocabulary"


class MosesNormalizedTokenizer(MosesTokenizer):
    """Moses punctuation normalisation, removal of non-printing characters, then fairseq's Moses
    tokenizer: the recipe's tokenisation (fairseq_rope_tools.text_steps.RecipeTokenizer).
    Decoding is fairseq's Moses detokenizer, as fairseq-rope-translate's."""

    def __init__(self, cfg: MosesTokenizerConfig):
        super().__init__(cfg)
        from sacremoses import MosesPunctNormalizer

        self.normalizer = MosesPunctNormalizer(lang=cfg.source_lang)

    def encode(self, x: str) -> str:
        return super().encode(remove_non_printing(self.normalizer.normalize(x)))


@dataclass
class SubwordNMTVocabularyBPEConfig(SubwordNMTBPEConfig):
    bpe_vocabulary: Optional[str] = field(
        default=None, metadata={"help": "subword-nmt vocabulary of the source side (apply-bpe --vocabulary): a "
                                        "unit not in it is split again, as prepare.sh did"})
    bpe_vocabulary_threshold: Optional[int] = field(
        default=None, metadata={"help": "only units seen at least this often count (apply-bpe "
                                        "--vocabulary-threshold); a pretrained directory's bpevocab has it applied"})


class SubwordNMTVocabularyBPE(SubwordNMTBPE):
    """fairseq's subword_nmt BPE with apply-bpe's vocabulary filter."""

    def __init__(self, cfg: SubwordNMTVocabularyBPEConfig):
        if not cfg.bpe_vocabulary:
            raise OptionError(f"--bpe {SUBWORD_NMT_VOCABULARY} needs --bpe-vocabulary: the subword-nmt vocabulary "
                              "of the source side (bpevocab.SRC of the recipe's pretrained directory)")
        super().__init__(cfg)
        from subword_nmt.apply_bpe import read_vocabulary

        try:
            with open(file_utils.cached_path(cfg.bpe_vocabulary), encoding="utf-8") as vocabulary:
                # as `apply-bpe --vocabulary`; set before anything is encoded (the BPE caches words)
                self.bpe.vocab = read_vocabulary(vocabulary, cfg.bpe_vocabulary_threshold)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise OptionError(f"--bpe-vocabulary {cfg.bpe_vocabulary}: cannot read it as a subword-nmt "
                              f"vocabulary ({e}): give the bpevocab.SRC file of the pretrained directory") from None


def register_text_encoders() -> None:
    """Register both with fairseq, once (importing the plugin again registers nothing)."""
    if MOSES_NORMALIZED not in encoders.TOKENIZER_REGISTRY:
        encoders.register_tokenizer(MOSES_NORMALIZED, dataclass=MosesTokenizerConfig)(MosesNormalizedTokenizer)
    if SUBWORD_NMT_VOCABULARY not in encoders.BPE_REGISTRY:
        encoders.register_bpe(SUBWORD_NMT_VOCABULARY, dataclass=SubwordNMTVocabularyBPEConfig)(SubwordNMTVocabularyBPE)
