"""``python -m fairseq_rope``: the registered architectures and every plugin flag with its default,
choices and help, from the declarations fairseq's parser uses (fairseq's own ``--help`` exits
before it adds an architecture's flags)."""

from fairseq.models import ARCH_MODEL_NAME_REGISTRY

from .plugin_options import describe_options, plugin_models


def main() -> None:
    for model in plugin_models():
        architectures = sorted(arch for arch, name in ARCH_MODEL_NAME_REGISTRY.items() if name == model)
        print(f"{model} architectures: {', '.join(architectures)}")
    print()
    print(describe_options())


if __name__ == "__main__":
    main()
