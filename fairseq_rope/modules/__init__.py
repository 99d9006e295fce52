from .rotary_multihead_attention import RotaryMultiheadAttention  # noqa: F401
