"""Values of a model configuration: reading one, and the errors a bad one raises. Shared by
every part of the plugin (the modules, the option table, the checkpoint rules)."""

import math


class OneLineError(Exception):
    """An error whose message names the flag or file and what to do: printed as one line."""


class OptionError(OneLineError, ValueError):
    """A model option with a value the plugin cannot use; the message names the flag."""


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
