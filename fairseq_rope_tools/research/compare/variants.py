"""The harness's variants: what each trains (architecture, flags, training recipe), the settings a
variant can take as its own (NAME@OPTION=VALUE), and the architecture of each --size."""

import math
from typing import Callable, List, NamedTuple


class Variant(NamedTuple):
    family: str  # mapped to an architecture by --size
    flags: List[str]
    concatenation: bool = False  # trained with concatenation (train.sh's CONCAT_MAX_SENTENCES)
    random_positions: bool = False  # trained with --rope-random-positions
    named_only: bool = False  # an encoding that runs only when --variants names it


VARIANTS = {
    "sinusoidal": Variant("transformer", []),
    "learned": Variant("transformer", ["--encoder-learned-pos", "--decoder-learned-pos"]),
    "none": Variant("transformer", ["--no-token-positional-embeddings"]),
    "rpe": Variant("transformer_rpe", []),
    "rope": Variant("transformer_rope", []),
    "roper": Variant("transformer_rope", ["--rope-values"]),
    "rope_linear": Variant("transformer_rope", ["--attention-kind", "linear"]),
    # encoder-decoder attention rotated too: its scores see the distance between target and source positions
    "rope_cross": Variant("transformer_rope", ["--rope-cross-attention"], named_only=True),
    # the training recipes for inputs longer than the training pairs (docs/position_encodings.md)
    "sinusoidal_concat": Variant("transformer", [], concatenation=True),
    "rope_concat": Variant("transformer_rope", [], concatenation=True),
    "rope_randpos": Variant("transformer_rope", [], random_positions=True),
    "rope_concat_randpos": Variant("transformer_rope", [], concatenation=True, random_positions=True),
    "rope_cross_concat": Variant("transformer_rope", ["--rope-cross-attention"], concatenation=True),
}


ENCODINGS = [name for name, v in VARIANTS.items()  # the default
             if not (v.concatenation or v.random_positions or v.named_only)]


class RecipeOption(NamedTuple):
    recipe: str  # the Variant field of the variants that read it
    default: float
    type: type
    valid: Callable[[float], bool]
    requirement: str  # what a valid value is, for the message that refuses another
    metavar: str
    does: str  # what the flag does, for its --help


# the options of the recipes, each a flag of the harness and a setting a variant can take as its
# own (VARIANT@OPTION=VALUE,...: parse_variant); a flag is refused when no variant of --variants reads it
CONCAT = "the variants with concat in their name"
RECIPE_OPTIONS = {
    "concat_max_sentences": RecipeOption("concatenation", 3, int, lambda k: k >= 2,
                                         "a number K >= 2 of sentences joined at most", "K",
                                         f"{CONCAT} join a training pair with 1 to K - 1 others"),
    "concat_prob": RecipeOption("concatenation", 0.5, float, lambda p: 0.0 < p <= 1.0, "a probability in (0, 1]", "P",
                                f"{CONCAT} join this share of the training pairs with others"),
    "concat_from_epoch": RecipeOption("concatenation", 1, int, lambda e: e >= 1, "an epoch number >= 1", "E",
                                      f"{CONCAT} join pairs from epoch E on"),
    "rope_random_positions": RecipeOption("random_positions", 4.0, float, lambda r: math.isfinite(r) and r > 1.0,
                                          "a number R > 1 (the range of positions, R times a sequence's length)", "R",
                                          "the variants with randpos in their name train with "
                                          "--rope-random-positions R"),
}


class RunOption(NamedTuple):
    type: type
    valid: Callable[[object], bool]
    requirement: str


# what any variant can set as its own: where its training starts and how long it runs. A variant
# with init-from=OTHER starts from OTHER's averaged model of the same seed (train.sh's INIT_FROM),
# so that "OTHER, then fine-tuned into this" is compared in one report with this from scratch;
# with its own max-update its warm-up and checkpoint interval default to that budget's.
RUN_OPTIONS = {
    "init_from": RunOption(str, lambda name: name in VARIANTS, "the plain name of another variant of --variants"),
    "max_update": RunOption(int, lambda n: n >= 1, "a number of updates >= 1"),
    "warmup_updates": RunOption(int, lambda n: n >= 0, "a number of updates >= 0"),
}


#: every setting a variant can take as its own, in the order its canonical name lists them
OWN_OPTIONS = {**RECIPE_OPTIONS, **RUN_OPTIONS}
OWN_SETTINGS = "@"  # rope_concat@concat-max-sentences=8: rope_concat, trained with its own K


def base_variant(variant) -> str:
    """The variant of :data:`VARIANTS` a name of --variants is (``rope_concat@concat-max-sentences=8``:
    ``rope_concat``)."""
    return variant.partition(OWN_SETTINGS)[0]


def variant_spec(variant) -> Variant:
    """The Variant a name of --variants trains."""
    return VARIANTS[base_variant(variant)]


def parse_variant(text):
    """A name of --variants, ``NAME`` or ``NAME@OPTION=VALUE[,OPTION=VALUE]`` with OPTIONs of
    :data:`RECIPE_OPTIONS` that NAME reads and of :data:`RUN_OPTIONS`: (its canonical name,
    {option: value}). A ValueError says what is wrong."""
    base, own_settings, settings = text.partition(OWN_SETTINGS)
    if base not in VARIANTS:
        raise ValueError(f"unknown variant {base!r}: choose from {', '.join(VARIANTS)}")
    own = {}
    for item in settings.split(",") if own_settings else []:
        flag, is_set, value = item.partition("=")
        name = flag.replace("-", "_")
        if not is_set or name not in OWN_OPTIONS:
            raise ValueError(f"{item!r} is not OPTION=VALUE with OPTION one of "
                             + ", ".join(n.replace("_", "-") for n in OWN_OPTIONS))
        if name in RECIPE_OPTIONS and not getattr(VARIANTS[base], RECIPE_OPTIONS[name].recipe):
            raise ValueError(f"{base} reads no {flag}: it is an option of the variants "
                             + " ".join(recipe_readers(name)))
        if name in own:
            raise ValueError(f"{flag} is given twice")
        option = OWN_OPTIONS[name]
        try:
            own[name] = option.type(value)
        except ValueError:
            kind = "a whole number" if option.type is int else "a number"
            raise ValueError(f"{flag} takes {kind}, got {value!r}") from None
        problem = recipe_value_problem(name, own[name])
        if problem:
            raise ValueError(f"{flag} {problem}")
    canonical = ",".join(f"{n.replace('_', '-')}={own[n]:g}" if not isinstance(own[n], str)
                         else f"{n.replace('_', '-')}={own[n]}"
                         for n in OWN_OPTIONS if n in own)
    return (f"{base}{OWN_SETTINGS}{canonical}" if own else base), own


def recipe_readers(name):
    """The variants that read the recipe option ``name``."""
    return [v for v, spec in VARIANTS.items() if getattr(spec, RECIPE_OPTIONS[name].recipe)]


def recipe_value_problem(name, value):
    """What is wrong with ``value`` for the recipe or run option ``name`` (None: nothing)."""
    option = OWN_OPTIONS[name]
    shown = value if isinstance(value, str) else f"{value:g}"
    return None if option.valid(value) else f"must be {option.requirement}, got {shown}"


def recipe_value(args, variant, name):
    """The value of the recipe option ``name`` a variant trains with: its own, else the flag's."""
    return args.variant_settings.get(variant, {}).get(name, getattr(args, name))


def start_of(args, variant):
    """The variant of --variants whose averaged model ``variant`` starts from (None: from scratch)."""
    return args.variant_settings.get(variant, {}).get("init_from")


def run_value(args, variant, name):
    """The training budget ``name`` (max_update, warmup_updates, save_interval_updates) a variant
    trains with: its own; else the flag's when given, or its default from the variant's max-update."""
    own = args.variant_settings.get(variant, {})
    if name in own:
        return own[name]
    if name != "max_update" and "max_update" in own and name not in args.given_budget:
        return budget_defaults(own["max_update"], args.average_last)[name]
    return getattr(args, name)


def budget_defaults(max_update, average_last):
    """The warm-up and checkpoint interval of a training of ``max_update`` updates when not given."""
    return {"warmup_updates": max(1, max_update // 10),
            "save_interval_updates": max(1, max_update // (2 * average_last))}


def in_training_order(args):
    """--variants in their order, but each start before the first variant that starts from it."""
    ordered = []
    for variant in args.variants:
        ordered += [v for v in (start_of(args, variant), variant) if v and v not in ordered]
    return ordered


#: --size: each family's architecture of that size, named as fairseq's registry names them:
#: FAMILY_SIZE, and FAMILY alone at base size (transformer_rope_tiny, transformer_rope); the
#: harness does not load fairseq to read the registry (tests check each is registered there)
SIZES = ("tiny", "base", "wmt_en_de")


def architecture(family: str, size: str) -> str:
    """The registered architecture of ``family`` at ``size`` (one of :data:`SIZES`)."""
    return family if size == "base" else f"{family}_{size}"
