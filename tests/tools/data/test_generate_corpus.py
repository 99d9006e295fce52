"""fairseq-rope-generate-corpus: deterministic for a seed, and it produces the documented phenomena."""

import re
import subprocess
import sys

import pytest

from fairseq_rope_tools.data import generate_corpus
from fairseq_rope_tools.data import synthetic_grammar as gc

FINITE_DE = (
    {v[3] for v in gc.VERBS} | {v[4] for v in gc.VERBS} | {"hat", "haben"}
    | {m[2] for m in gc.MODALS} | {m[3] for m in gc.MODALS}
)


@pytest.fixture(scope="module")
def pairs():
    return gc.generate(seed=7, sizes=[("train", 4000)])["train"]


def _run(out_dir, seed):
    subprocess.run([sys.executable, "-m", generate_corpus.__name__, "--out-dir", str(out_dir), "--seed", str(seed),
                    "--train-size", "300", "--valid-size", "20", "--test-size", "20"],
                   check=True, capture_output=True)
    return {p.name: p.read_bytes() for p in sorted(out_dir.iterdir())}


@pytest.mark.e2e
def test_same_seed_same_files_other_seed_other_files(tmp_path):
    a = _run(tmp_path / "a", 3)
    b = _run(tmp_path / "b", 3)
    c = _run(tmp_path / "c", 4)
    assert sorted(a) == ["test.de", "test.en", "train.de", "train.en", "valid.de", "valid.en"]
    assert a == b
    assert a["train.en"] != c["train.en"]
    for split, n in (("train", 300), ("valid", 20), ("test", 20)):
        assert a[f"{split}.en"].decode().count("\n") == n == a[f"{split}.de"].decode().count("\n")


def test_valid_and_test_do_not_occur_in_train():
    data = gc.generate(seed=5, sizes=[("train", 3000), ("valid", 200), ("test", 200)])
    train = {en for en, _ in data["train"]}
    assert not train & {en for en, _ in data["valid"]}
    assert not train & {en for en, _ in data["test"]}
    assert not {en for en, _ in data["valid"]} & {en for en, _ in data["test"]}


def _words(text):
    return re.findall(r"[\w-]+", text)


def test_subordinate_clauses_are_verb_final_and_agree_with_a_distant_subject(pairs):
    checked = 0
    for en, de in pairs:
        m = re.search(r", (weil|obwohl|während|wenn|falls) ([^,]*)\.$", de)
        if not m:
            continue
        clause = _words(m.group(2))
        assert clause[-1] in FINITE_DE, de  # the finite verb closes the clause
        non_finite = {v[4] for v in gc.VERBS} | {v[5] for v in gc.VERBS}  # infinitives, participles
        assert not any(w in FINITE_DE - non_finite for w in clause[:-1]), de
        en_clause = en.rsplit(", ", 1)[1]
        if re.search(r"\bhas\b", en_clause):
            assert clause[-1] == "hat" and clause[-2] in {v[5] for v in gc.VERBS}, (en, de)
        if re.search(r"\bhave\b", en_clause):
            assert clause[-1] == "haben", (en, de)
            checked += len(clause) >= 6  # agreement over at least five words
    assert checked > 20


def test_verb_bracket_in_main_clauses(pairs):
    # "The X has seen the Y behind the Z." -> "Der X hat den Y hinter dem Z gesehen."
    seen = 0
    for en, de in pairs:
        if any(x in en for x in (",", " that ", " and ")) or not re.search(r"\b(has|have) \w+ ", en):
            continue
        words = _words(de)
        assert words[-1] in {v[5] for v in gc.VERBS}, de
        assert "hat" in words or "haben" in words
        seen += 1
    assert seen > 50


def test_fronted_adverb_inverts_subject_and_verb(pairs):
    adverbs = dict(gc.ADVERBS)
    seen = 0
    for en, de in pairs:
        for adv_en, adv_de in adverbs.items():
            if en.startswith(adv_en.capitalize() + " "):
                assert de.startswith(adv_de.capitalize() + " "), (en, de)
                assert _words(de)[1] in FINITE_DE, de  # verb second, before the subject
                seen += 1
    assert seen > 50


def test_numbers_put_units_before_tens():
    assert gc.de_number(21) == "einundzwanzig" and gc.en_number(21) == "twenty-one"
    assert gc.de_number(38) == "achtunddreißig" and gc.en_number(38) == "thirty-eight"
    assert gc.de_number(30) == "dreißig" and gc.en_number(30) == "thirty"
    assert gc.de_number(16) == "sechzehn" and gc.de_number(7) == "sieben"


def test_numbers_occur_as_words_and_digits(pairs):
    compound = [(en, de) for en, de in pairs if re.search(r"\b(twenty|thirty|forty)-\w+", en)]
    assert len(compound) > 20
    for en, de in compound:
        assert re.search(r"\w+und(zwanzig|dreißig|vierzig)\b", de), (en, de)
    assert any(re.search(r"\b\d\d?\b", en) for en, _ in pairs)


def test_articles_and_adjectives_agree_with_a_following_noun():
    assert gc.DEF_ART["nom"]["m"] == "der" and gc.DEF_ART["acc"]["m"] == "den"
    assert gc.inflect_adjective("groß", gc.adjective_ending("def", "nom", "m")) == "große"
    assert gc.inflect_adjective("groß", gc.adjective_ending("def", "acc", "m")) == "großen"
    assert gc.inflect_adjective("groß", gc.adjective_ending("indef", "nom", "m")) == "großer"
    assert gc.inflect_adjective("groß", gc.adjective_ending("indef", "nom", "n")) == "großes"
    assert gc.inflect_adjective("dunkel", gc.adjective_ending("def", "dat", "f")) == "dunklen"
    assert gc.inflect_adjective("leise", gc.adjective_ending("def", "nom", "f")) == "leise"


def test_objects_carry_accusative_marking(pairs):
    # "The dog sees the man." -> "Der Hund sieht den Mann.": the same English "the man" is "der Mann"
    # as a subject and "den Mann" as an object, so the model must know where the word stands.
    subj = obj = 0
    for en, de in pairs:
        if en.startswith("The man "):
            assert de.startswith("Der Mann "), de
            subj += 1
        if en.endswith(" the man.") and "," not in en and " with " not in en and "behind" not in en:
            if not re.search(r"\b(with|behind|next to|in front of|under|near|after) the man\.$", en):
                assert de.endswith(" den Mann.") or de.endswith(" den Mann gesehen.") or " den Mann " in de, (en, de)
                obj += 1
    assert subj > 5 and obj > 5


def test_a_range_of_sentence_lengths(pairs):
    lengths = [len(en.split()) for en, _ in pairs]
    assert min(lengths) <= 6
    assert max(lengths) >= 35
    assert 10 <= sorted(lengths)[len(lengths) // 2] <= 25
