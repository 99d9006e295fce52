from .transformer_rope import TransformerRopeModel  # noqa: F401  (registers the architectures)
from .transformer_rpe import TransformerRpeModel  # noqa: F401  (registers transformer_rpe)
