"""--rope-scaling kinds are one ScalingSpec each: a kind added by one registry entry is a choice
of fairseq's parser, with its help, and is checked by its spec; the exporter's own table, keyed by
the same names, expresses or refuses it in CTranslate2. (~2 s)"""

import pytest
import torch
from fairseq import options

from fairseq_rope.config_values import OptionError
from fairseq_rope.modules import rope_scaling
from fairseq_rope.modules.rope_scaling import ScalingSpec, check_scaling, rope_frequencies
from fairseq_rope.modules.rotary import inverse_frequencies, linear_frequencies
from fairseq_rope_tools.cli import UserError
from fairseq_rope_tools.deploy import ctranslate2_scaling
from fairseq_rope_tools.deploy.ctranslate2_scaling import ExportedScaling, ctranslate2_rotary_scaling


def _at_most_eight(s, length):
    if s > 8:
        raise OptionError(f"--rope-scaling toy-halved takes --rope-scaling-factor at most 8, got {s:g}")


TOY = ScalingSpec(
    "toy-halved", "linear interpolation by s / 2 (a test kind)",
    lambda d, theta, s, length: linear_frequencies(d, theta, s / 2, length),
    needs_training_length=True, check=_at_most_eight,
)


def _toy_in_ctranslate2(rotary_dim, theta, s, length):
    return {"rotary_scaling_type": "Linear", "rotary_scaling_factor": s / 2}


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(rope_scaling.ROPE_SCALINGS, TOY.name, TOY)
    monkeypatch.setitem(ctranslate2_scaling.EXPRESSIONS, TOY.name, _toy_in_ctranslate2)
    return TOY


def parse(*flags):
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, ["unused-data-dir", "--arch", "transformer_rope_tiny", *flags])
    return parser, args


def test_a_new_kind_is_a_choice_with_its_help_in_fairseqs_parser(toy):
    parser, args = parse("--rope-scaling", toy.name, "--rope-scaling-factor", "4",
                         "--rope-scaling-original-length", "16")
    assert args.rope_scaling == toy.name
    assert " ".join(parser.format_help().split()).count(f"{toy.name}: {toy.description}") == 1


def test_without_the_entry_the_kind_is_not_a_choice(capsys):
    with pytest.raises(SystemExit):
        parse("--rope-scaling", TOY.name)
    assert "invalid choice: 'toy-halved'" in capsys.readouterr().err


def test_a_new_kind_is_checked_by_its_spec(toy):
    check_scaling(toy.name, 8.0, 16)
    with pytest.raises(OptionError, match="toy-halved takes --rope-scaling-factor at most 8, got 9"):
        check_scaling(toy.name, 9.0, 16)
    with pytest.raises(OptionError, match="--rope-scaling toy-halved needs the training length L"):
        check_scaling(toy.name, 2.0, 0)
    with pytest.raises(OptionError, match="choose --rope-scaling linear, ntk, yarn or toy-halved"):
        check_scaling("none", 2.0)
    with pytest.raises(OptionError, match="at most 8, got 9"):  # the architecture function checks it
        parse("--rope-scaling", toy.name, "--rope-scaling-factor", "9", "--rope-scaling-original-length", "16")


def test_a_new_kind_computes_its_frequencies(toy):
    scaled, logit_scale = rope_frequencies(16, 10000.0, toy.name, 4.0, 16)
    torch.testing.assert_close(scaled, inverse_frequencies(16, 10000.0, torch.float64) / 2)
    assert logit_scale == 1.0


def test_a_new_kind_is_exported_as_the_exporters_table_says(toy, monkeypatch):
    assert ctranslate2_rotary_scaling(toy.name, 4.0, 16, 10000.0, 16) == ExportedScaling(
        {"rotary_scaling_type": "Linear", "rotary_scaling_factor": 2.0}, 1.0)
    monkeypatch.delitem(ctranslate2_scaling.EXPRESSIONS, toy.name)
    with pytest.raises(UserError, match=r"^--rope-scaling toy-halved: CTranslate2's rotary scalings do not "
                                        r"include it \(export with none, linear or yarn\)$") as refused:
        ctranslate2_rotary_scaling(toy.name, 4.0, 16, 10000.0, 16)
    assert refused.value.status == 2


@pytest.mark.parametrize("scaling, factor, expressed", [
    ("none", 1.0, {}),
    ("linear", 1.0, {}),
    ("linear", 4.0, {"rotary_scaling_type": "Linear", "rotary_scaling_factor": 4.0}),
    ("yarn", 1.0, {}),
])
def test_what_ctranslate2_expresses(scaling, factor, expressed):
    assert ctranslate2_rotary_scaling(scaling, factor, 16, 10000.0, 20) == ExportedScaling(expressed, 1.0)


@pytest.mark.parametrize("scaling, reason", [
    ("ntk", "CTranslate2's rotary scalings do not include it"),
    ("dynamic-ntk", "the factor is chosen per sentence, and CTranslate2 has one rotary scaling for every sentence"),
    ("dynamic-yarn", "the factor is chosen per sentence, and CTranslate2 has one rotary scaling for every sentence"),
])
def test_what_ctranslate2_refuses(scaling, reason):
    factor = 2.0 if rope_scaling.scaling_spec(scaling).takes_factor else 1.0
    with pytest.raises(UserError, match=f"^--rope-scaling {scaling}: {reason}"):
        ctranslate2_rotary_scaling(scaling, factor, 16, 10000.0, 20)


def test_a_new_kind_reaches_the_exporter_and_the_comparison_harness(toy, monkeypatch):
    """fairseq-rope-export and fairseq-rope-compare read the registry too: the exporter refuses
    or expresses the kind as its table says, the harness decodes with it."""
    from fairseq_rope_tools.deploy import ctranslate2_spec
    from fairseq_rope_tools.research.compare import command as compare_cli
    from fairseq_rope_tools.research.compare import decoding as compare_decoding

    _, args = parse("--rope-scaling", toy.name, "--rope-scaling-factor", "4", "--rope-scaling-original-length", "16")
    assert ctranslate2_spec.rotary_scaling(args).attributes == {"rotary_scaling_type": "Linear",
                                                                   "rotary_scaling_factor": 2.0}
    monkeypatch.delitem(ctranslate2_scaling.EXPRESSIONS, toy.name)
    with pytest.raises(UserError, match="^--rope-scaling toy-halved: CTranslate2's rotary "
                                                               "scalings do not include it"):
        ctranslate2_spec.check_exportable(args)

    compared = compare_cli.parse_args(["--raw-dir", "x", "--out-dir", "o", "--extrapolation-scaling", f"{toy.name}:4",
                                   "--rope-scaling-original-length", "16"])
    assert compare_decoding.extra_decodes(compared, "rope")[f"+{toy.name}x4"] == {
        "rope_scaling": toy.name, "rope_scaling_factor": 4.0, "rope_scaling_original_length": 16}
