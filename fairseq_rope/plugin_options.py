"""Every option the plugin adds to fairseq's Transformer, each declared once in :data:`PLUGIN_OPTIONS`.

From a declaration come the flag a model adds (no argparse default: fairseq's architecture
functions fill them, :func:`plugin_defaults`), its help with the default appended, the check run
when the command line is parsed (:func:`check_plugin_options`), and its role:

* ``TRAINED``: defines the trained model; ``--model-overrides`` and resumes may only restate it;
* ``INFERENCE``: how a trained model runs (``--rope-scaling*``), free at generate time;
* ``RECORDED``: written by training into the checkpoint, never a flag.

Everything is read from the table when it is used, so a new entry is a new option everywhere.
"""

import argparse
import difflib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from .checkpoint_files import resumed_checkpoint, saved_model_config
from .config_values import OptionError, check_finite_positive
from .modules.random_positions import check_range_factor
from .modules.relative_position_attention import check_max_distance
from .modules.rope_scaling import check_scaling, scaling_help, scaling_names, scaling_spec
from .modules.rotary import LAYOUTS, rotary_dim_for
from .training_lengths import recorded_training_length, training_length

TRAINED, INFERENCE, RECORDED = "trained", "inference", "recorded"
ROPE, RPE = ("transformer_rope",), ("transformer_rpe",)
ATTENTION_KINDS = ("softmax", "linear")

Text = Union[str, Callable[[], str]]  # a callable is read when the parser is built


@dataclass(frozen=True)
class PluginOption:
    name: str  # the attribute of the model arguments; the flag is --name-with-dashes
    default: Any
    help: Text  # without the default, which is appended
    models: Tuple[str, ...]
    role: str = TRAINED
    type: Optional[Callable] = None
    choices: Union[Sequence[str], Callable[[], Sequence[str]], None] = None
    action: Optional[str] = None
    metavar: Optional[str] = None
    #: a further check of the parsed model arguments; raises OptionError naming the flag
    check: Optional[Callable[[Any], None]] = None

    @property
    def flag(self) -> str:
        return option_flag(self.name)

    def current_choices(self) -> Optional[Tuple[str, ...]]:
        return tuple(self.choices() if callable(self.choices) else self.choices) if self.choices else None

    def full_help(self) -> str:
        default = ("off" if self.default is False else f"{self.default:g}" if isinstance(self.default, float)
                   else self.default)
        return f"{self.help() if callable(self.help) else self.help} (default: {default})"

    def argparse_kwargs(self) -> dict:
        kwargs = dict(type=self.type, choices=self.current_choices(), action=self.action, metavar=self.metavar,
                      help=self.full_help().replace("%", "%%"))
        return {key: value for key, value in kwargs.items() if value is not None}


def _check_rotary_dims(args) -> None:
    for side in ("encoder", "decoder"):
        rotary_dim_for(getattr(args, f"{side}_embed_dim") // getattr(args, f"{side}_attention_heads"),
                       args.rope_fraction)


def _check_scaling(args) -> None:
    length = training_length(args)
    if not length and scaling_spec(args.rope_scaling).needs_training_length:
        # fairseq-train builds the model from the command line, before it loads the checkpoint it
        # resumes: the L that checkpoint records is not known yet, so the user must give it
        checkpoint = resumed_checkpoint(args)
        recorded = recorded_training_length(saved_model_config(checkpoint)) if checkpoint else 0
        if recorded:
            raise OptionError(
                f"--rope-scaling {args.rope_scaling} needs the training length L when the model is built, and "
                f"fairseq-train builds it from the command line before it loads {checkpoint}: pass "
                f"--rope-scaling-original-length {recorded}, the L that {checkpoint} records")
    check_scaling(args.rope_scaling, args.rope_scaling_factor, length)


def _check_rope_values(args) -> None:
    if args.rope_values and args.attention_kind == "linear":
        raise OptionError("--rope-values cannot be combined with --attention-kind linear")


def _check_random_positions(args) -> None:
    check_range_factor(args.rope_random_positions)
    if args.rope_random_positions != 1.0 and args.attention_kind == "linear":
        raise OptionError("--rope-random-positions applies to softmax attention: drop it, or --attention-kind linear")


PLUGIN_OPTIONS: Dict[str, PluginOption] = {option.name: option for option in (
    PluginOption("rope_theta", 10000.0, "RoPE base: theta_i = D^(-2(i-1)/d)", ROPE, type=float, metavar="D",
                 check=lambda args: check_finite_positive("--rope-theta", args.rope_theta)),
    PluginOption("rope_fraction", 1.0, "share of each head's dimensions that rotate, in (0, 1]; the rest carry "
                 "no position", ROPE, type=float, metavar="F", check=_check_rotary_dims),
    PluginOption("rope_layout", "interleaved", "interleaved: adjacent pairs, the paper's block-diagonal R; half: "
                 "GPT-NeoX rotate_half", ROPE, choices=LAYOUTS),
    PluginOption("rope_cross_attention", False, "also rotate encoder-decoder attention: queries by target "
                 "position, keys by source position", ROPE, action="store_true"),
    PluginOption("rope_values", False, "RoPER: also rotate values by their key position and the self-attention "
                 "output back by the query position, so value j enters query i as R(j-i) v_j", ROPE,
                 action="store_true", check=_check_rope_values),
    PluginOption("attention_kind", "softmax", "softmax, or linear: RoPE with linear attention (RoFormer eq. 19, "
                 "elu+1 features) in encoder and decoder self-attention", ROPE, choices=ATTENTION_KINDS),
    PluginOption("rope_random_positions", 1.0, "R: in training, each sequence of n tokens takes, in encoder and "
                 "decoder self-attention, the positions of an ordered random sample of n from 0 .. ceil(R n) - 1 "
                 "(Ruoss et al. 2023), so that longer relative distances are seen without longer data; inference "
                 "keeps 0 .. n - 1; 1: off", ROPE, type=float, metavar="R", check=_check_random_positions),
    PluginOption("rope_scaling", "none", scaling_help, ROPE, INFERENCE, choices=scaling_names,
                 check=_check_scaling),
    PluginOption("rope_scaling_factor", 1.0, "length extension factor s >= 1 for --rope-scaling", ROPE, INFERENCE,
                 type=float, metavar="S"),
    PluginOption("rope_scaling_original_length", 0, "L, the training length (tokens) of the --rope-scaling kinds "
                 "that need one; overrides the one the checkpoint records: the length 99% of training sequences "
                 "do not exceed; 0: unset", ROPE, INFERENCE, type=int, metavar="L"),
    PluginOption("rope_trained_length", 0, "the longest sequence seen in training (tokens)", ROPE, RECORDED),
    PluginOption("rope_trained_length_counts", None, "how many training sequences had each length", ROPE, RECORDED),
    PluginOption("rope_init_from", None, "where a fine-tuned model started: the path, sha256 and architecture of "
                 "--finetune-from-model (fairseq_rope/initialization.py)", ROPE, RECORDED),
    PluginOption("rpe_max_distance", 16, "relative distances are clipped to [-K, K]; 2K+1 learned key and value "
                 "vectors per layer", RPE, type=int, metavar="K",
                 check=lambda args: check_max_distance(args.rpe_max_distance)),
)}


def option_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def plugin_models() -> Tuple[str, ...]:
    return tuple(dict.fromkeys(model for option in PLUGIN_OPTIONS.values() for model in option.models))


def options_of(model: str) -> List[PluginOption]:
    return [option for option in PLUGIN_OPTIONS.values() if model in option.models]


def plugin_defaults(model: str) -> dict:
    """Every option of ``model`` with its default."""
    return {option.name: option.default for option in options_of(model)}


def fill_plugin_defaults(args, model: str) -> None:
    """What an architecture function of ``model`` does first: set each option the command line
    (or an older checkpoint) left unset."""
    for name, default in plugin_defaults(model).items():
        if getattr(args, name, None) is None:
            setattr(args, name, default)


def options_with_role(role: str) -> frozenset:
    return frozenset(name for name, option in PLUGIN_OPTIONS.items() if option.role == role)


def is_plugin_option(name: str) -> bool:
    return name in PLUGIN_OPTIONS


def resembles_plugin_option(name: str) -> bool:
    """A plugin option, or a name that fairseq's Transformer does not have and that is close to
    one (a typo such as rope_thetaa): an override of it is checked, and refused if the model has
    no such option, rather than silently ignored."""
    if is_plugin_option(name):
        return True
    return name not in _transformer_options() and bool(difflib.get_close_matches(name, PLUGIN_OPTIONS, cutoff=0.8))


@lru_cache(maxsize=None)
def _transformer_options() -> frozenset:
    from fairseq.models.transformer import TransformerModel

    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    TransformerModel.add_args(parser)
    return frozenset(action.dest for action in parser._actions)


def add_plugin_args(parser, model: str) -> None:
    """The flags of ``model``, with no argparse default (fairseq's convention: see plugin_defaults)."""
    for option in options_of(model):
        if option.role != RECORDED:
            parser.add_argument(option.flag, **option.argparse_kwargs())


def check_plugin_options(args, model: str) -> None:
    """Fail while the command line is parsed, naming the flag, before any layer is made."""
    for option in options_of(model):
        choices, value = option.current_choices(), getattr(args, option.name)
        if choices and value not in choices:
            raise OptionError(f"{option.flag} must be one of {', '.join(choices)}; got {value!r}")
        if option.check is not None:
            option.check(args)


def describe_options() -> str:
    """Each model's flags with their default, choices and help (what ``python -m fairseq_rope`` prints)."""
    lines = []
    for model in plugin_models():
        lines.append(f"{model}:")
        for option in options_of(model):
            if option.role != RECORDED:
                choices = option.current_choices()
                kind = f" {{{','.join(choices)}}}" if choices else f" {option.metavar}" if option.metavar else ""
                lines.append(f"  {option.flag}{kind}  [{option.role}]\n      {option.full_help()}")
    return "\n".join(lines)
