"""Models built in-process exactly as fairseq-train builds them, for benchmarks and tests."""


class DictionaryTask:
    """A translation task's two dictionaries (one, shared), all that ``build_model`` reads from
    a task: ``vocab`` symbols in all, fairseq's special ones included."""

    def __init__(self, vocab: int):
        from fairseq.data import Dictionary

        self.source_dictionary = Dictionary()
        for i in range(vocab - len(self.source_dictionary)):
            self.source_dictionary.add_symbol(f"w{i}")
        self.target_dictionary = self.source_dictionary


def build_model(arch: str, task, *extra_args, seed: int = 1):
    """``(model, args)``: ``arch`` with these command-line arguments (``--rope-theta 500`` ...),
    parsed and built by fairseq as fairseq-train does, with the plugin registered; weights drawn
    from ``seed``."""
    import torch
    from fairseq import models, options

    import fairseq_rope  # noqa: F401  (registers the transformer_rope architectures)

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser, ["unused-data-dir", "--task", "translation", "--arch", arch, *map(str, extra_args)])
    torch.manual_seed(seed)
    return models.build_model(args, task), args
