"""The one error class of the project: what a user must change, said in one line."""

from typing import Optional


class OneLineError(Exception):
    """Something the user must change -- a flag, a file, a directory: the message names it and
    what to do. Printed as one line, ``PROG: error: MESSAGE``, with exit status ``status``: 2 when
    it is refused before any work (as argparse refuses a flag), 1 when a step fails on the way.
    The plugin's errors (fairseq_rope.config_values) and the tools' UserError derive from it."""

    status = 2

    def __init__(self, message: str = "", status: Optional[int] = None):
        super().__init__(message)
        if status is not None:
            self.status = status
