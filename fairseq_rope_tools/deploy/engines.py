"""The engines of fairseq-rope-translate and fairseq-rope-serve, each declared once, by an
:class:`EngineEntry`: its name, the flags it adds, its checks of the parsed flags, what it needs
of the work dir, the files it reads, how it opens and which export it reads. model_setup.py and
the commands look engines up here (:func:`engine_named`, :func:`default_engine`) and branch on no
engine's name.

A new engine is a module with a subclass of :class:`~fairseq_rope_tools.deploy.engine.Engine` and
an entry given to :func:`register_engine`: it is then a choice of fairseq-rope-translate's
``--engine``; one that reads a bundle (``export_format``) is one of fairseq-rope-serve's too, and
the default for a bundle whose manifest declares that format. Its module is imported only when
it opens, so that --help and the checks load neither CTranslate2 nor torch.
"""

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from fairseq_rope_tools.cli import UserError, sayer
from fairseq_rope_tools.deploy import exported, fairseq_engine
from fairseq_rope_tools.deploy.engine import Decoding, Engine
from fairseq_rope_tools.deploy.segmentation import first_line

say = sayer("translate")  # the messages of the setup are fairseq-rope-translate's, in serve too


@dataclass(frozen=True)
class EngineFiles:
    """What an engine's check of the flags found, for the ModelSetup: the verified manifest of the
    bundle it reads (None: it reads none, or a --length-buckets export of a version before
    bundles), the checkpoint it loads."""

    bundle: Optional[dict] = None
    checkpoint: Optional[str] = None


@dataclass(frozen=True)
class EngineEntry:
    """One engine as the commands know it. ``open(setup, args, decoding, keep_loaded)`` builds its
    :class:`~fairseq_rope_tools.deploy.engine.Engine` from the ModelSetup that
    model_setup.check_model returned and the parsed flags (``keep_loaded``: batches come mixed, from
    a stream or the service's requests, so every model used stays loaded)."""

    name: str
    help: str                                           # one line, in --engine's help
    open: Callable[..., Engine]
    #: the model format of the bundle it reads from --model-dir (what bundle.json declares,
    #: exported.model_format_of); None: it reads no bundle, and fairseq-rope-serve cannot serve it
    export_format: Optional[str] = None
    add_arguments: Optional[Callable] = None            # adds its own flags to a parser
    #: its checks of the parsed flags (UserError); None: a bundle engine's (:func:`check_bundle_flags`)
    check_flags: Optional[Callable[..., EngineFiles]] = None
    #: {what names it: path} of the files it reads, of a ModelSetup; None: every file of --model-dir
    model_files: Optional[Callable[..., dict]] = None
    chosen_by: Optional[str] = None                     # its flag (dest) that, given without --model-dir, chooses it
    devices: Tuple[str, ...] = ("cpu", "cuda")          # the --device values it decodes on
    needs_data_bin: bool = False                        # decodes with its dictionaries: --src and --tgt always
    checks_vocabulary: bool = False                     # its model's vocabularies against the data-bin's dictionaries

    @property
    def serves(self) -> bool:
        """Whether fairseq-rope-serve takes it: it reads a bundle, which holds the segmentation."""
        return self.export_format is not None

    def check(self, args) -> EngineFiles:
        return self.check_flags(args) if self.check_flags else check_bundle_flags(self, args)

    def files_read(self, setup) -> dict:
        return self.model_files(setup) if self.model_files else bundle_model_files(setup)


# --- the registry ------------------------------------------------------------------------------------
_REGISTERED: Dict[str, EngineEntry] = {}  # by name, in the order --engine lists them


def register_engine(entry: EngineEntry) -> EngineEntry:
    """Make ``entry`` an engine of the commands; ValueError when its name, or the bundle format it
    reads, is another engine's (which one a bundle would open with could not be told)."""
    if entry.name in _REGISTERED:
        raise ValueError(f"an engine named {entry.name} is registered already")
    if entry.export_format is not None and entry.export_format in (e.export_format for e in _REGISTERED.values()):
        raise ValueError(f"the engine {entry.name} reads {entry.export_format} bundles, as another engine does")
    _REGISTERED[entry.name] = entry
    return entry


def unregister_engine(name: str) -> None:
    del _REGISTERED[name]


def registered_engines() -> List[EngineEntry]:
    return list(_REGISTERED.values())


def served_engines() -> List[EngineEntry]:
    """The engines fairseq-rope-serve takes (:attr:`EngineEntry.serves`)."""
    return [entry for entry in _REGISTERED.values() if entry.serves]


def engine_named(name: str) -> EngineEntry:
    try:
        return _REGISTERED[name]
    except KeyError:
        raise UserError(f"--engine {name}: no such engine (there are {', '.join(_REGISTERED)})") from None


def default_engine(args) -> EngineEntry:
    """The engine of the parsed flags when --engine is not given: the one that reads the model
    format --model-dir's bundle declares (CTranslate2's when it declares none), else the one whose
    own flag is given (--checkpoint: fairseq)."""
    if args.model_dir:
        declared = exported.declared_model_format(args.model_dir)
        for entry in _REGISTERED.values():
            if entry.export_format == declared:
                return entry
        raise UserError(f"--model-dir {args.model_dir}: its {exported.BUNDLE} declares a model in the format "
                        f"{declared!r}, which no engine of this version reads: install the version that exported it")
    for entry in _REGISTERED.values():
        if entry.chosen_by and getattr(args, entry.chosen_by, None):
            return entry
    raise UserError("give --model-dir (what fairseq-rope-export wrote) or --engine fairseq --checkpoint CKPT")


def opened_by(module: str) -> Callable[..., Engine]:
    """An engine's ``open``: the ``open_for_setup`` function of ``module``, imported only when the
    engine opens (the commands start, and check their flags, without the engine's libraries)."""
    def open_from_module(setup, args, decoding: Decoding, keep_loaded: bool) -> Engine:
        return importlib.import_module(module).open_for_setup(setup, args, decoding, keep_loaded)

    return open_from_module


def open_engine(setup, args, decoding: Decoding, keep_loaded: bool) -> Engine:
    """The engine of ``setup`` (model_setup.check_model's), opened: its model loaded."""
    return engine_named(setup.engine).open(setup, args, decoding, keep_loaded)


def add_engine_arguments(p, offered: List[EngineEntry]) -> None:
    """--engine, a choice of ``offered`` (by default, as :func:`default_engine` chooses), and the
    flags each of them adds."""
    described = [f"{entry.name} ({entry.help})" for entry in offered]
    p.add_argument("--engine", choices=[entry.name for entry in offered],
                   help=" or ".join(filter(None, (", ".join(described[:-1]), described[-1]))))
    for entry in offered:
        if entry.add_arguments is not None:
            entry.add_arguments(p)


# --- engines that read a bundle ----------------------------------------------------------------------
def check_bundle_flags(entry: EngineEntry, args) -> EngineFiles:
    """--model-dir: a bundle, verified against its manifest, of the model format ``entry`` reads."""
    if not args.model_dir:
        raise UserError(f"--engine {entry.name} needs --model-dir (export one with fairseq-rope-export)")
    if not Path(args.model_dir).is_dir():
        raise UserError(f"--model-dir {args.model_dir} is not a directory")
    bundle = verified_model_dir(args.model_dir)
    declared = exported.model_format_of(bundle)
    if declared != entry.export_format:
        raise UserError(f"--model-dir {args.model_dir} holds a model in the format {declared} (its {exported.BUNDLE} "
                        f"says so), which --engine {entry.name} does not read: leave --engine out")
    return EngineFiles(bundle=bundle)


def verified_model_dir(model_dir):
    """The bundle's manifest, every file checked against it, none a link out of it (None: a
    --length-buckets export of a version before bundles, verified by its own manifest); a
    directory without bundle.json is refused, never loaded unverified."""
    try:
        return exported.verified_bundle(model_dir)
    except (OSError, ValueError) as e:
        again = "--length-buckets" if exported.is_bucket_export(model_dir) else ""
        raise UserError(f"--model-dir {model_dir}: {first_line(e)}: export it again with fairseq-rope-export"
                        + (f" {again}" if again else "")) from None


def bundle_model_files(setup) -> dict:
    """Every file of --model-dir, by its name inside it."""
    model_dir = Path(setup.model_dir)
    return {f"--model-dir's {path.relative_to(model_dir)}": path for path in sorted(model_dir.rglob("*"))
            if path.is_file()}


# --- CTranslate2 ---------------------------------------------------------------------------------------
def open_ctranslate2(setup, args, decoding: Decoding, keep_loaded: bool):
    """A CTranslate2 export, or the router over a --length-buckets export's models (every bucket
    used kept loaded with ``keep_loaded``, as lines from a stream come mixed)."""
    from fairseq_rope_tools.deploy.ctranslate2_engine import CTranslate2Engine

    def open_model(model_dir):
        return CTranslate2Engine(model_dir, decoding, args.device, args.compute_type, args.threads)

    if exported.is_bucket_export(setup.model_dir):
        from fairseq_rope_tools.deploy.length_buckets import LengthBuckets

        engine = LengthBuckets(setup.model_dir, open_model, keep_loaded=keep_loaded)
    else:
        engine = open_model(setup.model_dir)
    engine.max_source = args.max_source_positions or recorded_limit(setup.model_dir)  # of an export that loaded
    return engine


def recorded_limit(model_dir):
    """The export's length limit, or None with a warning: CTranslate2 itself has no limit for RoPE
    models and would take any length, up to running out of memory."""
    try:
        limit = exported.source_limit(model_dir)
    except (OSError, ValueError) as e:
        raise UserError(f"--model-dir: cannot read the length limit of {model_dir} ({first_line(e)}): export the "
                        "model again") from None
    if limit is None:
        say(f"--model-dir {model_dir}: the export records no max_source_positions (exported by an older "
            "export_ctranslate2.py): no input-length limit is known; export it again, or pass --max-source-positions")
    return limit


CTRANSLATE2 = register_engine(EngineEntry(
    "ctranslate2", "default when --model-dir is given", open_ctranslate2,
    export_format=exported.CTRANSLATE2_MODEL_FORMAT, checks_vocabulary=True))


# --- fairseq ---------------------------------------------------------------------------------------------
def add_fairseq_arguments(p) -> None:
    p.add_argument("--checkpoint", help="a fairseq checkpoint (.pt) for --engine fairseq")


def check_fairseq_flags(args) -> EngineFiles:
    """--checkpoint, the packages that load it, and a compute type fairseq has."""
    checkpoint = args.checkpoint
    if not checkpoint:
        raise UserError("--engine fairseq needs --checkpoint CKPT")
    missing = [name for name in ("torch", "fairseq") if importlib.util.find_spec(name) is None]
    if missing:  # a deployment installs neither (docs/deploy.md)
        raise UserError(f"--engine fairseq needs {' and '.join(missing)}, which this environment lacks: install "
                        "them (docs/usage.md#install), or translate an export with --model-dir")
    if not Path(checkpoint).is_file():
        raise UserError(f"--checkpoint {checkpoint} is not a file")
    if args.compute_type not in fairseq_engine.COMPUTE_TYPES:
        raise UserError(f"--compute-type {args.compute_type} is for --engine ctranslate2; fairseq takes "
                        f"{', '.join(fairseq_engine.COMPUTE_TYPES)}")
    if args.compute_type in ("float16", "bfloat16") and args.device != "cuda":
        raise UserError(f"--compute-type {args.compute_type} with --engine fairseq needs --device cuda")
    return EngineFiles(checkpoint=checkpoint)


def open_fairseq(setup, args, decoding: Decoding, keep_loaded: bool):
    return fairseq_engine.FairseqEngine(setup.checkpoint, setup.data_bin, setup.src, setup.tgt, decoding, args.device,
                         args.compute_type, args.threads, args.max_source_positions)


FAIRSEQ = register_engine(EngineEntry(
    "fairseq", "with --checkpoint", open_fairseq, add_arguments=add_fairseq_arguments,
    check_flags=check_fairseq_flags, model_files=lambda setup: {"--checkpoint": setup.checkpoint},
    chosen_by="checkpoint", needs_data_bin=True))


# --- ONNX Runtime --------------------------------------------------------------------------------------------
ONNX = register_engine(EngineEntry(
    "onnx", "ONNX Runtime, for an export of --format onnx", opened_by("fairseq_rope_tools.deploy.onnx_engine"),
    export_format=exported.ONNX_MODEL_FORMAT, checks_vocabulary=True, devices=("cpu",)))
