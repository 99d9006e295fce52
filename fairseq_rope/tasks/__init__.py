from .translation_concat import TranslationConcatTask  # noqa: F401  (registers translation_concat)
