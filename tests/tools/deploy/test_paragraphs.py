"""--too-long split's parts (fairseq_rope_tools/deploy/paragraphs.py): sentences of a paragraph,
and the translations of its sentences joined back (end to end: test_translate_reliability.py)."""

import builtins

import pytest

from fairseq_rope_tools.cli import UserError
from fairseq_rope_tools.deploy.engine import Hypothesis
from fairseq_rope_tools.deploy.paragraphs import joined, sentence_splitter


def test_a_paragraph_splits_into_its_sentences_in_order():
    split = sentence_splitter("en")
    assert split("Dr. Smith came home.  Was he tired? Yes! ") == ["Dr. Smith came home.", "Was he tired?", "Yes!"]
    assert split("   ") == []


def test_joined_translations_keep_order_and_rank():
    first = [Hypothesis(["a", "b"], -1.0), Hypothesis(["a", "c"], -2.0)]
    second = [Hypothesis(["d"], -3.0)]
    assert joined([first, second], nbest=1) == [Hypothesis(["a", "b", "d"], -2.0)]
    # the second's only hypothesis stands in its 2nd place
    assert joined([first, second], nbest=2) == [Hypothesis(["a", "b", "d"], -2.0), Hypothesis(["a", "c", "d"], -2.5)]
    assert joined([first, [], second], nbest=1) == [Hypothesis(["a", "b", "d"], -2.0)]  # a skipped one left out
    assert joined([[], []], nbest=1) == []


def test_without_sentencex_split_is_refused_in_one_line(monkeypatch):
    real_import = builtins.__import__

    def no_sentencex(name, *args, **kwargs):
        if name == "sentencex":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sentencex)
    with pytest.raises(UserError, match=r"^--too-long split needs sentencex, which is not installed: pip install"):
        sentence_splitter("en")
