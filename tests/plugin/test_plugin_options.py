"""Each plugin option is declared once, in plugin_options.PLUGIN_OPTIONS: an option added by one
entry is a flag of fairseq's parser with its default in the help, is filled by the architecture
functions, is checked, and (when trained) is refused by the --model-overrides check. (~3 s)"""

import argparse
import re
import subprocess
import sys

import pytest
from fairseq import options

from fairseq_rope import plugin_options
from fairseq_rope.config_values import OptionError
from fairseq_rope.model_options import check_model_overrides, defines_trained_model
from fairseq_rope.plugin_options import (
    INFERENCE,
    TRAINED,
    PluginOption,
    describe_options,
    is_plugin_option,
    options_with_role,
    plugin_defaults,
)


def _at_most_one(args):
    if not 0 < args.toy_gain <= 1:
        raise OptionError(f"--toy-gain must be in (0, 1], got {args.toy_gain}")


# no rope_/rpe_ prefix: membership in the table, not the name, makes it a plugin option
TOY = PluginOption("toy_gain", 0.5, "a test option", ("transformer_rope",), type=float, metavar="G",
                   check=_at_most_one)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(plugin_options.PLUGIN_OPTIONS, TOY.name, TOY)
    return TOY


def parse(*flags, arch="transformer_rope_tiny"):
    parser = options.get_training_parser()
    return parser, options.parse_args_and_arch(parser, ["unused-data-dir", "--arch", arch, *flags])


def test_a_declared_option_is_a_flag_with_its_default_in_the_help(toy):
    parser, args = parse("--toy-gain", "0.25")
    assert args.toy_gain == 0.25
    assert "--toy-gain G a test option (default: 0.5)" in " ".join(parser.format_help().split())
    assert "--toy-gain" in describe_options().split("transformer_rpe:")[0]
    assert "--toy-gain" not in parse(arch="transformer_rpe_tiny")[0].format_help()


def test_the_architecture_fills_its_default_and_checks_it(toy):
    assert parse()[1].toy_gain == 0.5
    with pytest.raises(OptionError, match=r"--toy-gain must be in \(0, 1\], got 2.0"):
        parse("--toy-gain", "2")


def test_a_trained_option_cannot_be_overridden(toy):
    _, args = parse()
    assert is_plugin_option(toy.name) and defines_trained_model(toy.name)
    check_model_overrides(args, {toy.name: 0.5}, "ckpt.pt")  # restating it is allowed
    with pytest.raises(OptionError, match="toy_gain=0.7 differs from the value ckpt.pt was trained with"):
        check_model_overrides(args, {toy.name: 0.7}, "ckpt.pt")


def test_an_override_close_to_a_plugin_option_is_checked_not_ignored():
    from fairseq_rope.plugin_options import resembles_plugin_option

    assert resembles_plugin_option("rope_thetaa") and resembles_plugin_option("rpe_max_dist")
    # fairseq's own options, however close to a plugin option, are fairseq's
    assert not resembles_plugin_option("no_cross_attention") and not resembles_plugin_option("attention_dropout")


def test_an_inference_option_can_be_overridden(toy, monkeypatch):
    monkeypatch.setitem(plugin_options.PLUGIN_OPTIONS, toy.name, PluginOption(**{**vars(toy), "role": INFERENCE}))
    _, args = parse()
    assert not defines_trained_model(toy.name) and toy.name in options_with_role(INFERENCE)
    check_model_overrides(args, {toy.name: 0.7}, "ckpt.pt")


def test_without_the_entry_there_is_no_such_option():
    assert not is_plugin_option(TOY.name) and "toy_gain" not in plugin_defaults("transformer_rope")
    with pytest.raises(SystemExit):
        parse("--toy-gain", "0.25")


def test_fairseq_convention_no_argparse_defaults():
    """add_args sets no default: an option left off the command line is filled by the architecture."""
    from fairseq_rope.models.transformer_rope import TransformerRopeModel

    parser = argparse.ArgumentParser(argument_default=None)
    TransformerRopeModel.add_args(parser)
    args = parser.parse_args([])
    assert all(getattr(args, name) is None for name, option in plugin_options.PLUGIN_OPTIONS.items()
               if option.role != "recorded" and option.action is None and "transformer_rope" in option.models)


def test_every_flag_is_listed_with_its_default():
    listing = describe_options()
    for option in plugin_options.PLUGIN_OPTIONS.values():
        if option.role in (TRAINED, INFERENCE):
            assert option.flag in listing
    assert "--rope-scaling {none,linear,ntk,yarn,dynamic-ntk,dynamic-yarn}" in listing
    assert "(default: 10000)" in listing and "(default: interleaved)" in listing


def test_python_m_fairseq_rope_lists_exactly_the_flags_fairseqs_parser_adds():
    proc = subprocess.run([sys.executable, "-m", "fairseq_rope"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "transformer_rope_wmt_en_de" in proc.stdout
    assert "--rope-scaling {none,linear,ntk,yarn,dynamic-ntk,dynamic-yarn}" in proc.stdout

    def parser_flags(arch):
        parser = options.get_training_parser()
        options.parse_args_and_arch(parser, ["unused-data-dir", "--arch", arch])
        return {flag for flag in parser._option_string_actions if flag.startswith("--")}

    added = (parser_flags("transformer_rope_tiny") | parser_flags("transformer_rpe_tiny")) - parser_flags("transformer_tiny")
    assert set(re.findall(r"^  (--[\w-]+)", proc.stdout, re.MULTILINE)) == added
