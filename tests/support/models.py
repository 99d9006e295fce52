"""Models built in-process as fairseq-train builds them, and the rotation seen from outside."""


def model_with_dictionary(arch="transformer_rope_tiny", *extra_args, vocab_size=30, seed=0):
    """``(model, dictionary, args)``: built in-process exactly as fairseq-train would, from
    command-line style args, with ``vocab_size`` symbols besides fairseq's special ones."""
    from fairseq.data import Dictionary

    from fairseq_rope_tools.research.models import DictionaryTask, build_model

    task = DictionaryTask(len(Dictionary()) + vocab_size)
    model, args = build_model(arch, task, *extra_args, seed=seed)
    return model, task.source_dictionary, args


def table_cos_sin(rotary, positions, length):
    """fp32 cos and sin of m * theta_i from a RotaryEmbedding's tables, for integer ``positions``."""
    cos, sin, _ = rotary.tables(length, positions.device)
    return cos[positions], sin[positions]


def rotate(attn, x, positions, length):
    """R_m x for a time-first (time, batch, heads, head_dim) ``x``, through the layer's rotation."""
    return attn.rotary.rotate([x], positions, length, x.shape)[0]
