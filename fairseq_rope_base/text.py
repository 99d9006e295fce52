"""A text step both the plugin's tokenizer (fairseq_rope.text_encoders) and the tools' recipe
steps (fairseq_rope_tools.text_steps) run, written once. Standard library only."""

import unicodedata


def remove_non_printing(text: str) -> str:
    """remove-non-printing-char.perl: every character of Unicode category C* becomes a space."""
    if text.isprintable():  # no character of a category C* (nor Z* but the space): nothing to do, fast
        return text
    return "".join(" " if unicodedata.category(ch).startswith("C") else ch for ch in text)
