"""Raw text through fairseq's own tools: the tokenizer and BPE the plugin registers
(``--tokenizer moses_normalized``, ``--bpe subword_nmt_vocabulary``) segment as the recipe did,
where fairseq's ``moses`` and ``subword_nmt`` do not; the pretrained layout average.sh leaves
beside an average (fairseq_rope_tools/deploy/pretrained_layout.py); and, end to end on a
quickstart model, fairseq-interactive and ``from_pretrained(...).translate()`` giving
``fairseq-rope-translate --engine fairseq``'s translations. Also the warnings filter
(fairseq_rope/third_party_warnings.py): hydra's and torch's noise out, everything else in."""

import json
import os
import sys
import unicodedata
import warnings
from argparse import Namespace

import pytest
from support.commands import run_cli
from support.quickstart import shared_quickstart

import fairseq_rope  # noqa: F401  (registers the encoders)
from fairseq_rope import third_party_warnings
from fairseq_rope.config_values import OptionError
from fairseq_rope_base.text import remove_non_printing
from fairseq_rope_tools import text_steps
from fairseq_rope_tools.deploy import pretrained_layout as layout_py
from fairseq_rope_tools.deploy.segmentation import Segmenter
from fairseq_rope_tools.deploy.work_dir import dict_tokens, segmentation_of
from fairseq_rope_tools.metrics import moses_detokenize
from fairseq_rope_tools.text_steps import RecipeTokenizer

# what the recipe's steps change: typographic quotes and apostrophes, a dash, an ellipsis, a
# zero-width space and a soft hyphen (non-printing), an apostrophe that escaping would turn into
# &apos;, a hyphenated word (aggressive dash splitting), a number with a decimal comma
TRICKY = [
    "The teacher\u2019s \u201cwell-known\u201d dog \u2013 a friend of the cats \u2013 sees 12,5 houses\u2026",
    "Don't the children like the old houses?",
    "A photo\u200bgraph of the\u00adcat said: \"the cat is here\".",
]


def encoder(kind, **options):
    from fairseq.data import encoders

    build = encoders.build_tokenizer if kind == "tokenizer" else encoders.build_bpe
    defaults = dict(source_lang="en", target_lang="de", moses_no_dash_splits=False, moses_no_escape=True,
                    bpe_separator="@@", bpe_vocabulary=None, bpe_vocabulary_threshold=None)
    return build(Namespace(**{kind: options.pop("name")}, **dict(defaults, **options)))


# --- the tokenizer ------------------------------------------------------------------------------
def test_moses_normalized_tokenizes_as_the_recipe_and_detokenizes_as_translate():
    tokenizer = encoder("tokenizer", name="moses_normalized")
    recipe = [RecipeTokenizer("en")(line) for line in TRICKY]
    assert [tokenizer.encode(line) for line in TRICKY] == recipe
    assert recipe[0] == 'The teacher \'s " well @-@ known " dog - a friend of the cats - sees 12,5 houses ...'
    assert "&apos;" not in recipe[1]
    # fairseq's own moses tokenizer skips the normalisation and the removal of non-printing characters
    own = encoder("tokenizer", name="moses")
    assert [own.encode(line) for line in TRICKY] != recipe
    german = ["Das Kind , das die Katze sieht , ist well @-@ known .", '" Ja " , sagt er .']
    assert [tokenizer.decode(line) for line in german] == moses_detokenize(german, "de")


def test_remove_non_printing_is_the_recipes():
    """The plugin's tokenizer and the recipe's steps run the one remove_non_printing of the bottom
    layer; on every code point of the Basic Multilingual Plane, control and format characters
    included, in one text and each alone (a text without such characters takes a fast path: it
    must agree too), C* becomes a space and nothing else changes."""
    from fairseq_rope import text_encoders

    assert text_encoders.remove_non_printing is text_steps.remove_non_printing is remove_non_printing
    text = "".join(map(chr, range(1, 0xD800))) + "".join(map(chr, range(0xE000, 0x10000)))
    assert remove_non_printing(text) == "".join(remove_non_printing(ch) for ch in text)
    for ch in text:
        expected = " " if unicodedata.category(ch)[0] == "C" else ch
        assert remove_non_printing(ch) == expected, hex(ord(ch))
    assert remove_non_printing("a\u200bb\u00adc\td") == "a b c d"
    assert all(unicodedata.category(ch)[0] != "C" for ch in remove_non_printing(text).replace(" ", ""))


# --- the BPE ----------------------------------------------------------------------------------
# "cat" merges into one unit, seen once in the training text: with a vocabulary threshold of 2,
# apply-bpe splits it again, down to units seen often enough
CODES = "#version: 0.2\nt h\nth e</w>\nc a\nca t</w>\n"
VOCAB = "the 10\ncat 1\nc@@ 5\na@@ 5\nt 5\nca@@ 3\n"


def bpe_files(directory):
    (directory / "codes").write_text(CODES, encoding="utf-8")
    (directory / "vocab.en").write_text(VOCAB, encoding="utf-8")
    return directory / "codes", directory / "vocab.en"


def test_subword_nmt_vocabulary_splits_as_apply_bpe(tmp_path):
    from subword_nmt.apply_bpe import BPE, read_vocabulary

    codes, vocab = bpe_files(tmp_path)
    for threshold, expected in ((2, "the ca@@ t"), (None, "the cat"), (4, "the c@@ a@@ t")):
        with open(codes, encoding="utf-8") as c, open(vocab, encoding="utf-8") as v:
            apply_bpe = BPE(c, vocab=read_vocabulary(v, threshold))
        ours = encoder("bpe", name="subword_nmt_vocabulary", bpe_codes=str(codes), bpe_vocabulary=str(vocab),
                       bpe_vocabulary_threshold=threshold)
        assert ours.encode("the cat") == apply_bpe.process_line("the cat") == expected
        assert ours.decode(expected) == "the cat"
    # fairseq's own subword_nmt applies no vocabulary
    assert encoder("bpe", name="subword_nmt", bpe_codes=str(codes)).encode("the cat") == "the cat"


def test_subword_nmt_vocabulary_refuses_a_missing_or_unreadable_vocabulary(tmp_path):
    codes, _ = bpe_files(tmp_path)
    with pytest.raises(OptionError, match="--bpe subword_nmt_vocabulary needs --bpe-vocabulary"):
        encoder("bpe", name="subword_nmt_vocabulary", bpe_codes=str(codes))
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(OptionError, match="--bpe-vocabulary .*binary: cannot read it as a subword-nmt vocabulary"):
        encoder("bpe", name="subword_nmt_vocabulary", bpe_codes=str(codes), bpe_vocabulary=str(tmp_path / "binary"))


# --- the pretrained layout ----------------------------------------------------------------------
def record(*options):
    """A prepare.sh step record (DIR/.done) of these options."""
    return "# prepare.sh step record v1\n" + "".join(f"option {option}\n" for option in options)


def work_dir(root, bpe="subword-nmt", threshold="2", tokenize="1"):
    """A directory as prepare.sh leaves it, as far as the layout reads it."""
    work = root / "work dir"
    for step in ("tok", "bpe", "data-bin"):
        (work / step).mkdir(parents=True)
    (work / "tok" / ".done").write_text(record(f"TOKENIZE={tokenize}"), encoding="utf-8")
    options = [f"BPE={bpe}"] + ([f"BPE_VOCAB_THRESHOLD={threshold}"] if bpe == "subword-nmt" else [])
    (work / "bpe" / ".done").write_text(record(*options), encoding="utf-8")
    data_bin = work / "data-bin"
    (data_bin / ".done").write_text(record("SRC=en", "TGT=de"), encoding="utf-8")
    for lang in ("en", "de"):
        (data_bin / f"dict.{lang}.txt").write_text("the 10\nca@@ 3\nt 5\n", encoding="utf-8")
    if bpe == "subword-nmt":
        bpe_files(work / "bpe")
        (data_bin / "bpe_type").write_text("subword_nmt\n", encoding="utf-8")
    else:
        import sentencepiece

        text = work / "train.txt"
        text.write_text("the cat sees the dog .\nthe dog sees the cat .\n" * 20, encoding="utf-8")
        sentencepiece.SentencePieceTrainer.train(input=str(text), model_prefix=str(work / "bpe" / "spm"),
                                                 vocab_size=20, model_type="bpe", minloglevel=2)
        (data_bin / "bpe_type").write_text("sentencepiece\n", encoding="utf-8")
    checkpoint = work / "checkpoints" / "checkpoint.avg5.pt"
    checkpoint.parent.mkdir()
    checkpoint.write_bytes(b"the average")
    return work, checkpoint


def write_layout(capsys, *args):
    """pretrained_layout's main in this process: (exit status, stderr)."""
    try:
        layout_py.main([str(a) for a in args])
        status = 0
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err


def test_layout_holds_what_the_hub_and_interactive_need(tmp_path, capsys):
    work, checkpoint = work_dir(tmp_path)
    status, err = write_layout(capsys, "--checkpoint", checkpoint, "--work-dir", work)
    layout = checkpoint.parent / "pretrained_checkpoint.avg5"
    assert status == 0 and f"wrote {layout}" in err
    assert sorted(os.listdir(layout)) == ["README.md", "bpecodes", "bpevocab.en", "dict.de.txt", "dict.en.txt", "model.pt"]
    assert os.readlink(layout / "model.pt") == "../checkpoint.avg5.pt" and (layout / "model.pt").read_bytes() == b"the average"
    assert (layout / "bpecodes").read_text() == CODES and (layout / "dict.en.txt").read_bytes() == (work / "data-bin" / "dict.en.txt").read_bytes()
    # the recorded threshold (2) applied: what fairseq-rope-translate's segmenter keeps, and nothing else
    assert (layout / "bpevocab.en").read_text() == "the 10\nc@@ 5\na@@ 5\nt 5\nca@@ 3\n"
    assert set(line.split()[0] for line in (layout / "bpevocab.en").read_text().splitlines()) == \
        Segmenter(segmentation_of(work, "en", "de", "subword_nmt")).bpe.vocab
    readme = (layout / "README.md").read_text()
    assert "--tokenizer moses_normalized --moses-no-escape" in readme and '--bpe-vocabulary "$DIR/bpevocab.en"' in readme
    assert "bpe_vocabulary=f\"{DIR}/bpevocab.en\"" in readme and "translate([\"...\"], beam=4)" in readme

    # a second run finds it complete and leaves it as it is
    before = {name: (layout / name).lstat().st_mtime_ns for name in os.listdir(layout)}
    status, err = write_layout(capsys, "--checkpoint", checkpoint, "--work-dir", work)
    assert status == 0 and "is up to date" in err
    assert {name: (layout / name).lstat().st_mtime_ns for name in os.listdir(layout)} == before
    # another threshold recorded (prepare.sh rebuilt bpe/): the layout follows
    (work / "bpe" / ".done").write_text(record("BPE=subword-nmt", "BPE_VOCAB_THRESHOLD=0"))
    assert write_layout(capsys, "--checkpoint", checkpoint, "--work-dir", work)[0] == 0
    assert (layout / "bpevocab.en").read_text() == VOCAB


def test_layout_of_sentencepiece_and_of_an_untokenized_work_dir(tmp_path, capsys):
    work, checkpoint = work_dir(tmp_path, bpe="sentencepiece", tokenize="0")
    layout = tmp_path / "model"
    assert write_layout(capsys, "--checkpoint", checkpoint, "--work-dir", work, "--output-dir", layout)[0] == 0
    assert sorted(os.listdir(layout)) == ["README.md", "dict.de.txt", "dict.en.txt", "model.pt", "sentencepiece.bpe.model"]
    assert (layout / "sentencepiece.bpe.model").read_bytes() == (work / "bpe" / "spm.model").read_bytes()
    args, kwargs = layout_py.fairseq_options(layout, "en", "de", "sentencepiece", tokenize=False)
    assert args[args.index("--bpe"):] == ["--bpe", "sentencepiece", "--sentencepiece-model", str(layout / "sentencepiece.bpe.model")]
    assert "--tokenizer" not in args and "tokenizer" not in kwargs and kwargs["bpe"] == "sentencepiece"
    assert "--tokenizer" not in (layout / "README.md").read_text()


def test_layout_never_replaces_what_it_did_not_write_nor_an_input(tmp_path, capsys):
    work, checkpoint = work_dir(tmp_path)
    foreign = tmp_path / "models"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    status, err = write_layout(capsys, "--checkpoint", checkpoint, "--work-dir", work, "--output-dir", foreign)
    assert status == 2 and "holds notes.txt, which the pretrained layout does not write" in err
    assert os.listdir(foreign) == ["notes.txt"]
    for output, flag in ((work / "data-bin", "--data-bin"), (work, "--checkpoint"), (checkpoint.parent, "--checkpoint")):
        status, err = write_layout(capsys, "--checkpoint", checkpoint, "--work-dir", work, "--output-dir", output)
        assert status == 2 and f"{flag} " in err and "would overwrite its own input" in err, err
    assert sorted(os.listdir(work / "data-bin")) == [".done", "bpe_type", "dict.de.txt", "dict.en.txt"]
    status, err = write_layout(capsys, "--checkpoint", tmp_path / "none.pt", "--work-dir", work)
    assert status == 2 and "--checkpoint" in err and "is not a file" in err


# --- the warnings ---------------------------------------------------------------------------------
# (message, category, the module it is attributed to), as hydra 1.3 and torch 2.13 word them under fairseq 0.12
NOISE = [
    ("hydra.experimental.initialize() is no longer experimental. Use hydra.initialize()", UserWarning,
     "hydra.experimental.initialize"),
    ("\nThe version_base parameter is not specified.\nPlease specify a compatability version level, or None.\n"
     "Will assume defaults for version 1.1", UserWarning, "hydra.experimental.initialize"),
    ("hydra.experimental.compose() is no longer experimental. Use hydra.compose()", UserWarning,
     "hydra.experimental.compose"),
    ("In 'config': Usage of deprecated keyword in package header '# @package _group_'.\nSee "
     "https://hydra.cc/docs/1.2/upgrades/1.0_to_1.1/changes_to_package_header for more information", UserWarning,
     "hydra.core.default_element"),
    ("\n'config' is validated against ConfigStore schema with the same name.\nThis behavior is deprecated in Hydra "
     "1.1 and will be removed in Hydra 1.2.\nSee https://hydra.cc/docs/1.2/upgrades/1.0_to_1.1/automatic_schema_matching "
     "for migration instructions.", UserWarning, "__main__"),
    ("\nThe strict flag in the compose API is deprecated.\nSee "
     "https://hydra.cc/docs/1.2/upgrades/0.11_to_1.0/strict_mode_flag_deprecated for more info.\n", UserWarning,
     "hydra.compose"),
    ("'pin_memory' argument is set as true but no accelerator is found, then device pinned memory won't be used.",
     UserWarning, "torch.utils.data.dataloader"),
    ("`torch.cuda.amp.autocast(args...)` is deprecated. Please use `torch.amp.autocast('cuda', args...)` instead.",
     FutureWarning, "fairseq.tasks.fairseq_task"),
]
# warnings about what the user set or wrote stay: hydra's about a config, torch's about a data loader or
# the user's own code, anyone's; and the noise's text in another category
KEPT = [
    ("In 'my_config': Could not load 'optimizer/adamw'", UserWarning, "hydra._internal.config_loader_impl"),
    ("This DataLoader will create 8 worker processes in total. Our suggested max number of worker in current "
     "system is 2, which is smaller than what this DataLoader is going to create.", UserWarning,
     "torch.utils.data.dataloader"),
    ("--max-tokens 100 is smaller than the longest sentence", UserWarning, "fairseq_rope.last_batch"),
    ("The strict flag of your config is set", UserWarning, "__main__"),
    (NOISE[-1][0], FutureWarning, "my_training_script"),
    (NOISE[0][0], DeprecationWarning, "hydra.experimental.initialize"),
]


@pytest.mark.parametrize("user_options", [[], ["default"]], ids=["default", "user -W default"])
def test_only_third_party_noise_is_filtered(monkeypatch, user_options):
    monkeypatch.setattr(sys, "warnoptions", user_options)
    with warnings.catch_warnings(record=True) as shown:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        third_party_warnings.quiet_third_party_warnings()
        third_party_warnings.quiet_third_party_warnings()  # again: the same filters, not twice
        for message, category, module in NOISE + KEPT:
            warnings.warn_explicit(message, category, "library.py", 1, module=module)
        filters = list(warnings.filters)
    assert len(filters) == 1 + (0 if user_options else len(third_party_warnings.THIRD_PARTY_NOISE))
    expected = (NOISE if user_options else []) + KEPT
    assert [(str(w.message), w.category) for w in shown] == [(message, category) for message, category, _ in expected]


# --- end to end: a quickstart model ------------------------------------------------------------
HUB = """
import json, sys
from fairseq.models.transformer import TransformerModel
from fairseq_rope_tools.cli import plugin_dir
from fairseq_rope_tools.deploy.pretrained_layout import fairseq_options

directory, source = sys.argv[1:]
_, options = fairseq_options(directory, "en", "de", "subword_nmt", tokenize=True)
model = TransformerModel.from_pretrained(directory, user_dir=plugin_dir(), lenpen=0.6, **options)
lines = open(source, encoding="utf-8").read().splitlines()
json.dump({"translations": model.translate(lines, beam=4),
           "segmented": [model.apply_bpe(model.tokenize(line)) for line in lines]}, sys.stdout)
"""


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """scripts/quickstart.sh, small (support/quickstart.py): (prepared work dir, averaged checkpoint,
    its pretrained layout)."""
    run = shared_quickstart(tmp_path_factory)
    layout = run.save_dir / "pretrained_checkpoint.avg5"
    assert f"Pretrained:  {layout} " in run.stdout
    return run.work, run.save_dir / "checkpoint.avg5.pt", layout


def interactive(layout, source, user_dir, *encoders, cwd):
    args, _ = layout_py.fairseq_options(layout, "en", "de", "subword_nmt", tokenize=True)
    if encoders:  # in place of the layout's tokenizer and BPE
        args = args[:args.index("--tokenizer")] + list(encoders)
    proc = run_cli(["fairseq-interactive", *args, "--user-dir", user_dir, *layout_py.DECODING, "--input", source], cwd=cwd,
                   timeout=300)
    lines = proc.stdout.splitlines()
    return ([line.split("\t")[2] for line in lines if line.startswith("D-")],
            [line.split("\t")[1] for line in lines if line.startswith("S-")], proc.stderr)


@pytest.mark.e2e
def test_fairseq_interactive_and_the_hub_translate_raw_text_as_fairseq_rope_translate(quickstart, tmp_path):
    work, checkpoint, layout = quickstart
    assert os.readlink(layout / "model.pt") == "../checkpoint.avg5.pt"
    raw = (work / "raw" / "test.en").read_text(encoding="utf-8").splitlines()
    german = (work / "raw" / "test.de").read_text(encoding="utf-8").splitlines()[:3]  # units English never had
    lines = raw + TRICKY + german
    source = tmp_path / "input.en"
    source.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    out = tmp_path / "translate.de"
    run_cli(["fairseq-rope-translate", "--work-dir", work, "--engine", "fairseq", "--checkpoint", checkpoint,
             "--threads", "1", "--quiet", "--output", out, source])
    expected = out.read_text(encoding="utf-8").splitlines()
    assert len(expected) == len(lines) and len(set(expected)) > len(lines) // 3  # translations that depend on the input
    segment = Segmenter(segmentation_of(work, "en", "de", "subword_nmt"))
    segmented = [" ".join(segment(line)) for line in lines]
    known = set(dict_tokens(work / "data-bin" / "dict.en.txt"))
    with_unk = [" ".join(t if t in known else "<unk>" for t in line.split()) for line in segmented]

    # from a directory outside the checkout, the installed plugin, as a user runs it
    user_dir = run_cli([sys.executable, "-c", "from fairseq_rope_tools.cli import plugin_dir; print(plugin_dir())"],
                       cwd=tmp_path).stdout.strip()
    translations, sources, stderr = interactive(layout, source, user_dir, cwd=tmp_path)
    assert sources == with_unk
    assert translations == expected
    # hydra's and torch's noise filtered, here and where the recipe ran fairseq-train and fairseq-generate
    for log in (stderr, (checkpoint.parent / "train.log").read_text(encoding="utf-8"),
                (checkpoint.parent / "eval_avg5_test" / "generate.log").read_text(encoding="utf-8")):
        assert "Warning:" not in log and "version_base" not in log

    hub = json.loads(run_cli([sys.executable, "-c", HUB, layout, source], cwd=tmp_path).stdout)
    assert hub["segmented"] == segmented
    assert hub["translations"] == expected

    # fairseq's own moses tokenizer and subword_nmt BPE segment the tricky and the German lines otherwise
    _, own_sources, _ = interactive(layout, source, user_dir, "--tokenizer", "moses", "--moses-no-escape", "--bpe",
                                    "subword_nmt", "--bpe-codes", layout / "bpecodes", cwd=tmp_path)
    differ = [line for line, ours, own in zip(lines, with_unk, own_sources) if ours != own]
    assert set(differ) >= set(TRICKY[0::2] + german), differ

