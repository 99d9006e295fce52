"""A POST /translate request of fairseq-rope-serve, read and checked: what it asks for, or the
one-line answer (:class:`RequestError`) that says what is wrong with it. Every message is one
line of bounded length, whatever the client sent (:func:`shown`).

Standard library only.
"""

import json
import unicodedata

from fairseq_rope_tools.text_lines import LINE_BREAKS

#: the fields of a request to POST /translate
FIELDS = ("text", "beam_size", "nbest", "scores")
LINE_BREAK_CHARACTERS = "\n" + LINE_BREAKS
#: the most characters of a client's text that a message or a log line repeats
SHOWN_CHARACTERS = 60


def shown(text: str, limit: int = SHOWN_CHARACTERS) -> str:
    """A client's text as a message or the log may repeat it: control and other invisible
    characters escaped (no forged line, no terminal escape), at most ``limit`` characters."""
    cut = text[:limit]
    safe = "".join(c if unicodedata.category(c)[0] not in "CZ" or c == " " else
                   (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}" if ord(c) < 0x10000
                    else f"\\U{ord(c):08x}") for c in cut)
    return safe + ("..." if len(text) > limit else "")


class RequestError(Exception):
    """What is wrong with a request, as its answer: an HTTP status and one line."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def json_kind(value) -> str:
    """A JSON value's kind, for a message: ``a string``, ``a number``, ..."""
    if isinstance(value, bool):
        return "true" if value else "false"
    kinds = ((str, "a string"), (int, "a number"), (float, "a number"), (list, "a list"), (dict, "an object"))
    return next((kind for cls, kind in kinds if isinstance(value, cls)), "null")


def count_field(data: dict, name: str, default: int, largest: int, bound: str) -> int:
    """The integer field ``name`` of a request (``default`` when absent), from 1 to ``largest``."""
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= largest:
        raise RequestError(400, f'"{name}" must be an integer from 1 to {largest} ({bound}), not '
                                f'{json.dumps(value, ensure_ascii=False)[:40]}')
    return value


def read_request(body: bytes, default_beam: int, max_beam: int, max_lines: int):
    """(sentences, beam size, nbest, scores) of a POST /translate body; RequestError if it is not
    a request the server takes."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(400, f"the request body is not UTF-8: byte 0x{body[e.start]:02x} at offset {e.start}; "
                                "send JSON in UTF-8") from None
    try:
        data = json.loads(text)
    except RecursionError:  # the parser recurses per level: a body of 100,000 "[" would be a 500
        raise RequestError(400, "the request body is JSON nested too deeply: send "
                                '{"text": ["a sentence", ...]}') from None
    except ValueError as e:
        where = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise RequestError(400, f"the request body is not JSON ({getattr(e, 'msg', e)}{where}): send "
                                '{"text": ["a sentence", ...]}') from None
    if not isinstance(data, dict):
        raise RequestError(400, f'the request body is {json_kind(data)}, not a JSON object: send '
                                '{"text": ["a sentence", ...]}')
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise RequestError(400, f'unknown field "{shown(unknown[0])}": a request has {", ".join(FIELDS)}')
    if "text" not in data:
        raise RequestError(400, 'the request has no "text": send {"text": ["a sentence", ...]}')
    sentences = data["text"]
    if not isinstance(sentences, list):
        raise RequestError(400, f'"text" must be a list of strings, not {json_kind(sentences)}: send '
                                '{"text": ["a sentence", ...]}')
    if len(sentences) > max_lines:
        raise RequestError(413, f"{len(sentences)} sentences in one request; the server takes at most {max_lines} "
                                "(--max-lines): split the request")
    for i, sentence in enumerate(sentences):
        if not isinstance(sentence, str):
            raise RequestError(400, f'"text"[{i}] must be a string, not {json_kind(sentence)}')
        brk = next((c for c in sentence if c in LINE_BREAK_CHARACTERS), None)
        if brk is not None:
            raise RequestError(400, f'"text"[{i}] holds a line break (U+{ord(brk):04X}): send each sentence as an '
                                    "item of its own")
        try:
            sentence.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(400, f'"text"[{i}] holds an unpaired surrogate (\\u{ord(sentence[e.start]):04x}), '
                                    "which is no character: send valid Unicode") from None
    beam = count_field(data, "beam_size", default_beam, max_beam, "--max-beam")
    nbest = count_field(data, "nbest", 1, beam, "the beam size")
    scores = data.get("scores", False)
    if not isinstance(scores, bool):
        raise RequestError(400, f'"scores" must be true or false, not {json_kind(scores)}')
    return sentences, beam, nbest, scores
