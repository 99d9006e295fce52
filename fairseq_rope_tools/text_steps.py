"""The recipe's text steps that the commands share: reading a user's lines (with the way out of
--replace-invalid-utf8), prepare.sh's Moses tokenisation of one language, and the records
prepare.sh leaves beside each step's output."""


from fairseq_rope_base.text import remove_non_printing
from fairseq_rope_tools import text_lines

RECORD_HEADER = "# prepare.sh step record v1"


class CommandLineReader(text_lines.LineReader):
    """The strict reader of text_lines.py for a command that has --replace-invalid-utf8: its
    invalid-UTF-8 error offers that way out, and its replacements are reported as the command's lines."""

    fix = "fix the file, or pass --replace-invalid-utf8 to replace invalid bytes with U+FFFD"

    def report(self, say):
        """Each replacement as a line of ``say``."""
        for change in self.changes():
            say(change)


class RecipeTokenizer:
    """prepare.sh's tokenisation of one language: normalize-punctuation.perl,
    remove-non-printing-char.perl, then tokenizer.perl -a -no-escape (sacremoses)."""

    def __init__(self, lang: str):
        from sacremoses import MosesPunctNormalizer, MosesTokenizer

        self.normalizer, self.tokenizer = MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)

    def __call__(self, line: str) -> str:
        line = remove_non_printing(self.normalizer.normalize(line.rstrip("\n")))
        return self.tokenizer.tokenize(line, aggressive_dash_splits=True, return_str=True, escape=False)


def parse_step_record(text):
    """A step's record -> (options {name: value}, inputs {key: (size, sha256, path)}), or None for
    a marker without a record (written by an older prepare.sh)."""
    lines = text.splitlines()
    if RECORD_HEADER not in lines:
        return None
    options, inputs = {}, {}
    for line in lines:
        if line.startswith("option "):
            name, _, value = line[len("option "):].partition("=")
            options[name] = value
        elif line.startswith("input "):
            parts = line.split(" ", 4)
            if len(parts) == 5:
                inputs[parts[1]] = (parts[2], parts[3], parts[4])
    return options, inputs
