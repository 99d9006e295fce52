from .linear_rotary_attention import LinearRotaryAttention  # noqa: F401
from .relative_position_attention import RelativePositionMultiheadAttention  # noqa: F401
from .rotary_embedding import RotaryEmbedding  # noqa: F401
from .rotary_multihead_attention import RotaryMultiheadAttention  # noqa: F401
