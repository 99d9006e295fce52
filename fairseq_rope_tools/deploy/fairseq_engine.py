"""The fairseq engine: a checkpoint decoded by fairseq's hub interface, as fairseq-generate decodes
it (its sequence generator, fairseq-generate's defaults for everything evaluate.sh does not set).
torch and fairseq load when the engine is built, not when this module is imported."""

from pathlib import Path
from typing import List, Optional

from fairseq_rope_tools.cli import UserError, plugin_dir
from fairseq_rope_tools.deploy.engine import Decoding, Engine, Hypothesis, limit_openmp_spinning
from fairseq_rope_tools.deploy.segmentation import first_line

COMPUTE_TYPES = ("default", "float32", "float16", "bfloat16")


class FairseqEngine(Engine):
    """``checkpoint`` with the dictionaries of ``data_bin`` (``src`` -> ``tgt``), decoded with
    ``decoding`` on ``device`` in ``compute_type`` with ``threads`` threads; ``max_source``: a
    length limit other than the model's own (--max-source-positions)."""

    name = "fairseq"

    def __init__(self, checkpoint, data_bin, src, tgt, decoding: Decoding, device="cpu", compute_type="default",
                 threads=1, max_source: Optional[int] = None):
        import logging

        limit_openmp_spinning(threads)  # when torch is not loaded yet
        import torch

        from fairseq_rope.third_party_warnings import quiet_third_party_warnings

        logging.getLogger("fairseq").setLevel(logging.WARNING)  # no INFO lines about loading
        quiet_third_party_warnings()  # the hydra and data-loader warnings every fairseq command prints

        torch.set_num_threads(threads)
        if device == "cuda" and not torch.cuda.is_available():
            raise UserError("--device cuda: torch sees no CUDA device")
        from omegaconf import open_dict

        hub = self.load(Path(checkpoint), Path(data_bin), src, tgt, flag=f"--checkpoint {checkpoint}")
        hub.eval()
        if device == "cuda":
            hub.cuda()
        if compute_type == "float16":
            hub.half()
        elif compute_type == "bfloat16":
            hub.bfloat16()
        with open_dict(hub.cfg):
            hub.cfg.dataset.max_tokens = None  # our batches are the batches: no re-splitting by tokens
        self.hub, self.torch, self.open_dict = hub, torch, open_dict
        self.max_source = self.source_limit(hub, max_source)
        self.decoding = decoding

    @staticmethod
    def load(checkpoint: Path, data_bin: Path, src, tgt, flag):
        """fairseq's hub interface for ``checkpoint`` with the dictionaries of ``data_bin``, as
        TransformerModel.from_pretrained builds it, in two steps so that a failure names its cause:
        the file is no checkpoint, or it does not fit the data-bin."""
        from argparse import Namespace

        from fairseq import checkpoint_utils, utils
        from fairseq.hub_utils import GeneratorHubInterface

        from fairseq_rope.checkpoint_files import is_legacy_checkpoint, is_readable_checkpoint

        overrides = dict(data=str(data_bin.resolve()), user_dir=plugin_dir(), source_lang=src, target_lang=tgt)
        utils.import_user_module(Namespace(user_dir=overrides["user_dir"]))
        resolved = str(checkpoint.resolve())
        try:
            if not (is_readable_checkpoint(resolved) or is_legacy_checkpoint(resolved)):
                # torch's own errors for such files speak of weights_only and miniz
                raise ValueError("not a file written by torch.save, or a truncated one")
            state = checkpoint_utils.load_checkpoint_to_cpu(resolved, overrides)
            if state.get("cfg") is None and state.get("args") is None:
                raise KeyError("it holds no model configuration")
        except Exception as e:  # torch, pickle and zip errors, or a file of another kind: all mean the same
            raise UserError(f"{flag} is not a readable fairseq checkpoint ({first_line(e)}): "
                            "give a checkpoint written by fairseq-train") from None
        try:
            models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([resolved], arg_overrides=overrides,
                                                                              state=state)
        except (RuntimeError, KeyError, ValueError) as e:
            mismatch = [line.strip() for line in str(e).splitlines() if "size mismatch" in line]
            raise UserError(f"{flag} does not fit the dictionaries of --data-bin {data_bin} "
                            f"({mismatch[0] if mismatch else first_line(e)}): give the work dir / data-bin the model "
                            "was trained on") from None
        return GeneratorHubInterface(cfg, task, models)

    @staticmethod
    def source_limit(hub, requested):
        """The longest source in positions: the model's, or ``requested`` (--max-source-positions)
        where the model can take it (rotary and sinusoidal positions extend, learned ones do not)."""
        limits = hub.max_positions if isinstance(hub.max_positions, tuple) else (hub.max_positions, None)
        if requested is None:
            return limits[0]
        from fairseq.modules import LearnedPositionalEmbedding

        learned = isinstance(getattr(hub.models[0].encoder, "embed_positions", None), LearnedPositionalEmbedding)
        if learned and requested > limits[0]:
            raise UserError(f"--max-source-positions {requested}: the model has learned positions for at most "
                            f"{limits[0]} source tokens")
        hub.max_positions = (requested, *limits[1:])  # the limit fairseq's batching checks sources against
        return requested

    @staticmethod
    def generate_options(decoding: Decoding) -> dict:
        """The hub's ``generate`` options for ``decoding``: fairseq-generate's defaults for everything
        evaluate.sh does not set."""
        return dict(beam=decoding.beam, lenpen=decoding.lenpen, max_len_a=0, max_len_b=decoding.max_len, min_len=1,
                    nbest=decoding.nbest, unkpen=0, sampling=False, no_repeat_ngram_size=0, match_source_len=False)

    def translate(self, batch: List[List[str]], decoding: Optional[Decoding] = None) -> List[List[Hypothesis]]:
        decoding = decoding or self.decoding
        with self.open_dict(self.hub.cfg):
            self.hub.cfg.dataset.batch_size = len(batch)  # the hub batches again inside generate
        tokens = [self.hub.binarize(" ".join(sentence)) for sentence in batch]
        with self.torch.inference_mode():
            hypos = self.hub.generate(tokens, **self.generate_options(decoding))
        return [[Hypothesis(self.hub.tgt_dict.string(h["tokens"]).split(), float(h["score"]))
                 for h in sentence[:decoding.nbest]] for sentence in hypos]
