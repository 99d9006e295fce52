from .transformer_rope import TransformerRopeModel  # noqa: F401  (registers the architectures)
