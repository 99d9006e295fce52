"""The ONNX graphs' rotation (deploy/onnx_graphs.py) against the plugin's own: by positions (the
encoder's columns, each sentence's own positions) and by a decoding step's turn, one matrix for
the step's position, in both layouts, with every channel or half of them rotated."""

import pytest
import torch

from fairseq_rope.modules.rotary_embedding import RotaryEmbedding

onnx_graphs = pytest.importorskip("fairseq_rope_tools.deploy.onnx_graphs")

HEADS, HEAD_DIM, LENGTH = 3, 16, 40


def plugin_rotation(rotary, x, positions):
    """x (rows, heads, time, head_dim) rotated by the plugin at ``positions`` (rows, time)."""
    time_first = x.permute(2, 0, 1, 3).contiguous()
    rotated = rotary.rotate([time_first], positions, LENGTH, tuple(time_first.shape))[0]
    return rotated.view(time_first.shape).permute(1, 2, 0, 3)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, HEAD_DIM // 2])
def test_a_steps_turn_and_the_positions_rotate_as_the_plugin(layout, rotary_dim):
    torch.manual_seed(0)
    rotary = RotaryEmbedding(rotary_dim, theta=500.0, layout=layout)
    rotation = onnx_graphs._Rotation(rotary, LENGTH, HEAD_DIM)
    rows, time = 5, 7
    x = torch.randn(rows, HEADS, time, HEAD_DIM)
    positions = torch.randint(0, LENGTH, (rows, time))
    expected = plugin_rotation(rotary, x, positions)
    torch.testing.assert_close(rotation(x, positions), expected, rtol=0, atol=1e-6)
    columns = torch.arange(time)
    torch.testing.assert_close(rotation(x, columns), plugin_rotation(rotary, x, columns.expand(rows, -1)),
                               rtol=0, atol=1e-6)
    for step in (0, 1, 13, LENGTH - 1):  # a decoding step: every row's one token at position ``step``
        token = x[:, :, :1]
        at = torch.tensor([step])
        turned = rotation(token, rotation.turn(at))
        torch.testing.assert_close(turned, plugin_rotation(rotary, token, at.expand(rows, 1)), rtol=0, atol=1e-6)
        assert not torch.equal(turned, token) or step == 0
    channels_left = slice(rotary_dim, None)  # beyond the rotary channels: as they were, exactly
    assert torch.equal(rotation(x[:, :, :1], rotation.turn(torch.tensor([9])))[..., channels_left],
                       x[:, :, :1, channels_left])
