"""Values of a model configuration: reading one, and the errors a bad one raises. Shared by
every part of the plugin (the modules, the option table, the checkpoint rules)."""

import atexit
import math
import os
import sys

from fairseq_rope_base.errors import OneLineError  # noqa: F401  (the plugin's modules raise it from here)


class OptionError(OneLineError, ValueError):
    """A model option with a value the plugin cannot use; the message names the flag."""


def one_line_excepthook(excepthook):
    """``sys.excepthook`` printing a OneLineError (an OptionError ...) that reaches the top of a
    command as ``PROG: error: MESSAGE`` with exit code 2, like argparse's errors, instead of a
    traceback; other exceptions go to ``excepthook``."""

    def print_one_line_errors(exc_type, exc, traceback):
        if not issubclass(exc_type, OneLineError):
            return excepthook(exc_type, exc, traceback)
        sys.stdout.flush()
        sys.stderr.write(f"{os.path.basename(sys.argv[0] or 'python')}: error: {exc}\n")
        sys.stderr.flush()
        # the interpreter would exit with 1 after an uncaught exception, and no public call changes
        # that from here: the exit handlers (e.g. removing the save dir's lock file) run first
        atexit._run_exitfuncs()
        os._exit(exc.status)

    return print_one_line_errors


def check_finite_positive(flag: str, value) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise OptionError(f"{flag} must be a finite positive number, got {value}")


def config_value(model_cfg, name, default=None):
    """``name`` of a model configuration: a dict, an argparse.Namespace or an omegaconf config."""
    if isinstance(model_cfg, dict):
        return model_cfg.get(name, default)
    try:
        return getattr(model_cfg, name, default)
    except Exception:  # noqa: BLE001 - omegaconf raises on missing keys of structured configs
        return default
