"""fairseq-rope-gettext-corpus: a parallel corpus from compiled gettext catalogs (.mo files, or the
Debian packages that ship them)."""

import array
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from fairseq_rope_tools.data import gettext_corpus

HEADER = "Content-Type: text/plain; charset=UTF-8\nPlural-Forms: nplurals=2; plural=(n != 1);\n"


def write_mo(path, messages):
    """A compiled catalog in GNU .mo format: msgid -> msgstr (a msgctxt joined by \\x04, plural
    forms by \\x00, as msgfmt stores them)."""
    messages = {"": HEADER, **messages}
    keys = sorted(messages)
    ids, strs, entries = b"", b"", []
    for key in keys:
        key_bytes, value_bytes = key.encode(), messages[key].encode()
        entries.append((len(ids), len(key_bytes), len(strs), len(value_bytes)))
        ids += key_bytes + b"\0"
        strs += value_bytes + b"\0"
    key_start = 7 * 4 + 16 * len(keys)
    value_start = key_start + len(ids)
    key_table = [v for id_offset, id_len, _, _ in entries for v in (id_len, key_start + id_offset)]
    value_table = [v for _, _, s_offset, s_len in entries for v in (s_len, value_start + s_offset)]
    header = struct.pack("Iiiiiii", 0x950412DE, 0, len(keys), 7 * 4, 7 * 4 + 8 * len(keys), 0, 0)
    Path(path).write_bytes(header + array.array("i", key_table + value_table).tobytes() + ids + strs)


def read(out_dir, split, lang):
    return (out_dir / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()


def all_pairs(out_dir):
    return {e: d for split in ("train", "valid", "test")
            for e, d in zip(read(out_dir, split, "en"), read(out_dir, split, "de"))}


def test_keeps_translated_single_line_messages_and_drops_the_rest(tmp_path):
    first, second = tmp_path / "first.mo", tmp_path / "second.mo"
    write_mo(first, {
        "The file was not found.": "Die Datei wurde nicht gefunden.",
        "menu\x04Open the file": "Die Datei öffnen",
        "%d file was copied\x00%d files were copied": "%d Datei wurde kopiert\x00%d Dateien wurden kopiert",
        "File copied\x00%d files copied": "Kopiert\x00%d Dateien kopiert",  # singular too short
        "No  changes  were made.\n": "Es wurden keine Änderungen vorgenommen.\n",
        "_Open recent file": "Zuletzt _geöffnete Datei",
        "usage: copy FILE\n  copies a file": "Aufruf: copy DATEI\n  kopiert eine Datei",
        "Show line numbers": "Show line numbers",
        "Cancel": "Abbrechen",
    })
    write_mo(second, {"The file was not found.": "Datei nicht gefunden.",
                      "Remove the branch": "Den Zweig entfernen"})
    out = tmp_path / "out"
    gettext_corpus.main(["--out-dir", str(out), "--mo", str(first), str(second),
                         "--valid-size", "1", "--test-size", "1"])
    assert all_pairs(out) == {
        "The file was not found.": "Die Datei wurde nicht gefunden.",  # the first catalog wins
        "Open the file": "Die Datei öffnen",  # without its msgctxt
        "%d file was copied": "%d Datei wurde kopiert",  # the singular of a plural
        "No changes were made.": "Es wurden keine Änderungen vorgenommen.",  # whitespace normalized
        "Remove the branch": "Den Zweig entfernen",
    }
    assert (out / "catalogs.tsv").read_text().splitlines() == [f"{first}\t4", f"{second}\t1"]


def test_split_by_hash_is_disjoint_and_repeatable(tmp_path):
    mo = tmp_path / "many.mo"
    write_mo(mo, {f"message number {i} here": f"Nachricht Nummer {i} hier" for i in range(40)})
    outputs = []
    for name in ("a", "b"):
        gettext_corpus.main(["--out-dir", str(tmp_path / name), "--mo", str(mo),
                             "--valid-size", "5", "--test-size", "7"])
        outputs.append({f.name: f.read_bytes() for f in sorted((tmp_path / name).iterdir())})
    assert outputs[0] == outputs[1]
    out = tmp_path / "a"
    splits = {s: set(read(out, s, "en")) for s in ("train", "valid", "test")}
    assert [len(splits[s]) for s in ("train", "valid", "test")] == [28, 5, 7]
    assert not (splits["train"] & splits["valid"] or splits["train"] & splits["test"]
                or splits["valid"] & splits["test"])
    hashes = {s: sorted(gettext_corpus.stable_hash(e) for e in splits[s]) for s in splits}
    assert hashes["test"][-1] < hashes["valid"][0] and hashes["valid"][-1] < hashes["train"][0]


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")
def test_reads_the_target_language_catalogs_of_a_debian_package(tmp_path):
    root = tmp_path / "pkg"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(
        "Package: demo\nVersion: 1.0\nArchitecture: all\nMaintainer: t <t@example.org>\nDescription: d\n")
    for lang, words in (("de", "Die Datei öffnen"), ("fr", "Ouvrir le fichier")):
        catalog_dir = root / "usr" / "share" / "locale" / lang / "LC_MESSAGES"
        catalog_dir.mkdir(parents=True)
        write_mo(catalog_dir / "demo.mo", {"Open the file": words, "Close the window": f"{lang} window"})
    debs = tmp_path / "debs"
    debs.mkdir()
    subprocess.run(["dpkg-deb", "--build", "--root-owner-group", str(root), str(debs / "demo_1.0_all.deb")],
                   check=True, capture_output=True)
    out = tmp_path / "out"
    gettext_corpus.main(["--out-dir", str(out), "--packages", "demo", "--download-dir", str(debs),
                         "--valid-size", "0", "--test-size", "1"])  # present: nothing downloaded
    assert all_pairs(out) == {"Open the file": "Die Datei öffnen", "Close the window": "de window"}
    assert (out / "catalogs.tsv").read_text() == "demo_1.0_all.deb:demo.mo\t2\n"


def run_script(*args):
    return subprocess.run([sys.executable, "-m", gettext_corpus.__name__, *args], capture_output=True, text=True)


@pytest.mark.e2e
def test_bad_input_is_named(tmp_path):
    result = run_script("--out-dir", str(tmp_path / "out"), "--mo", str(tmp_path / "missing.mo"))
    assert result.returncode == 2 and "--mo" in result.stderr and "missing.mo" in result.stderr

    small = tmp_path / "small.mo"
    write_mo(small, {"Open the file": "Die Datei öffnen"})
    result = run_script("--out-dir", str(tmp_path / "out"), "--mo", str(small))
    assert result.returncode != 0 and "only 1 pairs" in result.stderr and "--test-size" in result.stderr
    assert not (tmp_path / "out").exists()
