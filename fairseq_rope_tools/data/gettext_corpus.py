#!/usr/bin/env python3
"""Build a real English -> German (or other language) parallel corpus from the gettext catalogs
that Debian packages ship: every ``msgid`` is an English message written by a program's authors
and its ``msgstr`` the translation made by a human translator (GCC, git, coreutils, GIMP, ...).

It needs no internet beyond Debian's package archive, so it is the project's real-data corpus
where WMT cannot be downloaded. The domain is software messages -- mostly short sentences and
phrases, with placeholders such as ``%s`` -- so it tests translation of real language with real
vocabulary and real word order, not news.

    fairseq-rope-gettext-corpus --out-dir work/gettext/raw            # apt-get download
    fairseq-rope-gettext-corpus --out-dir work/gettext/raw --mo a.mo b.mo  # catalogs you have

What is kept: one pair per English message (the first in package order), with the context of a
``msgctxt`` dropped and a plural taken in its singular form; the pairs are single-line, have no
mnemonic underscore (``_Open``), are translated (the two sides differ) and have at least
``--min-words`` words a side. Valid and test are the pairs with the smallest hash of their English
side, so a package list that grows leaves most of them where they were; train is the rest, in
hash order. Output: ``OUT_DIR/{train,valid,test}.{en,LANG}`` and ``OUT_DIR/catalogs.tsv``, pairs
per catalog.

OUT_DIR is written as one: the files are written into a hidden directory beside it, which then
replaces it in one rename, so a run that fails or is killed leaves the complete old corpus or the
complete new one, never new English beside old German. OUT_DIR must therefore hold nothing but
what this tool writes (the corpus, catalogs.tsv, and debs/, the download cache, which is kept).

A catalog that is not a valid compiled catalog (not a .mo, truncated, or text not in its declared
character set) stops the run when given with --mo, naming it; one inside a Debian package is
skipped with a warning naming the package and catalog, and counted as 0 pairs in catalogs.tsv.
"""

import argparse
import gettext
import hashlib
import io
import re
import shutil
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

from fairseq_rope_base.files import (
    outputs_over_inputs_problem,
    replace_directory,
    replaced_dir_problem,
    write_lines_atomically,
)
from fairseq_rope_tools.cli import ArgumentParser, UserError, command

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
            raise UserError(f"{tool} not found: reading Debian packages needs a Debian or Ubuntu system; elsewhere "
                            "pass compiled catalogs with --mo", status=1)
    download_dir.mkdir(parents=True, exist_ok=True)
    missing = [p for p in packages if not list(download_dir.glob(f"{p}_*.deb"))]
    if missing:
        result = subprocess.run(["apt-get", "download", *missing], cwd=download_dir)
        if result.returncode != 0:
            raise UserError(f"'apt-get download' failed for some of: {' '.join(missing)}; check the names with "
                            "'apt-cache show', or pass --mo with catalogs you have", status=1)
    return [sorted(download_dir.glob(f"{p}_*.deb"))[-1] for p in packages]


def catalogs_in_deb(deb: Path, lang: str):
    """(name, bytes) of every ``LANG/LC_MESSAGES/*.mo`` in a Debian package."""
    tar_bytes = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], check=True,
                               capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as archive:
        for member in archive.getmembers():
            if member.isfile() and f"/{lang}/LC_MESSAGES/" in member.name and member.name.endswith(".mo"):
                yield f"{deb.name}:{Path(member.name).name}", archive.extractfile(member).read()


def read_catalog(mo_bytes: bytes) -> dict:
    """The messages of a compiled catalog; a UserError says why the bytes are not one."""
    try:
        return gettext.GNUTranslations(io.BytesIO(mo_bytes))._catalog  # no public API lists it
    except UnicodeDecodeError as e:
        raise UserError(f"its text is not {e.encoding}, the character set its header declares ({e.reason})") from e
    except struct.error as e:
        raise UserError("it is truncated") from e
    except (OSError, ValueError) as e:  # "Bad magic number", "File is corrupt", a bad Plural-Forms
        reason = (e.strerror if isinstance(e, OSError) else None) or str(e)
        raise UserError(f"{reason[:1].lower()}{reason[1:]}") from e


def message_pairs(mo_bytes: bytes):
    """(English, translation) of one compiled catalog, in msgid order; a UserError if it is not
    one."""
    catalog = read_catalog(mo_bytes)
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


SPLIT_FILE = re.compile(r"(train|valid|test)\.[^/]+")


def written_here(name: str, carried) -> bool:
    """Whether an entry of OUT_DIR is one this tool writes (or keeps: the download cache)."""
    return bool(SPLIT_FILE.fullmatch(name)) or name == "catalogs.tsv" or name in carried


def cache_entries(out_dir: Path, download_dir: Path):
    """The entry of OUT_DIR that holds the download cache, when it is inside OUT_DIR."""
    try:
        return {download_dir.resolve().relative_to(out_dir.resolve()).parts[0]}
    except (ValueError, IndexError):
        return set()


def read_catalogs(catalogs, explicit: bool):
    """[(name, [(English, translation)] or None for a bad catalog)]. A bad catalog given with
    --mo (``explicit``) is refused; one from a package is skipped with a warning."""
    read = []
    for name, mo_bytes in catalogs:
        try:
            read.append((name, list(message_pairs(mo_bytes))))
        except UserError as e:
            if explicit:
                raise UserError(f"--mo {name} is not a valid compiled gettext catalog: {e}; give the .mo file that "
                                "msgfmt makes, or leave it out") from None
            print(f"gettext_corpus.py: warning: skipping {name}: not a valid compiled gettext catalog: {e}",
                  file=sys.stderr)
            read.append((name, None))
    return read


def split_by_hash(pairs: dict, valid_size: int, test_size: int) -> dict:
    """{split: English sides}: test and valid the smallest hashes, train the rest; disjoint."""
    ordered = sorted(pairs, key=stable_hash)
    held_out = valid_size + test_size
    splits = {"test": ordered[:test_size], "valid": ordered[test_size:held_out], "train": ordered[held_out:]}
    assert sum(map(len, splits.values())) == len(pairs) and len(splits["test"]) == test_size \
        and len(splits["valid"]) == valid_size, "the splits must be disjoint and cover every pair"
    return splits


@command
def main(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out-dir", type=Path, required=True,
                   help="where the corpus goes; replaced as a whole, so it must hold only what this tool writes")
    p.add_argument("--lang", default="de", help="target language of the catalogs (default de)")
    p.add_argument("--packages", nargs="+", default=DEFAULT_PACKAGES,
                   help="Debian packages to take the catalogs from (default: a list of 38); a bad catalog "
                        "in one is skipped with a warning")
    p.add_argument("--download-dir", type=Path, default=None,
                   help="where the .deb files are kept (default OUT_DIR/debs)")
    p.add_argument("--mo", type=Path, nargs="+", default=None,
                   help="compiled catalogs to read instead of downloading packages; a bad one is an error")
    p.add_argument("--min-words", type=int, default=2, help="words a side, at least (default 2)")
    p.add_argument("--valid-size", type=int, default=1000, help="pairs held out for validation (default 1000)")
    p.add_argument("--test-size", type=int, default=1000, help="pairs held out for testing (default 1000)")
    args = p.parse_args(argv)

    for flag, size in (("--valid-size", args.valid_size), ("--test-size", args.test_size)):
        if size < 0:
            p.error(f"{flag} must be 0 or more, not {size}")
    download_dir = args.download_dir or args.out_dir / "debs"
    carried = {"debs"} | cache_entries(args.out_dir, download_dir)
    problem = replaced_dir_problem("--out-dir", args.out_dir, "gettext_corpus.py",
                                   lambda name: written_here(name, carried))
    if problem:
        p.error(problem)
    if args.mo:
        for path in args.mo:
            if not path.is_file():
                p.error(f"--mo: {path} is not a file")
        written = [f"{split}.{lang}" for split in ("train", "valid", "test") for lang in ("en", args.lang)]
        problem = outputs_over_inputs_problem({f"--out-dir's {name}": args.out_dir / name for name in written},
                                              {"--mo": args.mo})
        if problem:
            p.error(problem)
        catalogs = [(str(path), path.read_bytes()) for path in args.mo]
    else:
        debs = download_packages(args.packages, download_dir)
        catalogs = [catalog for deb in debs for catalog in catalogs_in_deb(deb, args.lang)]
        if not catalogs:
            raise UserError(f"no {args.lang}/LC_MESSAGES catalogs in the packages", status=1)

    pairs, per_catalog = {}, []
    for name, messages in read_catalogs(catalogs, explicit=bool(args.mo)):
        kept = 0
        for english, translation in messages or ():
            if not usable(english, translation, args.min_words):
                continue
            english, translation = " ".join(english.split()), " ".join(translation.split())
            if english not in pairs:
                pairs[english] = translation
                kept += 1
        per_catalog.append(f"{name}\t{kept}")

    if len(pairs) <= args.valid_size + args.test_size:
        raise UserError(f"only {len(pairs)} pairs, fewer than --valid-size + --test-size "
                        f"({args.valid_size} + {args.test_size}) plus one for training", status=1)
    splits = split_by_hash(pairs, args.valid_size, args.test_size)

    def write_corpus(directory):
        for split, english_lines in splits.items():
            write_lines_atomically(Path(directory) / f"{split}.en", english_lines)
            write_lines_atomically(Path(directory) / f"{split}.{args.lang}", (pairs[e] for e in english_lines))
        write_lines_atomically(Path(directory) / "catalogs.tsv", per_catalog)

    replace_directory(args.out_dir, write_corpus, carry=sorted(carried))
    print(f"gettext_corpus.py: {len(pairs)} pairs from {len(catalogs)} catalogs: "
          + ", ".join(f"{s} {len(v)}" for s, v in splits.items()) + f" in {args.out_dir}")


if __name__ == "__main__":
    main()
