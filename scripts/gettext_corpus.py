#!/usr/bin/env python3
"""Build a real English -> German (or other language) parallel corpus from the gettext catalogs
that Debian packages ship: every ``msgid`` is an English message written by a program's authors
and its ``msgstr`` the translation made by a human translator (GCC, git, coreutils, GIMP, ...).

It needs no internet beyond Debian's package archive, so it is the project's real-data corpus
where WMT cannot be downloaded. The domain is software messages -- mostly short sentences and
phrases, with placeholders such as ``%s`` -- so it tests translation of real language with real
vocabulary and real word order, not news.

    python scripts/gettext_corpus.py --out-dir work/gettext/raw            # apt-get download
    python scripts/gettext_corpus.py --out-dir work/gettext/raw --mo a.mo b.mo  # catalogs you have

What is kept: one pair per English message (the first in package order), with the context of a
``msgctxt`` dropped and a plural taken in its singular form; the pairs are single-line, have no
mnemonic underscore (``_Open``), are translated (the two sides differ) and have at least
``--min-words`` words a side. Valid and test are the pairs with the smallest hash of their English
side, so a package list that grows leaves most of them where they were; train is the rest, in
hash order. Output: ``OUT_DIR/{train,valid,test}.{en,LANG}``, written atomically, and
``OUT_DIR/catalogs.tsv``, pairs per catalog.
"""

import argparse
import gettext
import hashlib
import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_lines_atomically  # noqa: E402

# Debian bookworm packages with large German catalogs: compilers and tools, desktop programs.
DEFAULT_PACKAGES = [
    "gcc-12-locales", "cpp-12", "git", "coreutils", "util-linux-locales", "libc-l10n",
    "binutils-common", "gdb", "e2fsprogs-l10n", "gnupg-l10n", "tar", "wget", "make", "gettext",
    "grep", "findutils", "diffutils", "sed", "bash", "dpkg", "apt", "man-db", "parted", "rsync",
    "nano", "aptitude-common", "lynx-common", "vim-runtime", "inkscape", "gimp", "gnucash-common",
    "evolution-common", "gnome-control-center-data", "nautilus-data", "libgtk-3-common",
    "libglib2.0-data", "gparted", "thunar-data",
]


def download_packages(packages, download_dir: Path):
    """One .deb per package in ``download_dir``, fetched with ``apt-get download`` if absent."""
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            sys.exit(f"gettext_corpus.py: {tool} not found: reading Debian packages needs a Debian or"
                     " Ubuntu system; elsewhere pass compiled catalogs with --mo")
    download_dir.mkdir(parents=True, exist_ok=True)
    missing = [p for p in packages if not list(download_dir.glob(f"{p}_*.deb"))]
    if missing:
        result = subprocess.run(["apt-get", "download", *missing], cwd=download_dir)
        if result.returncode != 0:
            sys.exit(f"gettext_corpus.py: 'apt-get download' failed for some of: {' '.join(missing)};"
                     " check the names with 'apt-cache show', or pass --mo with catalogs you have")
    return [sorted(download_dir.glob(f"{p}_*.deb"))[-1] for p in packages]


def catalogs_in_deb(deb: Path, lang: str):
    """(name, bytes) of every ``LANG/LC_MESSAGES/*.mo`` in a Debian package."""
    tar_bytes = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], check=True,
                               capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as archive:
        for member in archive.getmembers():
            if member.isfile() and f"/{lang}/LC_MESSAGES/" in member.name and member.name.endswith(".mo"):
                yield f"{deb.name}:{Path(member.name).name}", archive.extractfile(member).read()


def message_pairs(mo_bytes: bytes):
    """(English, translation) of one compiled catalog, in msgid order."""
    catalog = gettext.GNUTranslations(io.BytesIO(mo_bytes))._catalog  # no public API lists it
    for key in sorted(catalog, key=str):
        msgid = key
        if isinstance(key, tuple):  # plural forms: (msgid, n); keep the singular
            if key[1] != 0:
                continue
            msgid = key[0]
        if msgid:  # the empty msgid is the catalog header
            yield msgid.split("\x04", 1)[-1], catalog[key]  # without a msgctxt


def usable(english: str, translation: str, min_words: int) -> bool:
    for text in (english, translation):
        if "\n" in text.strip() or "\t" in text or "_" in text:  # help screens, mnemonics
            return False
        if len(text.split()) < min_words:
            return False
    return english.strip() != translation.strip()


def stable_hash(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--lang", default="de", help="target language of the catalogs (default de)")
    p.add_argument("--packages", nargs="+", default=DEFAULT_PACKAGES,
                   help="Debian packages to take the catalogs from (default: a list of 38)")
    p.add_argument("--download-dir", type=Path, default=None,
                   help="where the .deb files are kept (default OUT_DIR/debs)")
    p.add_argument("--mo", type=Path, nargs="+", default=None,
                   help="compiled catalogs to read instead of downloading packages")
    p.add_argument("--min-words", type=int, default=2, help="words a side, at least (default 2)")
    p.add_argument("--valid-size", type=int, default=1000)
    p.add_argument("--test-size", type=int, default=1000)
    args = p.parse_args(argv)

    if args.mo:
        for path in args.mo:
            if not path.is_file():
                p.error(f"--mo: {path} is not a file")
        catalogs = [(str(path), path.read_bytes()) for path in args.mo]
    else:
        debs = download_packages(args.packages, args.download_dir or args.out_dir / "debs")
        catalogs = [catalog for deb in debs for catalog in catalogs_in_deb(deb, args.lang)]
        if not catalogs:
            sys.exit(f"gettext_corpus.py: no {args.lang}/LC_MESSAGES catalogs in the packages")

    pairs, per_catalog = {}, []
    for name, mo_bytes in catalogs:
        kept = 0
        for english, translation in message_pairs(mo_bytes):
            if not usable(english, translation, args.min_words):
                continue
            english, translation = " ".join(english.split()), " ".join(translation.split())
            if english not in pairs:
                pairs[english] = translation
                kept += 1
        per_catalog.append(f"{name}\t{kept}")

    held_out = args.valid_size + args.test_size
    if len(pairs) <= held_out:
        sys.exit(f"gettext_corpus.py: only {len(pairs)} pairs, fewer than --valid-size + --test-size")
    ordered = sorted(pairs, key=stable_hash)
    splits = {"test": ordered[:args.test_size], "valid": ordered[args.test_size:held_out],
              "train": ordered[held_out:]}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for split, english_lines in splits.items():
        write_lines_atomically(args.out_dir / f"{split}.en", english_lines)
        write_lines_atomically(args.out_dir / f"{split}.{args.lang}", (pairs[e] for e in english_lines))
    write_lines_atomically(args.out_dir / "catalogs.tsv", per_catalog)
    print(f"gettext_corpus.py: {len(pairs)} pairs from {len(catalogs)} catalogs: "
          + ", ".join(f"{s} {len(v)}" for s, v in splits.items()) + f" in {args.out_dir}")


if __name__ == "__main__":
    main()
