"""Bundles are read only inside themselves: a symbolic link inside a bundle (a file or a
directory, the manifest included) is refused by name rather than followed; a manifest that is too
large, nested too deep, not UTF-8 or not JSON is refused in one line naming it; an entry that
points outside the bundle is refused by name; and a directory without bundle.json is refused,
never loaded unverified, unless it is a length-bucket export (verified by its own manifest).
In-process, on the stand-in bundles of tests/tools/deploy/test_bundle.py and tests/tools/deploy/test_length_buckets.py."""

import json
import os
import re
import shutil

import pytest
from support.commands import translate_in_process
from test_bundle import prepared_work_dir, stand_in_bundle
from test_length_buckets import fake_bucket_export

from fairseq_rope_tools.deploy import ctranslate2_engine, exported, work_dir

AGAIN = "export it again with fairseq-rope-export"


@pytest.fixture
def single(tmp_path):
    """A single export's stand-in files and its bundle (as tests/tools/deploy/test_bundle.py builds it)."""
    segmentation = work_dir.segmentation_of(prepared_work_dir(tmp_path / "work"), "en", "de", "subword_nmt")
    stand_in_bundle(tmp_path / "export", segmentation)
    return tmp_path / "export"


@pytest.fixture
def buckets(tmp_path):
    """A --length-buckets export's stand-in records, with its bundle."""
    checkpoint = tmp_path / "checkpoint.pt"
    checkpoint.write_bytes(b"the checkpoint's bytes")
    out = fake_bucket_export(tmp_path / "buckets", checkpoint)
    exported.write_bundle(out, "en", "de", None)
    return out


def _refused_by_translate(capsys, monkeypatch, tmp_path, out, *flags):
    """fairseq-rope-translate's one line on ``out``, which must refuse it before loading a model."""
    monkeypatch.setattr(ctranslate2_engine, "CTranslate2Engine", lambda *a: pytest.fail("a model was loaded"))
    (tmp_path / "in.txt").write_text("w1\n")
    status, lines = translate_in_process(capsys, tmp_path / "in.txt", "--model-dir", out, "-o", tmp_path / "out.txt",
                                         *flags)
    assert status == 2 and len(lines) == 1 and f": error: --model-dir {out}: " in lines[0], lines
    assert not (tmp_path / "out.txt").exists()
    return lines[0]


# --- no symbolic link is followed --------------------------------------------------------------
def _linked_file(out, outside):  # the very same bytes: today it is hashed, matches, and is loaded
    shutil.copy(out / "model.bin", outside / "model.bin")
    (out / "model.bin").unlink()
    (out / "model.bin").symlink_to(outside / "model.bin")
    return "model.bin"


def _linked_codes(out, outside):
    shutil.copy(out / "bpe.codes", outside / "bpe.codes")
    (out / "bpe.codes").unlink()
    (out / "bpe.codes").symlink_to(outside / "bpe.codes")
    return "bpe.codes"


def _linked_manifest(out, outside):
    shutil.move(out / exported.BUNDLE, outside / exported.BUNDLE)
    (out / exported.BUNDLE).symlink_to(outside / exported.BUNDLE)
    return exported.BUNDLE


def _linked_directory(out, outside):  # not listed by the manifest, and not looked into today
    (outside / "extra").mkdir()
    (outside / "extra" / "source_vocabulary.json").write_text('["<s>"]')
    (out / "extra").symlink_to(outside / "extra", target_is_directory=True)
    return "extra"


LINKED = {"a model file": _linked_file, "a segmentation file": _linked_codes, "the manifest": _linked_manifest,
          "a directory": _linked_directory}


@pytest.mark.parametrize("link", LINKED.values(), ids=LINKED.keys())
def test_a_symbolic_link_inside_a_bundle_is_refused_by_name(single, tmp_path, link):
    (tmp_path / "outside").mkdir()
    name = link(single, tmp_path / "outside")
    with pytest.raises(ValueError, match=f"^{name} is a symbolic link .*a bundle's files must lie inside it"):
        exported.verified_bundle(single)


@pytest.mark.parametrize("link", LINKED.values(), ids=LINKED.keys())
def test_translate_refuses_a_symbolic_link_in_one_line_before_loading_a_model(single, tmp_path, capsys, monkeypatch,
                                                                              link):
    (tmp_path / "outside").mkdir()
    name = link(single, tmp_path / "outside")
    line = _refused_by_translate(capsys, monkeypatch, tmp_path, single)
    assert f"{name} is a symbolic link" in line and line.endswith(AGAIN), line


def test_a_linked_bucket_directory_is_refused_with_or_without_a_bundle_manifest(buckets, tmp_path):
    shutil.move(buckets / "yarn_x2", tmp_path / "yarn_x2")
    (buckets / "yarn_x2").symlink_to(tmp_path / "yarn_x2", target_is_directory=True)
    with pytest.raises(ValueError, match="^yarn_x2 is a symbolic link"):
        exported.verified_bundle(buckets)
    (buckets / exported.BUNDLE).unlink()  # an export of a version before bundles: followed today
    with pytest.raises(ValueError, match="^yarn_x2 is a symbolic link"):
        exported.verified_bundle(buckets)


def test_a_special_file_inside_a_bundle_is_refused_by_name(single):
    os.mkfifo(single / "pipe")  # opening it to hash it would wait for a writer for ever
    with pytest.raises(ValueError, match="^pipe is not a regular file"):
        exported.verified_bundle(single)


def test_the_bundle_directory_itself_may_be_given_through_a_link(single, tmp_path):
    (tmp_path / "current").symlink_to(single, target_is_directory=True)
    assert exported.verified_bundle(tmp_path / "current") == exported.verified_bundle(single)


# --- the manifest is bounded and every fault of it is one line naming it -------------------------
def _deeply_nested(path):
    path.write_text('{"format": ' + "[" * 100_000 + "]" * 100_000 + "}")
    return "nests deeper than"


def _nested_within_the_parser(path):  # parses without RecursionError, yet no manifest nests so deep
    manifest = json.loads(path.read_text())
    manifest["extra"] = json.loads("[" * 200 + "]" * 200)
    path.write_text(json.dumps(manifest))
    return "nests deeper than"


def _huge(path):  # 300 MB, sparse: read whole today
    with open(path, "r+b") as f:
        f.truncate(300 * 2**20)
    return f"is {300 * 2**20} bytes, more than"


def _binary(path):
    path.write_bytes(b"\xff\xfe\x00\x01" + bytes(range(256)))
    return "is not UTF-8 text"


def _not_json(path):
    path.write_text('{"format": "fairseq-rope bundle",')
    return "is not JSON"


MANIFESTS = {"deeply nested": _deeply_nested, "nested beyond a manifest": _nested_within_the_parser, "300 MB": _huge,
             "binary": _binary, "not JSON": _not_json}


@pytest.mark.parametrize("export, manifest", [("single", exported.BUNDLE), ("buckets", exported.LENGTH_BUCKETS)],
                         ids=["bundle.json", "length_buckets.json"])
@pytest.mark.parametrize("spoil", MANIFESTS.values(), ids=MANIFESTS.keys())
def test_a_manifest_that_is_no_manifest_is_refused_naming_it(request, export, manifest, spoil):
    out = request.getfixturevalue(export)
    path = out / manifest
    problem = spoil(path)
    with pytest.raises(ValueError) as refused:
        exported.verified_bundle(out)
    assert str(refused.value).startswith(f"{path} {problem}") and "\n" not in str(refused.value), refused.value


@pytest.mark.parametrize("spoil", MANIFESTS.values(), ids=MANIFESTS.keys())
def test_translate_refuses_such_a_manifest_in_one_line(single, tmp_path, capsys, monkeypatch, spoil):
    path = single / exported.BUNDLE
    problem = spoil(path)
    line = _refused_by_translate(capsys, monkeypatch, tmp_path, single)
    assert f"--model-dir {single}: {path} {problem}" in line and line.endswith(AGAIN), line


@pytest.mark.parametrize("entry", ["../outside.bin", "/etc/hostname", "sub/../../outside.bin"])
def test_a_manifest_entry_outside_the_bundle_is_refused_naming_it(single, tmp_path, capsys, monkeypatch, entry):
    path = single / exported.BUNDLE
    manifest = json.loads(path.read_text())
    manifest["files"][entry] = "0" * 64
    path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="^" + re.escape(f"{path} lists {entry!r}, a path outside the bundle")):
        exported.verified_bundle(single)
    line = _refused_by_translate(capsys, monkeypatch, tmp_path, single)
    assert f"{path} lists {entry!r}, a path outside the bundle" in line and line.endswith(AGAIN), line


@pytest.mark.parametrize("directory", ["../plain", "/tmp", "."])
def test_a_bucket_directory_outside_the_export_is_refused_naming_it(buckets, directory):
    path = buckets / exported.LENGTH_BUCKETS
    manifest = json.loads(path.read_text())
    manifest["buckets"][1]["directory"] = directory
    path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="^" + re.escape(f"{path} lists the bucket directory {directory!r}, which is "
                                                        "not a directory name inside the export")):
        exported.verified_bucket_manifest(buckets)


# --- a directory without bundle.json is no bundle (a length-bucket export aside) ------------------
def test_a_directory_without_a_manifest_is_refused(single, tmp_path, capsys, monkeypatch):
    (single / exported.BUNDLE).unlink()
    with pytest.raises(ValueError, match=r"^not a fairseq-rope-export bundle \(no bundle.json\)$"):
        exported.verified_bundle(single)
    expected = f"--model-dir {single}: not a fairseq-rope-export bundle (no bundle.json): {AGAIN}"
    assert _refused_by_translate(capsys, monkeypatch, tmp_path, single).endswith(expected)
    # with the languages and BPE input given, it used to load unverified
    line = _refused_by_translate(capsys, monkeypatch, tmp_path, single, "--src", "en", "--tgt", "de",
                                 "--input-format", "bpe", "--output-format", "bpe")
    assert line.endswith(expected), line


def test_a_length_bucket_export_without_a_bundle_manifest_is_verified_by_its_own(buckets, tmp_path, capsys,
                                                                                 monkeypatch):
    (buckets / exported.BUNDLE).unlink()
    assert exported.verified_bundle(buckets) is None
    (buckets / "plain" / "model.bin").unlink()
    with pytest.raises(ValueError, match="^the bucket plain has no model.bin"):
        exported.verified_bundle(buckets)
    line = _refused_by_translate(capsys, monkeypatch, tmp_path, buckets, "--input-format", "bpe", "--output-format",
                                 "bpe")
    assert "the bucket plain has no model.bin" in line and line.endswith(f"{AGAIN} --length-buckets"), line


def test_bundles_as_written_are_verified(single, buckets):
    """The bounds leave every real manifest alone: each is a few KB and nests 3 deep."""
    for out in (single, buckets):
        manifest = exported.verified_bundle(out)
        assert manifest == json.loads((out / exported.BUNDLE).read_text())
        assert (out / exported.BUNDLE).stat().st_size < 4096
    assert [b["directory"] for b in exported.verified_bucket_manifest(buckets)["buckets"]] == [
        "plain", "yarn_x2", "yarn_x3"]
