"""A fairseq model as two ONNX graphs for the ONNX Runtime engine (onnx_engine.py): the encoder,
which also computes every decoder layer's encoder-decoder keys and values once per sentence, and
one decoding step with its self-attention cache. Written by fairseq-rope-export --format onnx.

The graphs are traced from small modules that run the loaded model's own submodules (embeddings,
projections, layer norms, activations, output layer) in fairseq's order; what they do themselves
is what fairseq's incremental decoding does through Python state that a trace cannot follow: the
cache, and the rotation, which the plugin computes with complex numbers (ONNX has none) and which
here multiplies by the model's own cos/sin tables (``RotaryEmbedding.tables``), gathered by
position; a decoding step, whose rows all stand at one position, turns by one matrix made from
that position's row (one matmul per rotated tensor, where two gathers, two products, a matmul and
a sum were). Positions as in the plugin: encoder self-attention by column (left padding shifts a
sentence by a constant, eq. 16), encoder-decoder keys by their position within their sentence,
decoder queries and keys by the decoding step.

Inputs and outputs (N rows: sentences or beams; H heads of D channels; one tensor per decoder
layer l, not one stacked over layers, which every step would have to split and stack again):

* ``encoder.onnx``: ``src_tokens`` (N, S) int64, left-padded, each ending in ``</s>`` ->
  ``cross_keys_l``, ``cross_values_l`` (N, H, S, D) float32.
* ``decoder.onnx``: ``tokens`` (N,) int64, the previous token of each row; ``step`` () int64, its
  position (0 for the ``</s>`` that starts every hypothesis); ``candidates`` (K,), of which only
  the size is read; ``cache_rows`` (N,) int64, the cache row each row continues;
  ``self_keys_l``, ``self_values_l`` (M, H, step, D) of the M rows of the step before;
  ``src_padding`` (B, S) bool, ``cross_keys_l``, ``cross_values_l`` (B, H, S, D) of
  the B sentences whose beams the N rows are (N / B consecutive rows each) ->
  ``top_log_probs`` (N, K) float32 and ``top_tokens`` (N, K) int64, the K most probable next tokens
  of each row but ``<pad>``, best first; ``eos_log_probs`` (N,), that of ``</s>``; and the cache
  with this step appended, ``new_self_keys_l``, ``new_self_values_l`` (N, H, step + 1, D).
"""

import json
import os
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fairseq_rope.model_options import registered_model_name
from fairseq_rope.modules.rope_scaling import scaling_spec
from fairseq_rope_tools.deploy.exported import MODEL_FILES, ONNX_MODEL_FORMAT, onnx_step_cache_names

ENCODER_FILE, DECODER_FILE, MODEL_CONFIG = MODEL_FILES[ONNX_MODEL_FORMAT]

OPSET = 17


def onnx_export_refusals(args) -> List[str]:
    """Every option of the model these graphs cannot compute, one line each naming its flag."""
    name = registered_model_name(args.arch)
    scaling = getattr(args, "rope_scaling", "none")
    refusals = [
        (name not in ("transformer", "transformer_rope"),
         f"--arch {args.arch} ({name}): only transformer and transformer_rope models export to ONNX "
         "(no Shaw relative positions or other fairseq model)"),
        (getattr(args, "rope_values", False), "--rope-values: the ONNX export does not rotate values (RoPER)"),
        (getattr(args, "attention_kind", "softmax") != "softmax",
         f"--attention-kind {getattr(args, 'attention_kind', None)}: the ONNX export has softmax attention only"),
        (name == "transformer_rope" and scaling_spec(scaling).per_sentence,
         f"--rope-scaling {scaling}: scales each sentence by its length, which the ONNX export does not; export "
         "a static scaling (linear, ntk, yarn)"),
        (bool(getattr(args, "adaptive_softmax_cutoff", None)), "--adaptive-softmax-cutoff: not exported"),
        (bool(getattr(args, "adaptive_input", False)), "--adaptive-input: not exported"),
        (getattr(args, "cross_self_attention", False), "--cross-self-attention: not exported"),
        (getattr(args, "no_cross_attention", False), "--no-cross-attention: not exported"),
        (any(getattr(args, flag, False) for flag in ("scale_attn", "scale_fc", "scale_heads", "scale_resids")),
         "--scale-attn / --scale-fc / --scale-heads / --scale-resids: not exported"),
    ]
    return [reason for refused, reason in refusals if refused]


class _Rotation(nn.Module):
    """RoPE by the model's tables: x (rows, heads, time, head_dim) rotated by ``positions`` (time,)
    or (rows, time), over its first ``rotary_dim`` channels in the model's layout, as x cos +
    swap(x) sin: cos and sin spread over every channel of a pair (1 and 0 beyond ``rotary_dim``)
    and swap(x) a fixed signed permutation of the channels (a matmul, exact), so that the graph has
    no slices or joins of channels. A decoding step, whose rows are all at one
    position, is rotated by that position's :meth:`turn` instead: one matmul per rotated tensor."""

    def __init__(self, rotary, length: int, head_dim: int):
        super().__init__()
        cos, sin = rotary.tables(length, "cpu")[:2]
        half, rotary_dim = cos.size(1), rotary.rotary_dim
        if rotary.layout == "interleaved":  # pairs (2i, 2i + 1)
            first, second = torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)
        else:  # pairs (i, i + rotary_dim / 2)
            first, second = torch.arange(half), torch.arange(half, rotary_dim)
        spread_cos, spread_sin = torch.ones(cos.size(0), head_dim), torch.zeros(cos.size(0), head_dim)
        swap = torch.zeros(head_dim, head_dim)
        for pair_channels in (first, second):
            spread_cos[:, pair_channels], spread_sin[:, pair_channels] = cos, sin
        swap[second, first], swap[first, second] = -1.0, 1.0  # swap(x): -x[second] at first, x[first] at second
        self.register_buffer("cos", spread_cos, persistent=False)
        self.register_buffer("sin", spread_sin, persistent=False)
        self.register_buffer("swap", swap, persistent=False)
        self.register_buffer("eye", torch.eye(head_dim), persistent=False)
        self.logit_scale = float(rotary.logit_scale)

    def turn(self, position: Tensor) -> Tensor:
        """The rotation at ``position`` (1,) as a (head_dim, head_dim) matrix: x turn = x cos + swap(x) sin."""
        return self.eye * self.cos[position] + self.swap * self.sin[position]

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x rotated by ``positions``, or by a decoding step's :meth:`turn` (a float matrix)."""
        if positions.is_floating_point():
            return torch.matmul(x, positions)
        cos, sin = self.cos[positions], self.sin[positions]
        if positions.dim() == 2:  # each row's own: over the heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return x * cos + torch.matmul(x, self.swap) * sin


class _Attention(nn.Module):
    """One of the model's attentions on batch-first (rows, time, embed_dim) inputs: its projections,
    and, when it is a rotary one, the model's ``rotation`` and logit scale."""

    def __init__(self, attention, rotation: Optional[_Rotation]):
        super().__init__()
        self.attention = attention
        self.heads, self.head_dim = attention.num_heads, attention.head_dim
        self.rotation = rotation if getattr(attention, "rotary", None) is not None else None

    def split(self, x: Tensor) -> Tensor:  # (rows[, time], embed) -> (rows, heads, time, head_dim)
        if x.dim() == 2:  # a decoding step's one token: heads first is a view, with a constant shape
            return x.view(-1, self.heads, 1, self.head_dim)
        return x.view(x.size(0), -1, self.heads, self.head_dim).transpose(1, 2)

    def join(self, out: Tensor, like: Tensor) -> Tensor:
        """(rows, heads, time, head_dim) -> ``like``'s shape, heads joined, and projected; for a
        decoding step (one token per row) any shape whose last two are heads and head_dim, rows in
        order before them."""
        if like.dim() == 2:  # one token per row: its heads are consecutive already
            out = out.reshape(-1, self.heads * self.head_dim)
        else:
            out = out.transpose(1, 2).reshape(like.shape)
        return self.attention.out_proj(out)

    def keys_and_values(self, x: Tensor, positions: Optional[Tensor]):
        """Keys (rotated by ``positions``, or a step's :meth:`_Rotation.turn`, when rotary) and values,
        (rows, heads, time, head_dim)."""
        k, v = self.split(self.attention.k_proj(x)), self.split(self.attention.v_proj(x))
        if self.rotation is not None and positions is not None:
            k = self.rotation(k, positions)
        return k, v

    def query(self, x: Tensor, positions: Optional[Tensor]) -> Tensor:
        q = self.split(self.attention.q_proj(x))
        if self.rotation is not None and positions is not None:
            q = self.rotation(q, positions)
        if self.rotation is not None and self.rotation.logit_scale != 1.0:  # YaRN attention temperature
            q = q * self.rotation.logit_scale
        return q * self.attention.scaling  # in the plugin's order: the same rounding

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], like: Tensor) -> Tensor:
        """softmax(q k^T + mask) v, heads joined and projected, shaped as the input ``like``."""
        scores = torch.matmul(q, k.transpose(-1, -2))
        if mask is not None:
            scores = scores + mask
        out = torch.matmul(torch.softmax(scores.float(), dim=-1).type_as(scores), v)
        return self.join(out, like)

    def attend_shared(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, like: Tensor) -> Tensor:
        """:meth:`attend` of one query per row, rows k.size(0) groups of beams that share one copy of
        their sentence's keys and values (the beams of a sentence are consecutive rows)."""
        # the sentences counted on the mask, which every layer shares: one shape computation in the graph
        q = q.reshape(mask.size(0), -1, self.heads, self.head_dim).transpose(1, 2)  # (sentences, heads, beams, dim)
        scores = torch.matmul(q, k.transpose(-1, -2)) + mask
        out = torch.matmul(torch.softmax(scores.float(), dim=-1).type_as(scores), v)
        return self.join(out.transpose(1, 2), like)  # (sentences, beams, heads, dim): rows in order


def _rotation(attentions, length: int) -> Optional[_Rotation]:
    """The rotation of ``attentions``, one table for all (the plugin shares one RotaryEmbedding per
    model, and the attentions given have one head size), or None for attentions without RoPE."""
    rotary = next((a for a in attentions if getattr(a, "rotary", None) is not None), None)
    return _Rotation(rotary.rotary, length, rotary.head_dim) if rotary is not None else None


def _feed_forward(layer, x: Tensor) -> Tensor:
    residual = x
    if layer.normalize_before:
        x = layer.final_layer_norm(x)
    x = layer.fc2(layer.activation_fn(layer.fc1(x)))
    x = residual + x
    return x if layer.normalize_before else layer.final_layer_norm(x)


def _sublayer(norm, normalize_before: bool, x: Tensor, compute) -> Tensor:
    """fairseq's residual block around ``compute``, its layer norm before or after."""
    residual = x
    out = compute(norm(x) if normalize_before else x)
    out = residual + out
    return out if normalize_before else norm(out)


def _add_positions_table(graph: nn.Module, embed_positions) -> bool:
    """The table of the model's sinusoidal or learned token positions (rows by fairseq's position
    numbers) as the graph's ``positions_table``; False for a model without token positions."""
    if embed_positions is None:
        return False
    table = getattr(embed_positions, "weights", None)  # sinusoidal; learned positions are a parameter
    graph.register_buffer("positions_table", (table if table is not None else embed_positions.weight).detach().clone(),
                          persistent=False)
    return True


class EncoderGraph(nn.Module):
    """src_tokens -> every decoder layer's encoder-decoder keys and values (see the module)."""

    def __init__(self, model, length: int):
        super().__init__()
        self.encoder, self.decoder = model.encoder, model.decoder
        self.pad = self.encoder.padding_idx
        rotation = _rotation([layer.self_attn for layer in self.encoder.layers], length)
        self.self_attentions = nn.ModuleList(_Attention(layer.self_attn, rotation) for layer in self.encoder.layers)
        rotation = _rotation([layer.encoder_attn for layer in self.decoder.layers], length)
        self.cross_attentions = nn.ModuleList(_Attention(layer.encoder_attn, rotation)
                                              for layer in self.decoder.layers)
        self.has_positions = _add_positions_table(self, self.encoder.embed_positions)

    def forward(self, src_tokens: Tensor):
        padding = src_tokens.eq(self.pad)
        not_pad = (~padding).long()
        x = self.encoder.embed_scale * self.encoder.embed_tokens(src_tokens)
        if self.has_positions:  # fairseq's make_positions: pads keep padding_idx
            x = x + self.positions_table[torch.cumsum(not_pad, dim=1) * not_pad + self.pad]
        if self.encoder.layernorm_embedding is not None:
            x = self.encoder.layernorm_embedding(x)
        x = x * (1 - padding.unsqueeze(-1).type_as(x))
        mask = torch.zeros_like(padding, dtype=x.dtype).masked_fill(padding, float("-inf"))[:, None, None, :]
        columns = torch.arange(src_tokens.size(1), device=src_tokens.device)
        for layer, attention in zip(self.encoder.layers, self.self_attentions):
            def self_attend(h, attention=attention):
                k, v = attention.keys_and_values(h, columns)
                return attention.attend(attention.query(h, columns), k, v, mask, h)

            x = _sublayer(layer.self_attn_layer_norm, layer.normalize_before, x, self_attend)
            x = _feed_forward(layer, x)
        if self.encoder.layer_norm is not None:
            x = self.encoder.layer_norm(x)
        within_sentence = (torch.cumsum(not_pad, dim=1) - 1).clamp(min=0)
        keys, values = zip(*(attention.keys_and_values(x, within_sentence) for attention in self.cross_attentions))
        return tuple(tensor for pair in zip(keys, values) for tensor in pair)


class DecoderStepGraph(nn.Module):
    """One decoding step with its caches (see the module)."""

    def __init__(self, model, length: int):
        super().__init__()
        self.decoder = model.decoder
        self.pad, self.eos = self.decoder.padding_idx, self.decoder.dictionary.eos()
        # fairseq never proposes <pad>: -inf added to its log-probability (an addition of a row costs
        # the graph less than a masked fill; x + 0 is x)
        pad_barred = torch.zeros(1, len(self.decoder.dictionary))
        pad_barred[0, self.pad] = float("-inf")
        self.register_buffer("pad_barred", pad_barred, persistent=False)
        attentions = [a for layer in self.decoder.layers for a in (layer.self_attn, layer.encoder_attn)]
        self.rotation = rotation = _rotation(attentions, length)
        self.self_attentions = nn.ModuleList(_Attention(layer.self_attn, rotation) for layer in self.decoder.layers)
        self.cross_attentions = nn.ModuleList(_Attention(layer.encoder_attn, rotation)
                                              for layer in self.decoder.layers)
        self.has_positions = _add_positions_table(self, self.decoder.embed_positions)

    def forward(self, tokens, step, candidates, cache_rows, src_padding, *caches):
        """``candidates``: a tensor of as many elements as the best tokens wanted of each row;
        ``cache_rows``: the row of the self-attention caches each row continues (beam search's
        reorder, one gather in the graph); ``caches``: per layer its self-attention keys and values,
        then its cross keys and values."""
        self_keys, self_values, cross_keys, cross_values = (caches[i::4] for i in range(4))
        decoder = self.decoder
        # (rows, embed): one token per row, so that every projection is one GEMM with its bias
        x = decoder.embed_scale * decoder.embed_tokens(tokens)
        if decoder.project_in_dim is not None:
            x = decoder.project_in_dim(x)
        position = step.view(1)
        # every row is at this position: the rotary attentions turn by one matrix, made once
        at = self.rotation.turn(position) if self.rotation is not None else position
        if self.has_positions:  # fairseq's incremental position: padding_idx + prefix length
            x = x + self.positions_table[position + self.pad + 1]
        if decoder.layernorm_embedding is not None:
            x = decoder.layernorm_embedding(x)
        source_mask = torch.zeros_like(src_padding, dtype=x.dtype).masked_fill(src_padding, float("-inf"))
        source_mask = source_mask[:, None, None, :]
        new_keys, new_values = [], []
        for i, layer in enumerate(decoder.layers):
            attention, cross = self.self_attentions[i], self.cross_attentions[i]

            def self_attend(h, i=i, attention=attention):
                k, v = attention.keys_and_values(h, at)
                k = torch.cat([self_keys[i].index_select(0, cache_rows), k], dim=2)
                v = torch.cat([self_values[i].index_select(0, cache_rows), v], dim=2)
                new_keys.append(k)
                new_values.append(v)
                return attention.attend(attention.query(h, at), k, v, None, h)

            def cross_attend(h, i=i, cross=cross):
                return cross.attend_shared(cross.query(h, at), cross_keys[i], cross_values[i], source_mask, h)

            x = _sublayer(layer.self_attn_layer_norm, layer.normalize_before, x, self_attend)
            x = _sublayer(layer.encoder_attn_layer_norm, layer.normalize_before, x, cross_attend)
            x = _feed_forward(layer, x)
        if decoder.layer_norm is not None:
            x = decoder.layer_norm(x)
        if decoder.project_out_dim is not None:
            x = decoder.project_out_dim(x)
        logits = decoder.output_layer(x)
        log_probs = F.log_softmax(logits.float(), dim=-1)
        eos_log_probs = log_probs[:, self.eos]
        # the search takes the best of each row: only those leave the graph (not rows x vocabulary)
        log_probs = log_probs + self.pad_barred
        top_log_probs, top_tokens = torch.topk(log_probs, candidates.size(0), dim=1)
        new_caches = tuple(tensor for pair in zip(new_keys, new_values) for tensor in pair)
        return (top_log_probs, top_tokens, eos_log_probs, *new_caches)


def graph_length(args) -> int:
    """Positions the graphs' tables cover: every source and target position the model takes."""
    return max(int(args.max_source_positions), int(args.max_target_positions)) + 2


def write_onnx_model(model, args, task, directory) -> None:
    """The ONNX export of ``model`` (eval mode) into the new directory ``directory``: the graphs,
    onnx_model.json (what the engine needs beside them) and the vocabularies, listed as
    CTranslate2 lists them (fairseq's symbols, ``<pad>`` as ``<blank>``), which model_setup checks
    against the data-bin as it checks a CTranslate2 export's."""
    dimensions = write_graphs(model, args, directory)
    dictionary = task.target_dictionary
    config = dict(dimensions, pad=dictionary.pad(), eos=dictionary.eos(), unk=dictionary.unk(), bos=dictionary.bos(),
                  max_source_positions=int(args.max_source_positions),
                  max_target_positions=int(args.max_target_positions))
    with open(os.path.join(directory, MODEL_CONFIG), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    for side, vocabulary in (("source", task.source_dictionary), ("target", dictionary)):
        with open(os.path.join(directory, f"{side}_vocabulary.json"), "w", encoding="utf-8") as f:
            json.dump(["<blank>" if token == "<pad>" else token for token in vocabulary.symbols], f, ensure_ascii=False)


def write_graphs(model, args, directory) -> dict:
    """encoder.onnx and decoder.onnx of ``model`` (eval mode) into ``directory``; returns the
    dimensions the engine needs."""
    length = graph_length(args)
    encoder, decoder = EncoderGraph(model, length).eval(), DecoderStepGraph(model, length).eval()
    layers, heads = len(model.decoder.layers), model.decoder.layers[0].encoder_attn.num_heads
    head_dim = model.decoder.layers[0].encoder_attn.head_dim
    rows, source, steps = 2, 3, 2
    src_tokens = torch.full((rows, source), model.encoder.dictionary.eos(), dtype=torch.long)
    src_tokens[1, 0] = model.encoder.padding_idx  # traced with padding: both branches of nothing
    self_names, cross_names = onnx_step_cache_names(layers)
    cache_names = [name for layer in range(layers) for name in (*self_names[2 * layer:2 * layer + 2],
                                                                 *cross_names[2 * layer:2 * layer + 2])]
    with torch.no_grad():
        cross = encoder(src_tokens)
        cache = torch.zeros(rows, heads, steps, head_dim)
        caches = [cache if name.startswith("self_") else cross[cross_names.index(name)] for name in cache_names]
        torch.onnx.export(encoder, (src_tokens,), os.path.join(directory, ENCODER_FILE), dynamo=False,
                          input_names=["src_tokens"], output_names=cross_names,
                          dynamic_axes={"src_tokens": {0: "rows", 1: "source"},
                                        **{name: {0: "rows", 2: "source"} for name in cross_names}},
                          opset_version=OPSET)
        step_inputs = (torch.full((rows,), model.decoder.dictionary.eos(), dtype=torch.long),
                       torch.tensor(steps, dtype=torch.long), torch.zeros(3), torch.arange(rows),
                       src_tokens.eq(model.encoder.padding_idx), *caches)
        torch.onnx.export(
            decoder, step_inputs, os.path.join(directory, DECODER_FILE), dynamo=False,
            input_names=["tokens", "step", "candidates", "cache_rows", "src_padding", *cache_names],
            output_names=["top_log_probs", "top_tokens", "eos_log_probs", *(f"new_{name}" for name in self_names)],
            dynamic_axes={"tokens": {0: "rows"}, "candidates": {0: "candidates"}, "cache_rows": {0: "rows"},
                          "src_padding": {0: "sentences", 1: "source"},
                          "top_log_probs": {0: "rows", 1: "candidates"}, "top_tokens": {0: "rows", 1: "candidates"},
                          "eos_log_probs": {0: "rows"},
                          **{name: {0: "sentences", 2: "source"} for name in cross_names},
                          **{name: {0: "rows", 2: "steps"} for name in self_names},
                          **{f"new_{name}": {0: "rows", 2: "next_steps"} for name in self_names}},
            opset_version=OPSET)
    return {"decoder_layers": layers, "heads": heads, "head_dim": head_dim}
