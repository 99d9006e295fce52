"""--rope-scaling in CTranslate2 (fairseq_rope_tools.deploy.ctranslate2_scaling): the plugin's
registry says what the model needs and nothing of the engine; the exporter's table, keyed by kind,
expresses or refuses each kind; the logit multiplier (YaRN's temperature) folded into the exported
query and key projections gives the attention of fairseq's model with its temperature, for every
factor and rotary fraction. In-process. (~3 s)"""

import copy
import dataclasses
import inspect
import math
from types import SimpleNamespace

import pytest
import torch
from support.models import model_with_dictionary

from fairseq_rope.modules import rope_scaling
from fairseq_rope.modules.rope_scaling import ROPE_SCALINGS, ScalingSpec
from fairseq_rope_tools.deploy.ctranslate2_scaling import EXPRESSIONS, REFUSALS, fold_logit_multiplier

pytest.importorskip("ctranslate2")
from fairseq_rope_tools.deploy import ctranslate2_spec  # noqa: E402  (after the skip)


def test_the_plugins_registry_knows_nothing_of_the_engine():
    assert "ctranslate2" not in inspect.getsource(rope_scaling).lower()
    assert [field.name for field in dataclasses.fields(ScalingSpec)] == [
        "name", "description", "frequencies", "takes_factor", "per_sentence", "needs_training_length", "check"]


def test_every_kind_is_either_expressed_or_refused_by_the_exporters_table():
    assert EXPRESSIONS.keys() | REFUSALS.keys() == ROPE_SCALINGS.keys()
    assert not EXPRESSIONS.keys() & REFUSALS.keys()


def exported_spec(*flags):
    """(model in eval mode, the TransformerSpec fairseq-rope-export builds from it, its args)."""
    model, dictionary, args = model_with_dictionary("transformer_rope_tiny", *flags)
    model.eval()
    with torch.no_grad():
        spec = ctranslate2_spec.build_spec(args, model, SimpleNamespace(source_dictionary=dictionary,
                                                                target_dictionary=dictionary))
    return model, spec, args


def self_attentions(model, spec):
    """(fairseq self-attention module, its CTranslate2 spec) of every layer, encoder and decoder."""
    return [(layer.self_attn, layer_spec.self_attention)
            for module, side in ((model.encoder, spec.encoder), (model.decoder, spec.decoder))
            for layer, layer_spec in zip(module.layers, side.layer)]


def with_exported_weights(attention, attention_spec):
    """A copy of ``attention`` computing what the exported layer computes: the spec's fused
    [W_q; W_k; W_v] and biases, and no logit multiplier of its own (CTranslate2 applies none)."""
    exported = copy.deepcopy(attention)
    weights = torch.from_numpy(attention_spec.linear[0].weight).chunk(3)
    biases = torch.from_numpy(attention_spec.linear[0].bias).chunk(3)
    for projection, weight, bias in zip((exported.q_proj, exported.k_proj, exported.v_proj), weights, biases):
        projection.weight = torch.nn.Parameter(weight.clone())
        projection.bias = torch.nn.Parameter(bias.clone())
    exported.rotary.logit_scale = 1.0
    return exported


def head_weights(attention, x):
    with torch.no_grad():
        return attention(x, x, x, need_weights=True, need_head_weights=True)[1]


@pytest.mark.parametrize("s, flags", [
    (1.01, []),
    (1.1, []),  # below 1.18: no integer pair of CTranslate2's sin/cos multiplier reaches it
    (2.0, ["--rope-fraction", "0.5", "--rope-layout", "half"]),  # the temperature reaches unrotated channels too
    (16.0, []),
])
def test_the_folded_temperature_gives_fairseqs_attention(s, flags):
    """Property: for every rotary self-attention, the exported projections without a temperature
    give the attention probabilities of fairseq's layer with it (fp32 rounding apart), while the
    unfolded weights do not."""
    model, spec, args = exported_spec("--rope-scaling", "yarn", "--rope-scaling-factor", str(s),
                                      "--rope-scaling-original-length", "6", *flags)
    multiplier = (0.1 * math.log(s) + 1.0) ** 2
    generator = torch.Generator().manual_seed(int(s * 100))
    checked = 0
    for attention, attention_spec in self_attentions(model, spec):
        assert attention.rotary.logit_scale == pytest.approx(multiplier, rel=1e-12)
        x = torch.randn(9, 2, args.encoder_embed_dim, generator=generator) * 3  # logits large enough to tell
        fairseq = head_weights(attention, x)
        torch.testing.assert_close(head_weights(with_exported_weights(attention, attention_spec), x), fairseq,
                                   rtol=1e-5, atol=1e-6)
        unfolded = copy.deepcopy(attention)
        unfolded.rotary.logit_scale = 1.0
        assert (head_weights(unfolded, x) - fairseq).abs().max() > 1e-4 * (s - 1)  # the check can fail
        checked += 1
    assert checked == args.encoder_layers + args.decoder_layers


def test_the_fold_scales_the_query_and_key_rows_by_the_root_and_leaves_the_rest():
    model, spec, _ = exported_spec("--rope-scaling", "yarn", "--rope-scaling-factor", "4",
                                   "--rope-scaling-original-length", "6")
    root = 0.1 * math.log(4.0) + 1.0  # sqrt((0.1 ln s + 1)^2)
    for attention, attention_spec in self_attentions(model, spec):
        fused = torch.from_numpy(attention_spec.linear[0].weight)
        bias = torch.from_numpy(attention_spec.linear[0].bias)
        for index, (projection, scale) in enumerate(((attention.q_proj, root), (attention.k_proj, root),
                                                     (attention.v_proj, 1.0))):
            rows = slice(index * attention.embed_dim, (index + 1) * attention.embed_dim)
            torch.testing.assert_close(fused[rows], (projection.weight.double() * scale).float(), rtol=0, atol=0)
            torch.testing.assert_close(bias[rows], (projection.bias.double() * scale).float(), rtol=0, atol=0)
        # the out projection is CTranslate2's linear[1], untouched
        torch.testing.assert_close(torch.from_numpy(attention_spec.linear[1].weight), attention.out_proj.weight)


@pytest.mark.parametrize("flags", [[], ["--rope-scaling", "linear", "--rope-scaling-factor", "2"]])
def test_without_a_logit_multiplier_the_weights_are_copied_as_they_are(flags):
    model, spec, _ = exported_spec(*flags)
    for attention, attention_spec in self_attentions(model, spec):
        fused = torch.cat([p.weight for p in (attention.q_proj, attention.k_proj, attention.v_proj)])
        torch.testing.assert_close(torch.from_numpy(attention_spec.linear[0].weight), fused, rtol=0, atol=0)


def test_the_fold_leaves_the_arrays_it_was_given_alone():
    import numpy as np

    linear = SimpleNamespace(weight=np.ones((6, 2), dtype=np.float32), bias=np.ones(6, dtype=np.float32),
                             has_bias=lambda: True)
    given_weight, given_bias = linear.weight, linear.bias
    fold_logit_multiplier(SimpleNamespace(linear=[linear]), 4.0)
    assert linear.weight[:, 0].tolist() == [2, 2, 2, 2, 1, 1] and linear.bias.tolist() == [2, 2, 2, 2, 1, 1]
    assert given_weight.tolist() == np.ones((6, 2)).tolist() and given_bias.tolist() == [1] * 6
