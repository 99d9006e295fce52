"""The lengths training records (the L of --rope-scaling yarn and dynamic-*): counted per batch,
saved in the checkpoint (continued across a resume: tests/plugin/test_checkpoints.py; merged by
averaging: tests/tools/checkpoints/test_average_checkpoints.py); L is the length 99 % of
training sequences do not exceed, the longest length for checkpoints without counts."""

import pytest
import torch
from support.models import model_with_dictionary

from fairseq_rope.config_values import OptionError
from fairseq_rope.model_options import check_model_overrides
from fairseq_rope.models.transformer_rope import training_length
from fairseq_rope.training_lengths import TrainingLengths, covering_length, recorded_training_length


def test_the_covering_length_of_counts():
    counts = [0, 0, 10, 880, 100, 9, 1]  # 1,000 sequences of 2 to 6 tokens
    assert covering_length(counts) == 4  # 990 have at most 4 tokens
    assert covering_length(counts, 99.1) == 5
    assert covering_length(counts, 100) == 6
    assert covering_length(counts, 50) == 3
    assert covering_length([]) == covering_length([0, 0]) == 0


def test_L_is_the_covering_length_else_the_longest_and_the_flag_wins():
    _, _, args = model_with_dictionary("transformer_rope_tiny")
    assert training_length(args) == 0
    args.rope_trained_length = 6
    assert training_length(args) == 6  # a checkpoint saved before the counts were recorded
    args.rope_trained_length_counts = [0, 0, 10, 880, 100, 9, 1]
    assert training_length(args) == recorded_training_length(args) == 4
    args.rope_scaling_original_length = 30
    assert training_length(args) == 30


def left_padded(dictionary, lengths, width):
    tokens = torch.full((len(lengths), width), dictionary.pad())
    for row, n in enumerate(lengths):
        tokens[row, width - n:] = torch.randint(4, len(dictionary), (n,))
    return tokens


def right_padded(dictionary, lengths, width):
    return left_padded(dictionary, lengths, width).flip(1)


def test_training_counts_the_non_pad_length_of_every_source_and_target():
    model, d, args = model_with_dictionary("transformer_rope_tiny")
    model.train()
    model(left_padded(d, [5, 9], 9), torch.tensor([5, 9]), right_padded(d, [7, 3], 7))
    model(left_padded(d, [4], 4), torch.tensor([4]), right_padded(d, [11], 11))
    model.eval()
    model(left_padded(d, [30], 30), torch.tensor([30]), right_padded(d, [2], 2))  # inference does not count
    record = {}
    model.training_lengths.record_in(record)
    assert record["rope_trained_length"] == 11
    expected = [0] * 12
    for n in (5, 9, 7, 3, 4, 11):
        expected[n] += 1
    assert record["rope_trained_length_counts"] == expected
    # a model built from that record continues its counts
    args.rope_trained_length, args.rope_trained_length_counts = 11, expected
    continued = TrainingLengths(args)
    continued.count(torch.tensor([2, 13]), 13)
    record = {}
    continued.record_in(record)
    assert record["rope_trained_length"] == 13
    assert record["rope_trained_length_counts"] == [0, 0, 1] + expected[3:] + [0, 1]


def test_the_record_is_not_an_option_to_override():
    saved = {"arch": "transformer_rope_tiny", "rope_trained_length": 11, "rope_trained_length_counts": [0, 3, 5]}
    check_model_overrides(saved, {"rope_trained_length": 11, "rope_trained_length_counts": [0, 3, 5]},
                          "ckpt.pt")  # restating is allowed
    with pytest.raises(OptionError, match="rope_trained_length=20 differs from what training recorded"):
        check_model_overrides(saved, {"rope_trained_length": 20}, "ckpt.pt")
    with pytest.raises(OptionError, match="differs from what training recorded"):
        check_model_overrides(saved, {"rope_trained_length_counts": [0, 3, 6]}, "ckpt.pt")


def test_the_L_a_scaled_model_uses_is_logged(caplog):
    with caplog.at_level("INFO", logger="fairseq_rope.models.transformer_rope"):
        model_with_dictionary("transformer_rope_tiny", "--rope-scaling", "dynamic-yarn", "--rope-scaling-original-length", 7)
    assert "--rope-scaling dynamic-yarn: L = 7 tokens (--rope-scaling-original-length)" in caplog.text
