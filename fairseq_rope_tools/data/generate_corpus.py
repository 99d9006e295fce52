#!/usr/bin/env python3
"""Generate a deterministic synthetic English -> German-like parallel corpus.

The target language is a small, regular fragment of German grammar, chosen so that a
translation model has to use word order and positions, not just a bag of words:

* **verb-final subordinate clauses** -- ``..., because the dog sees the cat .`` becomes
  ``..., weil der Hund die Katze sieht .``: the finite verb moves to the end of the clause,
  behind the object and any prepositional phrases;
* **verb brackets** -- perfect tense and modal verbs split the verb: ``the dog has seen the cat
  behind the house`` -> ``der Hund hat die Katze hinter dem Haus gesehen``;
* **verb-second inversion** after a fronted adverb: ``today the dog sees the cat`` ->
  ``heute sieht der Hund die Katze``;
* **agreement over distance** -- the clause-final verb agrees in number with a subject that may
  be many tokens away (``weil die Hunde ... gesehen haben``), and article and adjective endings
  agree with the gender, case and number of a noun that comes after them
  (``der große Hund`` / ``den großen Hund`` / ``ein großer Hund`` / ``das große Haus``);
* **numbers** -- English ``twenty-one`` becomes German ``einundzwanzig`` (units before tens), and
  numbers also appear as digits;
* **a range of sentence lengths** -- one to three coordinated or subordinated clauses with
  optional adjectives and prepositional phrases, from about 4 to about 60 words.

Output: ``OUT_DIR/{train,valid,test}.{en,de}``, one sentence per line, detokenized (natural
punctuation), UTF-8. The same ``--seed`` always gives byte-identical files; valid and test
sentences never occur in train. OUT_DIR is written as one (the files go into a hidden directory
beside it, which then replaces it in one rename: a failed run leaves the complete old corpus or
the complete new one), so it must hold nothing but these files.

Usage: ``fairseq-rope-generate-corpus --out-dir work/corpus --train-size 30000``
"""

import re
import sys
from pathlib import Path

from fairseq_rope_base.files import replace_directory, replaced_dir_problem, write_lines_atomically
from fairseq_rope_tools.cli import ArgumentParser, UserError, command
from fairseq_rope_tools.data.synthetic_grammar import generate

SPLIT_FILE = re.compile(r"(train|valid|test)\.[^/]+")


@command
def main(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", required=True,
                   help="directory for {train,valid,test}.{SRC,TGT}; replaced as a whole")
    p.add_argument("--seed", type=int, default=1, help="random seed (same seed, same files)")
    p.add_argument("--train-size", type=int, default=30000)
    p.add_argument("--valid-size", type=int, default=500)
    p.add_argument("--test-size", type=int, default=500)
    p.add_argument("--src", default="en", help="file suffix of the English side")
    p.add_argument("--tgt", default="de", help="file suffix of the German-like side")
    args = p.parse_args(argv)
    for name in ("train_size", "valid_size", "test_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    out = Path(args.out_dir)
    problem = replaced_dir_problem("--out-dir", out, "generate_corpus.py", SPLIT_FILE.fullmatch)
    if problem:
        p.error(problem)
    sizes = [("train", args.train_size), ("valid", args.valid_size), ("test", args.test_size)]
    try:
        data = generate(args.seed, sizes)
    except RuntimeError as e:
        raise UserError(f"{e}: ask for fewer sentences", status=1) from None

    def write_corpus(directory):
        for split, pairs in data.items():
            write_lines_atomically(Path(directory) / f"{split}.{args.src}", (en for en, _ in pairs))
            write_lines_atomically(Path(directory) / f"{split}.{args.tgt}", (de for _, de in pairs))

    replace_directory(out, write_corpus)
    total = sum(n for _, n in sizes)
    print(f"[generate_corpus] wrote {total} sentence pairs (seed {args.seed}) to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
