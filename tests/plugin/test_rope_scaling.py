"""--rope-scaling {none,linear,ntk,yarn}: the frequencies each method prescribes, factor 1 is a
no-op, the state dict never changes, and the flags work at generate time via --model-overrides."""

import math

import pytest
import torch
from support.commands import fairseq_generate_stdout, run_cli
from support.models import model_with_dictionary

from fairseq_rope.models.transformer_rope import TransformerRopeModel
from fairseq_rope.modules.rope_scaling import ROPE_SCALINGS, rope_frequencies
from fairseq_rope.modules.rotary import inverse_frequencies, rotation_angles
from fairseq_rope_tools.cli import plugin_dir


def scaled_inverse_frequencies(rotary_dim, theta, scaling, factor, original_length=0, dtype=None):
    return rope_frequencies(rotary_dim, theta, scaling, factor, original_length)[0]


def attention_temperature(scaling, factor):
    return rope_frequencies(64, 10000.0, scaling, factor, original_length=256)[1]


@pytest.mark.parametrize("scaling", list(ROPE_SCALINGS))
def test_factor_one_is_no_scaling(scaling):
    base = inverse_frequencies(32, 10000.0, dtype=torch.float64)
    scaled = scaled_inverse_frequencies(32, 10000.0, scaling, 1.0, original_length=64, dtype=torch.float64)
    torch.testing.assert_close(scaled, base, rtol=1e-12, atol=0)
    assert attention_temperature(scaling, 1.0) == 1.0


@pytest.mark.parametrize("scaling", ["linear", "ntk", "yarn"])
def test_factor_one_model_equals_unscaled_model(scaling):
    plain, d, _ = model_with_dictionary("transformer_rope_tiny", "--rope-values")
    scaled, _, _ = model_with_dictionary("transformer_rope_tiny", "--rope-values", "--rope-scaling", scaling,
                                         "--rope-scaling-factor", "1", "--rope-scaling-original-length", "8")
    assert plain.state_dict().keys() == scaled.state_dict().keys()
    scaled.load_state_dict(plain.state_dict())
    plain.eval(), scaled.eval()
    src = torch.randint(4, 30, (2, 40))
    prev = torch.randint(4, 30, (2, 30))
    lengths = torch.full((2,), 40)
    with torch.no_grad():
        torch.testing.assert_close(scaled(src, lengths, prev)[0], plain(src, lengths, prev)[0], atol=0, rtol=0)
        stretched, _, _ = model_with_dictionary("transformer_rope_tiny", "--rope-values", "--rope-scaling", scaling,
                                                "--rope-scaling-factor", "4", "--rope-scaling-original-length", "8")
        stretched.load_state_dict(plain.state_dict())
        stretched.eval()
        assert not torch.allclose(stretched(src, lengths, prev)[0], plain(src, lengths, prev)[0], atol=1e-3)


def test_linear_scaling_interpolates_positions():
    base = inverse_frequencies(16, 10000.0, dtype=torch.float64)
    scaled = scaled_inverse_frequencies(16, 10000.0, "linear", 4.0, dtype=torch.float64)
    positions = torch.arange(0, 400, 4)
    # position m under factor s has the angles of position m / s unscaled
    torch.testing.assert_close(rotation_angles(positions, scaled), rotation_angles(positions // 4, base))


def test_ntk_scaling_keeps_the_highest_and_interpolates_the_lowest_frequency():
    d, s = 16, 8.0
    base = inverse_frequencies(d, 10000.0, dtype=torch.float64)
    scaled = scaled_inverse_frequencies(d, 10000.0, "ntk", s, dtype=torch.float64)
    assert scaled[0] == base[0] == 1.0
    torch.testing.assert_close(scaled[-1], base[-1] / s)
    assert torch.all(scaled[1:] < base[1:])


def test_yarn_scaling_by_parts_and_temperature():
    d, s, length = 64, 4.0, 256
    base = inverse_frequencies(d, 10000.0, dtype=torch.float64)
    scaled = scaled_inverse_frequencies(d, 10000.0, "yarn", s, original_length=length, dtype=torch.float64)
    ratio = length * base / (2 * math.pi)  # r = L / wavelength
    high, low = ratio > 32, ratio < 1
    assert high.any() and low.any() and (~high & ~low).any()
    torch.testing.assert_close(scaled[high], base[high])  # extrapolated: unchanged
    torch.testing.assert_close(scaled[low], base[low] / s)  # interpolated like linear scaling
    middle = ~high & ~low
    assert torch.all(scaled[middle] < base[middle]) and torch.all(scaled[middle] > base[middle] / s)
    assert attention_temperature("yarn", s) == pytest.approx((0.1 * math.log(s) + 1) ** 2)
    assert attention_temperature("ntk", s) == 1.0


def test_checkpoint_args_without_new_flags_get_defaults():
    """A checkpoint saved before these flags existed still builds (build_model fills defaults)."""
    model, dictionary, args = model_with_dictionary("transformer_rope_tiny")
    for name in ("rope_values", "attention_kind", "rope_scaling", "rope_scaling_factor",
                 "rope_scaling_original_length"):
        delattr(args, name)

    class Task:
        source_dictionary = target_dictionary = dictionary

    rebuilt = TransformerRopeModel.build_model(args, Task())
    rebuilt.load_state_dict(model.state_dict())
    assert args.rope_scaling == "none" and args.rope_scaling_factor == 1.0 and not args.rope_values


@pytest.mark.e2e
def test_scaling_at_generate_time_through_model_overrides(tiny_data_bin, tmp_path):
    data = tiny_data_bin / "data-bin"
    save = tmp_path / "ckpt"
    run_cli([
        "fairseq-train", data, "--user-dir", "fairseq_rope", "--arch", "transformer_rope_tiny",
        "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500", "--max-update", "3",
        "--save-dir", save, "--no-epoch-checkpoints", "--disable-validation", "--seed", "1",
        "--num-workers", "0", "--log-format", "simple",
    ])

    def generate(overrides, checkpoint="checkpoint_last.pt", command=False):
        """The hypotheses; decoded by the command itself (``command``) or its main in this process."""
        args = [data, "--user-dir", plugin_dir(), "--path", save / checkpoint,
                "--beam", "2", "--batch-size", "20", "--gen-subset", "test", "--num-workers", "0"]
        if overrides:
            args += ["--model-overrides", overrides]
        return sorted(line for line in fairseq_generate_stdout(args, command).splitlines() if line.startswith("H-"))

    n_test = len((tiny_data_bin / "test.en").read_text().splitlines())
    plain = generate(None)
    assert len(plain) == n_test
    yarn_override = "{'rope_scaling': 'yarn', 'rope_scaling_factor': 4.0, 'rope_scaling_original_length': 4}"
    assert generate(yarn_override, command=True) == generate(yarn_override)  # the command is its main
    assert generate("{'rope_scaling': 'ntk', 'rope_scaling_factor': 1.0}") == plain
    yarn = generate(yarn_override)
    assert len(yarn) == n_test and yarn != plain

    # training recorded L, from the lengths of its sources and targets (2 to 10 words and EOS): no flag needed
    state = torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    assert 3 <= state["cfg"]["model"]["rope_trained_length"] <= 11
    assert sum(state["cfg"]["model"]["rope_trained_length_counts"]) > 0
    assert len(generate("{'rope_scaling': 'dynamic-yarn'}")) == n_test
    assert len(generate("{'rope_scaling': 'yarn', 'rope_scaling_factor': 2.0}")) == n_test
    # an explicit L wins; above every test length, dynamic scaling is plain RoPE
    assert generate("{'rope_scaling': 'dynamic-yarn', 'rope_scaling_original_length': 64}") == plain
    # L is the length 99 % of the recorded sequences do not exceed, not the longest
    state["cfg"]["model"]["rope_trained_length"] = 11
    state["cfg"]["model"]["rope_trained_length_counts"] = [0] * 5 + [99] + [0] * 5 + [1]
    torch.save(state, save / "skewed.pt")
    skewed = generate("{'rope_scaling': 'dynamic-yarn'}", "skewed.pt")
    assert skewed == generate("{'rope_scaling': 'dynamic-yarn', 'rope_scaling_original_length': 5}")
    assert skewed != generate("{'rope_scaling': 'dynamic-yarn', 'rope_scaling_original_length': 11}")
    del state["cfg"]["model"]["rope_trained_length"]  # a checkpoint saved before L was recorded
    del state["cfg"]["model"]["rope_trained_length_counts"]
    torch.save(state, save / "old.pt")
    bad = run_cli(args=["fairseq-generate", data, "--user-dir", "fairseq_rope", "--path", save / "old.pt",
                        "--model-overrides", "{'rope_scaling': 'dynamic-ntk'}"], check=False)
    assert bad.returncode != 0 and "pass --rope-scaling-original-length L" in bad.stderr.splitlines()[-1]


def test_a_rotary_embedding_checks_its_scaling_once_where_it_is_built(monkeypatch):
    from fairseq_rope.modules import rope_scaling, rotary_embedding

    calls, real = [], rope_scaling.check_scaling

    def counted(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(rope_scaling, "check_scaling", counted)
    monkeypatch.setattr(rotary_embedding, "check_scaling", counted)
    for scaling, factor in (("none", 1.0), ("yarn", 4.0), ("dynamic-yarn", 1.0)):
        calls.clear()
        rotary_embedding.RotaryEmbedding(16, 10000.0, scaling=scaling, scaling_factor=factor, original_length=64)
        assert len(calls) == 1, (scaling, calls)
