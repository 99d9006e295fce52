"""Long inputs through CTranslate2: static YaRN exported per length bucket (fairseq-rope-export
--length-buckets) decodes as fairseq-generate does with that fixed yarn factor, a reversed ramp
breaks that, and fairseq-rope-translate sends each sentence to the bucket of its length, the
sentences within the training length to the plain model."""

import hashlib
import json
import shutil

import pytest
import torch
from support.commands import fairseq_generate_test_set, run_cli, translate_in_process
from test_export_ctranslate2 import EXPORT, agreement, ct2_translate

from fairseq_rope.modules.rotary import inverse_frequencies, yarn_frequencies
from fairseq_rope_tools.deploy import checkpoint_export as exporter
from fairseq_rope_tools.deploy import ctranslate2_engine, ctranslate2_scaling, export_ctranslate2
from fairseq_rope_tools.deploy.ctranslate2_scaling import ctranslate2_rotary_scaling, yarn_divisors
from fairseq_rope_tools.deploy.exported import (
    EXPORT_INFO,
    LENGTH_BUCKETS,
    bucket_of,
    bucket_overrides,
    read_bucket_manifest,
    verified_bucket_manifest,
    vocabulary_digests,
)

ctranslate2 = pytest.importorskip("ctranslate2")

FACTORS = (1.5, 2.0, 3.0, 4.0)
# A training length at which YaRN's ramp spans several of the tiny model's 16 frequencies (at the
# recorded L of the toy corpus, about 11 tokens, all but one are interpolated alike, and a wrong
# ramp would not show)
RAMP_L = 200


# --- the arithmetic, in-process -----------------------------------------------------------------
def test_the_divisors_give_yarns_frequencies():
    for s in FACTORS:
        scaled, _ = yarn_frequencies(32, 10000.0, s, RAMP_L)
        divisors = yarn_divisors(32, 10000.0, s, RAMP_L)
        torch.testing.assert_close(inverse_frequencies(32, 10000.0, torch.float64) / divisors, scaled)
        assert divisors[0] < 1.01 and divisors[-1] == pytest.approx(s)  # kept high, interpolated low


def test_yarn_is_expressed_as_su_with_both_factor_lists_alike_and_its_temperature_in_the_weights():
    expressed = ctranslate2_rotary_scaling("yarn", 2.0, 32, 10000.0, RAMP_L)
    assert expressed.attributes.keys() == {"rotary_scaling_type", "rotary_scaling_long_factor",
                                           "rotary_scaling_short_factor"}  # no sin/cos multiplier of CTranslate2's
    assert expressed.attributes["rotary_scaling_type"] == "Su"
    assert expressed.attributes["rotary_scaling_long_factor"] == expressed.attributes["rotary_scaling_short_factor"]
    assert len(expressed.attributes["rotary_scaling_long_factor"]) == 16
    assert expressed.logit_multiplier == yarn_frequencies(32, 10000.0, 2.0, RAMP_L)[1] > 1.0
    unscaled = ctranslate2_rotary_scaling("yarn", 1.0, 32, 10000.0, RAMP_L)
    assert (unscaled.attributes, unscaled.logit_multiplier) == ({}, 1.0)


@pytest.mark.parametrize("tokens, bucket", [(0, 0), (9, 0), (10, 1), (14, 1), (15, 2), (19, 2), (20, 3),
                                            (29, 3), (30, 4), (39, 4), (40, 4), (500, 4)])
def test_a_sentence_goes_to_the_next_factor_up_from_its_length_over_L(tokens, bucket):
    assert bucket_of(tokens, 10, [1.0, *FACTORS]) == bucket  # tokens + </s> over L = 10


# --- the manifest is verified, not trusted (in-process, on a bucket export's records) -----------
VOCABULARY = ["<s>", "<blank>", "</s>", "<unk>", "w1", "w2", "w3"]


def fake_bucket_export(out, checkpoint, training_length=10, factors=(2.0, 3.0), with_vocabulary=True):
    """The records of ``fairseq-rope-export --length-buckets`` of ``checkpoint`` (the manifest, each
    bucket's export_info.json and vocabulary) around a stand-in model.bin: what the checks read."""
    info = dict(checkpoint=str(checkpoint.resolve()), size=checkpoint.stat().st_size,
                sha256=hashlib.sha256(checkpoint.read_bytes()).hexdigest(), data_bin="/data-bin", quantization="none",
                arch="transformer_rope_tiny", overrides={}, max_source_positions=64, max_target_positions=64)
    buckets = []
    for factor in (1.0, *factors):
        name = "plain" if factor == 1.0 else f"yarn_x{factor:g}"
        (out / name).mkdir(parents=True)
        (out / name / "model.bin").write_bytes(b"not a model")
        (out / name / "config.json").write_text("{}")
        (out / name / "shared_vocabulary.json").write_text(json.dumps(VOCABULARY))
        recorded = {"vocabulary": vocabulary_digests(out / name)} if with_vocabulary else {}
        (out / name / EXPORT_INFO).write_text(json.dumps(dict(info, overrides=bucket_overrides(factor, training_length),
                                                              **recorded)))
        buckets.append({"factor": factor, "directory": name})
    recorded = {"vocabulary": vocabulary_digests(out / "plain")} if with_vocabulary else {}
    (out / LENGTH_BUCKETS).write_text(json.dumps(dict(info, training_length=training_length, scaling="yarn",
                                                      buckets=buckets, **recorded)))
    return out


def _edit_json(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _swapped(out, tmp_path):
    (out / "plain").rename(tmp_path / "aside")
    (out / "yarn_x2").rename(out / "plain")
    (tmp_path / "aside").rename(out / "yarn_x2")


def _factor_edited(out, tmp_path):
    _edit_json(out / LENGTH_BUCKETS, lambda m: m["buckets"][1].update(factor=2.5))


def _length_edited(out, tmp_path):
    _edit_json(out / LENGTH_BUCKETS, lambda m: m.update(training_length=20))


def _from_another_checkpoint(out, tmp_path):
    other = tmp_path / "other.pt"
    other.write_bytes(b"another checkpoint")
    fake_bucket_export(tmp_path / "other", other)
    shutil.rmtree(out / "yarn_x2")
    shutil.copytree(tmp_path / "other" / "yarn_x2", out / "yarn_x2")


def _vocabulary_replaced(out, tmp_path):
    vocabulary = VOCABULARY[:4] + VOCABULARY[4:][::-1]  # the same tokens, other ids
    (out / "yarn_x3" / "shared_vocabulary.json").write_text(json.dumps(vocabulary))


SPOILED = {  # how a bucket export goes wrong -> the start of the refusal (after "--model-dir DIR: ")
    "swapped directories": (_swapped, "the bucket plain holds yarn x2 at L = 10, the manifest lists plain RoPE at L = 10"),
    "factor edited": (_factor_edited, "the bucket yarn_x2 holds yarn x2 at L = 10, the manifest lists yarn x2.5"),
    "L edited": (_length_edited, "the bucket plain holds plain RoPE at L = 10, the manifest lists plain RoPE at L = 20"),
    "another checkpoint's bucket": (_from_another_checkpoint, "the bucket yarn_x2 is an export of another checkpoint"),
    "a later bucket's vocabulary": (_vocabulary_replaced,
                                    "the bucket yarn_x3's vocabulary files are not those it was exported with"),
}


@pytest.fixture
def bucket_export(tmp_path):
    checkpoint = tmp_path / "checkpoint.pt"
    checkpoint.write_bytes(b"the checkpoint's bytes")
    return fake_bucket_export(tmp_path / "buckets", checkpoint), checkpoint


def test_a_bucket_export_as_written_is_verified_and_current(bucket_export):
    out, checkpoint = bucket_export
    assert [b["factor"] for b in verified_bucket_manifest(out)["buckets"]] == [1.0, 2.0, 3.0]
    assert exporter.is_current(str(out), str(checkpoint), length_buckets=(2.0, 3.0))


@pytest.mark.parametrize("spoil, problem", SPOILED.values(), ids=SPOILED.keys())
def test_export_if_changed_does_not_keep_a_spoiled_bucket(bucket_export, tmp_path, spoil, problem):
    """Case 3: --if-changed re-exports unless every bucket is the model the manifest lists."""
    out, checkpoint = bucket_export
    spoil(out, tmp_path)
    with pytest.raises(ValueError, match="^" + problem):
        verified_bucket_manifest(out)
    assert not exporter.is_current(str(out), str(checkpoint), length_buckets=(2.0, 3.0))


@pytest.mark.parametrize("spoil, problem", SPOILED.values(), ids=SPOILED.keys())
def test_translate_refuses_a_spoiled_bucket_by_name_before_loading_a_model(bucket_export, tmp_path, capsys,
                                                                           monkeypatch, spoil, problem):
    """Case 2: fairseq-rope-translate checks each bucket's own records against the manifest."""
    out, _ = bucket_export
    spoil(out, tmp_path)
    monkeypatch.setattr(ctranslate2_engine, "CTranslate2Engine", lambda *a: pytest.fail("a model was loaded"))
    (tmp_path / "in.txt").write_text("w1 w2\n")
    status, lines = translate_in_process(capsys, tmp_path / "in.txt", "--model-dir", out, "--input-format", "bpe",
                                    "--output-format", "bpe", "-o", tmp_path / "out.txt")
    assert status == 2 and len(lines) == 1, lines
    assert f"error: --model-dir {out}: {problem}" in lines[0], lines
    assert lines[0].endswith("export it again with fairseq-rope-export --length-buckets")
    assert not (tmp_path / "out.txt").exists()


def test_translate_checks_every_buckets_vocabulary_against_the_data_bin(tmp_path, capsys, monkeypatch):
    """Case 2: an export that records no vocabularies (older versions) is still checked bucket by
    bucket against the dictionaries, not by its first bucket only."""
    checkpoint = tmp_path / "checkpoint.pt"
    checkpoint.write_bytes(b"the checkpoint's bytes")
    out = fake_bucket_export(tmp_path / "buckets", checkpoint, with_vocabulary=False)
    _vocabulary_replaced(out, tmp_path)
    data_bin = tmp_path / "data-bin"
    data_bin.mkdir()
    for lang in ("en", "de"):
        (data_bin / f"dict.{lang}.txt").write_text("".join(f"{token} 1\n" for token in VOCABULARY[4:]))
    monkeypatch.setattr(ctranslate2_engine, "CTranslate2Engine", lambda *a: pytest.fail("a model was loaded"))
    (tmp_path / "in.txt").write_text("w1 w2\n")
    status, lines = translate_in_process(capsys, tmp_path / "in.txt", "--model-dir", out, "--data-bin", data_bin,
                                    "--src", "en", "--tgt", "de", "--input-format", "bpe", "--output-format", "bpe",
                                    "-o", tmp_path / "out.txt")
    assert status == 2 and len(lines) == 1, lines
    assert (f"--model-dir {out} was not exported with the dictionary of {data_bin}: token 4 of "
            f"{out / 'yarn_x3' / 'shared_vocabulary.json'} is 'w3'") in lines[0]


def test_a_negative_training_length_is_refused_as_such(tmp_path, capsys):
    """Not "the checkpoint does not record L": refused before the checkpoint is read."""
    (tmp_path / "checkpoint.pt").write_bytes(b"not read")
    (tmp_path / "data-bin").mkdir()
    with pytest.raises(SystemExit) as stopped:
        export_ctranslate2.main(["--checkpoint", str(tmp_path / "checkpoint.pt"), "--data-bin", str(tmp_path / "data-bin"),
                       "--output-dir", str(tmp_path / "out"), "--length-buckets", "--rope-scaling-original-length",
                       "-3"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1
    assert "error: --rope-scaling-original-length -3 is not a valid length: give L" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt", "data-bin"]


# --- the engine, end to end ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tiny_data_bin, tmp_path_factory):
    data_bin, save_dir = tiny_data_bin / "data-bin", tmp_path_factory.mktemp("bucket_model")
    run_cli(["fairseq-train", data_bin, "--user-dir", "fairseq_rope", "--arch", "transformer_rope_tiny",
             "--task", "translation", "--cpu", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "5e-3",
             "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "20", "--max-tokens", "1500", "--max-update",
             "150", "--seed", "1", "--criterion", "cross_entropy", "--disable-validation", "--no-epoch-checkpoints",
             "--save-dir", save_dir, "--num-workers", "0", "--log-format", "simple", "--log-interval", "50"])
    return data_bin, save_dir / "checkpoint_last.pt"


@pytest.fixture(scope="module")
def ramp_buckets(trained, tmp_path_factory):
    data_bin, checkpoint = trained
    out = tmp_path_factory.mktemp("ramp") / "buckets"
    run_cli([EXPORT, "--checkpoint", checkpoint, "--data-bin", data_bin, "--output-dir", out,
             "--length-buckets", *map(str, FACTORS), "--rope-scaling-original-length", str(RAMP_L)])
    return out


def yarn_override(s, length=RAMP_L):
    return ["--model-overrides", repr({"rope_scaling": "yarn", "rope_scaling_factor": s,
                                       "rope_scaling_original_length": length})]


@pytest.mark.e2e
def test_each_bucket_decodes_as_fairseq_generate_with_its_yarn_factor(trained, ramp_buckets):
    data_bin, checkpoint = trained
    manifest = read_bucket_manifest(ramp_buckets)
    assert [b["factor"] for b in manifest["buckets"]] == [1.0, *FACTORS] and manifest["training_length"] == RAMP_L
    plain = fairseq_generate_test_set(data_bin, checkpoint, 1)
    for s in FACTORS:
        bucket = ramp_buckets / f"yarn_x{s:g}"
        same, _, _ = agreement(data_bin, checkpoint, bucket, 1, *yarn_override(s))
        assert same == 1.0, s  # greedy: every sentence token for token
        same, fairseq_bleu, ct2_bleu = agreement(data_bin, checkpoint, bucket, 4, *yarn_override(s))
        assert same >= 0.98, (s, same, fairseq_bleu, ct2_bleu)
        # and the factor matters: the scaled model translates otherwise than the plain one
        scaled = ct2_translate(bucket, [plain[i][0] for i in sorted(plain)], 1)
        assert any(plain[i][1] != h for i, h in zip(sorted(plain), scaled)), s


@pytest.mark.e2e
def test_yarn_keeps_its_logit_temperature_at_a_factor_close_to_one(trained, tmp_path):
    """s = 1.1: YaRN's logit factor (0.1 ln 1.1 + 1)^2, 1.9 % above 1, is folded into the exported
    query and key projections, as for every factor > 1: greedy identical to fairseq-generate, and
    each token's log-probability as fairseq's to its printed precision. (Exported without the
    factor, as when it went through CTranslate2's integer sin/cos multiplier, which has no pair
    below s = 1.18: 2 of the 43 greedy translations differed, log-probabilities by up to 0.064.)"""
    data_bin, checkpoint = trained
    out = exporter.export(str(checkpoint), str(data_bin), str(tmp_path / "yarn_x1.1"), overrides={
        "rope_scaling": "yarn", "rope_scaling_factor": 1.1, "rope_scaling_original_length": RAMP_L})
    fairseq = fairseq_generate_test_set(data_bin, checkpoint, 1, *yarn_override(1.1))
    ids = sorted(fairseq)
    sources, hypotheses = [fairseq[i][0] for i in ids], [fairseq[i][1] for i in ids]
    assert ct2_translate(out, sources, 1) == hypotheses
    scored = ctranslate2.Translator(str(out), device="cpu", intra_threads=1).score_batch(sources, hypotheses)
    assert [len(r.log_probs) for r in scored] == [len(fairseq[i][3]) for i in ids]  # each token and </s>
    gap = max(abs(a - b) for i, r in zip(ids, scored) for a, b in zip(r.log_probs, fairseq[i][3]))
    assert gap < 1e-4, gap  # fairseq prints log2 to 4 decimals: 3.5e-5 apart at most


@pytest.mark.e2e
def test_a_single_yarn_export_is_the_bucket_model_of_its_factor(trained, ramp_buckets, tmp_path):
    """--rope-scaling yarn --rope-scaling-factor S alone writes the very model of bucket S."""
    data_bin, checkpoint = trained
    run_cli([EXPORT, "--checkpoint", checkpoint, "--data-bin", data_bin, "--output-dir", tmp_path / "yarn2",
             "--rope-scaling", "yarn", "--rope-scaling-factor", "2", "--rope-scaling-original-length", str(RAMP_L)])
    assert (tmp_path / "yarn2" / "model.bin").read_bytes() == (ramp_buckets / "yarn_x2" / "model.bin").read_bytes()
    assert (tmp_path / "yarn2" / "model.bin").read_bytes() != (ramp_buckets / "plain" / "model.bin").read_bytes()


@pytest.mark.e2e
def test_a_reversed_ramp_breaks_the_equivalence(trained, tmp_path, monkeypatch):
    data_bin, checkpoint = trained
    right = ctranslate2_scaling.yarn_divisors
    monkeypatch.setattr(ctranslate2_scaling, "yarn_divisors", lambda *a: right(*a).flip(0))  # gamma_i reversed
    out = exporter.export(str(checkpoint), str(data_bin), str(tmp_path / "reversed"),
                          overrides={"rope_scaling": "yarn", "rope_scaling_factor": 4.0,
                                     "rope_scaling_original_length": RAMP_L})
    same, _, _ = agreement(data_bin, checkpoint, out, 1, *yarn_override(4.0))
    assert same < 0.9


@pytest.mark.e2e
def test_translate_routes_each_sentence_to_its_bucket_and_short_ones_to_the_plain_model(trained, tiny_data_bin,
                                                                                       tmp_path):
    data_bin, checkpoint = trained
    buckets, plain = tmp_path / "buckets", tmp_path / "plain"
    run_cli([EXPORT, "--checkpoint", checkpoint, "--data-bin", data_bin, "--output-dir", buckets, "--length-buckets"])
    run_cli([EXPORT, "--checkpoint", checkpoint, "--data-bin", data_bin, "--output-dir", plain])
    manifest = read_bucket_manifest(buckets)
    L = manifest["training_length"]
    assert 5 < L < 20 and [b["factor"] for b in manifest["buckets"]] == [1.0, *exporter.DEFAULT_BUCKET_FACTORS]
    sources = [line.split() for line in (tiny_data_bin / "test.en").read_text().splitlines()]
    # the test sentences, then 2, 3 and 4 of them joined: inputs up to about 4 L long
    lines = sources + [sum(sources[i:i + n], []) for n in (2, 3, 4) for i in range(0, 12, n)]
    (tmp_path / "in.txt").write_text("".join(" ".join(s) + "\n" for s in lines))
    run_cli(["fairseq-rope-translate", "--model-dir", buckets, "--data-bin", data_bin, "--input-format", "bpe",
             "--output-format", "bpe", "--threads", "1", "--batch-size", "7", "--stats-json", tmp_path / "stats.json",
             "--output", tmp_path / "out.txt", tmp_path / "in.txt"])
    out = (tmp_path / "out.txt").read_text().splitlines()
    assert len(out) == len(lines)
    expected_buckets = [bucket_of(len(s), L, [1.0, *exporter.DEFAULT_BUCKET_FACTORS]) for s in lines]
    counts = json.loads((tmp_path / "stats.json").read_text())["length_buckets"]["sentences"]
    labels = ["plain"] + [f"yarn x{f:g}" for f in exporter.DEFAULT_BUCKET_FACTORS]
    assert counts == {label: expected_buckets.count(i) for i, label in enumerate(labels)}
    assert counts["plain"] >= 40 and sum(n > 0 for n in counts.values()) >= 3  # short and long ones both
    # in input order, each line as the model of its bucket translates it alone
    for index, directory in enumerate([plain] + [buckets / f"yarn_x{f:g}" for f in exporter.DEFAULT_BUCKET_FACTORS]):
        ids = [i for i, b in enumerate(expected_buckets) if b == index]
        if ids:
            alone = ct2_translate(directory, [lines[i] for i in ids], 4)
            assert [out[i] for i in ids] == [" ".join(h) for h in alone], directory.name
    # the manifest's models are plain exports too: an earlier bucket export may be replaced with --force
    proc = run_cli([EXPORT, "--checkpoint", checkpoint, "--data-bin", data_bin, "--output-dir", buckets,
                    "--length-buckets", "--if-changed"], check=False)
    assert proc.returncode == 0 and "nothing to do" in proc.stderr
    run_cli([EXPORT, "--checkpoint", checkpoint, "--data-bin", data_bin, "--output-dir", buckets,
             "--length-buckets", "2", "--force"])
    assert [b["factor"] for b in read_bucket_manifest(buckets)["buckets"]] == [1.0, 2.0]
    assert sorted(p.name for p in buckets.iterdir()) == ["bundle.json", LENGTH_BUCKETS, "plain", "yarn_x2"]


@pytest.mark.e2e
@pytest.mark.parametrize("flags, named", [
    (["--length-buckets", "0.5"], "--length-buckets: each factor must be a number > 1"),
    (["--length-buckets", "2", "2"], "--length-buckets: a factor is given twice"),
    (["--length-buckets", "--rope-scaling", "linear", "--rope-scaling-factor", "2"],
     "--length-buckets exports plain RoPE and static yarn per bucket"),
    (["--length-buckets", "--rope-scaling-original-length", "-3"],
     "--rope-scaling-original-length -3 is not a valid length"),
])
def test_bad_buckets_are_refused_in_one_line_and_write_nothing(trained, tmp_path, flags, named):
    data_bin, checkpoint = trained
    proc = run_cli([EXPORT, "--checkpoint", checkpoint, "--data-bin", data_bin, "--output-dir", tmp_path / "out",
                    *flags], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"fairseq-rope-export: error: {named}")
    assert list(tmp_path.iterdir()) == []
