"""The CTranslate2 engine: one exported model directory (fairseq-rope-export), decoded by
``ctranslate2.Translator``, the one place it is built. Imports neither torch nor fairseq."""

from pathlib import Path
from typing import List, Optional

from fairseq_rope_tools.cli import UserError
from fairseq_rope_tools.deploy.engine import Decoding, Engine, Hypothesis, limit_openmp_spinning
from fairseq_rope_tools.deploy.segmentation import first_line

# CTranslate2's Linux wheels load cuBLAS at run time, from the CUDA major version they were built
# with (4.x: CUDA 12, "Library libcublas.so.12 is not found" at the first translation without it).
# A machine with only CUDA 13 (torch 2.11+cu130, say) has none.
CTRANSLATE2_CUDA_MAJOR = {4: 12}


def ctranslate2_cuda_problem() -> Optional[str]:
    """Why CTranslate2 cannot translate on CUDA here, as one line, or None."""
    import ctypes

    import ctranslate2

    if ctranslate2.get_cuda_device_count() == 0:
        return "CTranslate2 sees no CUDA device"
    cuda = CTRANSLATE2_CUDA_MAJOR.get(int(ctranslate2.__version__.split(".")[0]))
    if cuda is not None:
        try:
            ctypes.CDLL(f"libcublas.so.{cuda}")
        except OSError:
            return (f"CTranslate2 {ctranslate2.__version__} needs CUDA {cuda}'s cuBLAS (libcublas.so.{cuda}), which "
                    f"this machine cannot load: pip install nvidia-cublas-cu{cuda} and put its nvidia/cublas/lib "
                    "directory on LD_LIBRARY_PATH")
    return None


class CTranslate2Engine(Engine):
    """``model_dir`` decoded with ``decoding`` on ``device`` (cpu or cuda) in ``compute_type``
    (``default``: as exported) with ``threads`` intra-op threads. Refuses, as UserError, what
    would fail later: no export there, a device or compute type CTranslate2 lacks, an unloadable
    model. CTranslate2 has no length limit of its own for RoPE models: ``max_source`` is the
    caller's to set (fairseq-rope-translate: as the export records it,
    :func:`~fairseq_rope_tools.deploy.exported.source_limit`)."""

    name = "ctranslate2"

    def __init__(self, model_dir, decoding: Decoding, device="cpu", compute_type="default", threads=1):
        limit_openmp_spinning(threads)
        try:
            import ctranslate2
        except ImportError:
            raise UserError("--engine ctranslate2: the ctranslate2 package is not installed "
                            "(pip install 'ctranslate2>=4.6.3,<5', or run 'make setup')") from None
        model_dir = Path(model_dir)
        if not (model_dir / "model.bin").is_file() or not (model_dir / "config.json").is_file():
            raise UserError(f"--model-dir {model_dir} is not a CTranslate2 model directory (no model.bin and "
                            "config.json): export one with fairseq-rope-export")
        problem = ctranslate2_cuda_problem() if device == "cuda" else None
        if problem:
            raise UserError(f"--device cuda: {problem}")
        supported = ctranslate2.get_supported_compute_types(device) | {"default", "auto"}
        if compute_type not in supported:
            raise UserError(f"--compute-type {compute_type} is not supported by CTranslate2 on {device} "
                            f"(supported: {', '.join(sorted(supported))})")
        self.options = self.translate_options(decoding)
        try:
            self.translator = ctranslate2.Translator(str(model_dir), device=device, compute_type=compute_type,
                                                     intra_threads=threads, inter_threads=1)
        except (RuntimeError, ValueError) as e:
            raise UserError(f"--model-dir {model_dir}: CTranslate2 cannot load {model_dir / 'model.bin'} "
                            f"({first_line(e)}): export it again with fairseq-rope-export") from None

    @staticmethod
    def translate_options(decoding: Decoding) -> dict:
        """``translate_batch``'s options for ``decoding``."""
        return dict(beam_size=decoding.beam, length_penalty=decoding.lenpen, max_decoding_length=decoding.max_len,
                    num_hypotheses=decoding.nbest, return_scores=True,
                    max_input_length=0)  # no silent truncation: the caller applies the length limit

    def translate(self, batch: List[List[str]], decoding: Optional[Decoding] = None) -> List[List[Hypothesis]]:
        options = self.options if decoding is None else self.translate_options(decoding)
        return [[Hypothesis(tokens, score) for tokens, score in zip(r.hypotheses, r.scores)]
                for r in self.translator.translate_batch(batch, **options)]
