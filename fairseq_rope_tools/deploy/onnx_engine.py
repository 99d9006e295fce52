"""The ONNX Runtime engine: a model exported by ``fairseq-rope-export --format onnx`` (the graphs
of onnx_graphs.py), decoded with fairseq's beam search. Imports neither torch nor fairseq.

The search is fairseq's ``SequenceGenerator`` with its ``BeamSearch`` (as fairseq-generate runs
it: ``</s>`` starts every hypothesis, no ``</s>`` at the first step, 2 x beam candidates of which
those ending in ``</s>`` among the first beam are finished, scores normalised by length **
lenpen, a sentence done when it has beam finished hypotheses, every hypothesis ended at max_len),
vectorised over the batch with numpy. ONNX Runtime's own BeamSearch operator is not used: it
follows Hugging Face's search, which finishes a sentence by its own rule (no running hypothesis
can beat the finished ones, or early_stopping), so its hypotheses can differ from
fairseq-generate's (docs/deploy.md).
"""

import concurrent.futures
import json
from pathlib import Path
from typing import List, Optional

import numpy as np

from fairseq_rope_tools.cli import UserError
from fairseq_rope_tools.deploy.engine import Decoding, Engine, Hypothesis
from fairseq_rope_tools.deploy.exported import MODEL_FILES, ONNX_MODEL_FORMAT, onnx_step_cache_names, read_vocabulary
from fairseq_rope_tools.deploy.segmentation import first_line

ENCODER_FILE, DECODER_FILE, MODEL_CONFIG = MODEL_FILES[ONNX_MODEL_FORMAT]
COMPUTE_TYPES = ("default", "float32")
#: fairseq-generate's --min-len: no hypothesis ends at the first step
MIN_LEN = 1


class OnnxEngine(Engine):
    """``model_dir`` decoded with ``decoding`` on the CPU with ``threads`` threads: a batch is
    split into ``threads`` parts (every ``threads``-th sentence, so that each part has the
    batch's lengths) decoded side by side, each with one ONNX Runtime thread, as CTranslate2's
    inter_threads decode its batches (ONNX Runtime's own intra-op threads gain little on the
    small matrices of a decoding step: docs/deploy.md). Refuses, as UserError, what would fail
    later: no ONNX export there, a device or compute type it does not run, graphs ONNX Runtime
    cannot load."""

    name = "onnx"

    def __init__(self, model_dir, decoding: Decoding, device="cpu", compute_type="default", threads=1):
        try:
            import onnxruntime
        except ImportError:
            raise UserError("--engine onnx: the onnxruntime package is not installed (pip install onnxruntime, "
                            "or run 'make setup')") from None
        model_dir = Path(model_dir)
        missing = [name for name in MODEL_FILES[ONNX_MODEL_FORMAT] if not (model_dir / name).is_file()]
        if missing:
            raise UserError(f"--model-dir {model_dir} is not an ONNX export (no {', '.join(missing)}): export one "
                            "with fairseq-rope-export --format onnx")
        if device != "cpu":
            raise UserError(f"--device {device}: the ONNX engine runs on the CPU here; use --engine ctranslate2 or "
                            "--engine fairseq on cuda")
        if compute_type not in COMPUTE_TYPES:
            raise UserError(f"--compute-type {compute_type}: the ONNX engine computes in float32 "
                            f"(takes {', '.join(COMPUTE_TYPES)})")
        try:
            config = json.loads((model_dir / MODEL_CONFIG).read_text(encoding="utf-8"))
            self.pad, self.eos, self.unk = (int(config[name]) for name in ("pad", "eos", "unk"))
            self.max_source = int(config["max_source_positions"])
            self.max_target = int(config["max_target_positions"])
            self.layers, self.heads, self.head_dim = (int(config[name]) for name in ("decoder_layers", "heads",
                                                                                     "head_dim"))
            _, source = read_vocabulary(model_dir, "source")
            _, self.target = read_vocabulary(model_dir, "target")
            if source is None or self.target is None:
                raise ValueError("no source_vocabulary.json / target_vocabulary.json")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"--model-dir {model_dir}: cannot read {MODEL_CONFIG} ({first_line(e) or type(e).__name__})"
                            ": export it again with fairseq-rope-export --format onnx") from None
        self.source_index = {}
        for index, token in enumerate(source):
            self.source_index.setdefault(token, index)
        options = onnxruntime.SessionOptions()
        # no thread pool (none to spin on a busy host): a run computes in the thread that calls it
        options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
        try:
            self.encoder, self.decoder = (
                onnxruntime.InferenceSession(str(model_dir / name), options, providers=["CPUExecutionProvider"])
                for name in (ENCODER_FILE, DECODER_FILE))
        except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception types on a bad graph
            raise UserError(f"--model-dir {model_dir}: ONNX Runtime cannot load its graphs ({first_line(e)}): export "
                            "it again with fairseq-rope-export --format onnx") from None
        self.decoding, self.threads = decoding, threads
        # ONNX Runtime and numpy's larger operations release the GIL: the parts decode in parallel
        self.workers = concurrent.futures.ThreadPoolExecutor(threads - 1, "onnx") if threads > 1 else None
        self.cache_names, self.cross_names = onnx_step_cache_names(self.layers)

    def translate(self, batch: List[List[str]], decoding: Optional[Decoding] = None) -> List[List[Hypothesis]]:
        decoding = decoding or self.decoding
        parts = min(self.threads, len(batch))
        if parts <= 1:
            return self._translate(batch, decoding)
        # the caller's thread decodes the first part, the pool the others
        others = [self.workers.submit(self._translate, batch[k::parts], decoding) for k in range(1, parts)]
        decoded = [self._translate(batch[0::parts], decoding)] + [future.result() for future in others]
        results: List[List[Hypothesis]] = [[] for _ in batch]
        for k, part in enumerate(decoded):
            results[k::parts] = part
        return results

    def _translate(self, batch: List[List[str]], decoding: Decoding) -> List[List[Hypothesis]]:
        ids = [[self.source_index.get(token, self.unk) for token in source] + [self.eos] for source in batch]
        src_tokens = np.full((len(ids), max(map(len, ids))), self.pad, dtype=np.int64)
        for row, sentence in enumerate(ids):  # left-padded, as fairseq batches sources
            src_tokens[row, src_tokens.shape[1] - len(sentence):] = sentence
        cross = self.encoder.run(None, {"src_tokens": src_tokens})  # keys and values of each layer in turn
        finalized = self.beam_search(src_tokens, cross, decoding)
        return [[Hypothesis([self.target[t] for t in tokens[:-1]], score)
                 for tokens, score in hypotheses[:decoding.nbest]] for hypotheses in finalized]

    def step(self, tokens, step, candidates, cache_rows, cache, cross, src_padding):
        """After ``tokens`` at ``step``: the ``candidates`` most probable next tokens of each row and
        their log-probabilities, that of </s>, and the self-attention cache (keys and values of
        each layer in turn), rows ``cache_rows`` of ``cache`` with this step appended."""
        feeds = {"tokens": np.ascontiguousarray(tokens), "step": np.array(step, dtype=np.int64),
                 "candidates": np.empty(candidates, np.float32), "cache_rows": cache_rows, "src_padding": src_padding}
        feeds.update(zip(self.cache_names, cache))
        feeds.update(zip(self.cross_names, cross))
        top_log_probs, top_tokens, eos_log_probs, *cache = self.decoder.run(None, feeds)
        return top_log_probs, top_tokens, eos_log_probs, cache

    def beam_search(self, src_tokens, cross, decoding: Decoding):
        """fairseq's SequenceGenerator._generate with BeamSearch: per sentence, its finished
        hypotheses as (token ids ending in </s>, score), best first."""
        sentences, beam = src_tokens.shape[0], decoding.beam
        max_len = min(decoding.max_len, self.max_target - 1)
        rows = sentences * beam  # every sentence's beams, sentence-major; its encoder output shared by them
        src_padding = src_tokens == self.pad
        cache = [np.zeros((rows, self.heads, 0, self.head_dim), np.float32)] * len(self.cache_names)
        tokens = np.full((rows, max_len + 2), self.pad, dtype=np.int64)
        tokens[:, 0] = self.eos
        scores = np.zeros((rows, max_len + 1), dtype=np.float32)
        finalized: List[list] = [[] for _ in range(sentences)]
        sentence_ids = np.arange(sentences)  # the original sentence of each row group still decoded
        ignored = np.zeros((sentences, beam), dtype=bool)
        candidates = 2 * beam
        # each row's best: fairseq's 2 x beam best of a sentence are among them (a row's own score
        # adds to all its tokens alike), with one more for the </s> the first step may not take
        per_row = min(candidates + 1, len(self.target) - 1)
        cache_rows = np.arange(rows)
        for step in range(max_len + 1):
            bsz = len(sentence_ids)
            log_probs, next_tokens, eos_log_probs, cache = self.step(tokens[:, step], step, per_row, cache_rows, cache,
                                                                     cross, src_padding)
            if step >= max_len:  # only </s> remains
                log_probs, next_tokens = eos_log_probs[:, None], np.full((len(log_probs), 1), self.eos)
            elif step < MIN_LEN:
                log_probs = np.where(next_tokens == self.eos, -np.inf, log_probs)
            log_probs = np.where(np.isnan(log_probs), -np.inf, log_probs)
            kept_per_row = log_probs.shape[1]
            log_probs = log_probs.reshape(bsz, beam, kept_per_row)
            if step == 0:  # every beam holds the same hypothesis: the first one only
                log_probs = log_probs[:, :1]
            else:
                log_probs = log_probs + scores.reshape(bsz, beam, -1)[:, :, step - 1:step]
            flat = log_probs.reshape(bsz, -1)
            flat_tokens = next_tokens.reshape(bsz, beam * kept_per_row)[:, :flat.shape[1]]
            # ties broken as fairseq's top-k over (beam, vocabulary): the lower beam, then token
            order = flat_tokens + (np.arange(flat.shape[1]) // kept_per_row * len(self.target))
            best = _top_k(flat, min(candidates, flat.shape[1]), order)
            cand_scores = _rows_at(flat, best)
            cand_indices, cand_beams = _rows_at(flat_tokens, best), best // kept_per_row
            cand_rows = cand_beams + (np.arange(bsz) * beam)[:, None]

            eos_mask = (cand_indices == self.eos) & (cand_scores != -np.inf)
            eos_mask[:, :beam][ignored] = False
            done = []
            if eos_mask[:, :beam].any():
                done = self._finalize(step, cand_rows[:, :beam][eos_mask[:, :beam]],
                                      cand_scores[:, :beam][eos_mask[:, :beam]], tokens, scores, finalized,
                                      sentence_ids, beam, max_len, decoding.lenpen)
            if len(done) == bsz or step >= max_len:
                break
            old_rows_of = np.arange(bsz * beam)  # row of the new numbering -> row of this step's cache
            if done:
                kept = np.setdiff1d(np.arange(bsz), done)
                eos_mask, cand_beams = eos_mask[kept], cand_beams[kept]
                cand_scores, cand_indices, ignored = cand_scores[kept], cand_indices[kept], ignored[kept]
                bsz = len(kept)
                cand_rows = cand_beams + (np.arange(bsz) * beam)[:, None]
                kept_rows = (kept[:, None] * beam + np.arange(beam)).reshape(-1)
                tokens, scores, sentence_ids = tokens[kept_rows], scores[kept_rows], sentence_ids[kept]
                old_rows_of = kept_rows
                cross = [tensor[kept] for tensor in cross]
                src_padding = src_padding[kept]

            # the first beam candidates that do not end (finished or ignored ones sort last)
            eos_mask[:, :beam] = ~(~ignored & ~eos_mask[:, :beam])
            active_mask = eos_mask.astype(np.int64) * candidates + np.arange(eos_mask.shape[1])
            active = np.argsort(active_mask, axis=1, kind="stable")[:, :beam]
            ignored = _rows_at(active_mask, active) >= candidates
            active_rows = _rows_at(cand_rows, active).reshape(-1)
            tokens[:, :step + 1] = tokens[active_rows, :step + 1]
            tokens[:, step + 1] = _rows_at(cand_indices, active).reshape(-1)
            scores[:, :step] = scores[active_rows, :step]
            scores[:, step] = _rows_at(cand_scores, active).reshape(-1)
            cache_rows = old_rows_of[active_rows]  # gathered by the next step
        return [sorted(hypotheses, key=lambda h: -h[1]) for hypotheses in finalized]

    def _finalize(self, step, rows, eos_scores, tokens, scores, finalized, sentence_ids, beam, max_len, lenpen):
        """fairseq's finalize_hypos: the hypotheses of ``rows`` end in </s> at ``step``; returns the
        row groups (sentences of the current batch) now finished."""
        normalized = eos_scores / np.float32((step + 1) ** lenpen)
        groups = rows // beam
        for row, group, score in zip(rows, groups, normalized):
            hypotheses = finalized[sentence_ids[group]]
            if len(hypotheses) < beam:
                hypotheses.append((np.append(tokens[row, 1:step + 1], self.eos), float(score)))
        done = []
        for group in np.unique(groups):
            if len(finalized[sentence_ids[group]]) == beam or step == max_len:
                done.append(int(group))
        return done


def open_for_setup(setup, args, decoding: Decoding, keep_loaded: bool) -> OnnxEngine:
    """The engine of ``setup``'s --model-dir (engines.py's entry), with --max-source-positions over
    the exported limit."""
    engine = OnnxEngine(setup.model_dir, decoding, args.device, args.compute_type, args.threads)
    engine.max_source = args.max_source_positions or engine.max_source
    return engine


def _rows_at(values: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """``np.take_along_axis(values, columns, axis=1)`` for 2-D arrays, by plain fancy indexing:
    a step of the search takes nine of these, and numpy's general version costs several times
    more on the small arrays of a batch."""
    return values[np.arange(values.shape[0])[:, None], columns]


def _top_k(values: np.ndarray, k: int, order: np.ndarray) -> np.ndarray:
    """Indices of the ``k`` largest of each row, largest first (ties: lower ``order`` first)."""
    if k < values.shape[1]:
        part = np.argpartition(-values, k - 1, axis=1)[:, :k]
    else:
        part = np.broadcast_to(np.arange(values.shape[1]), values.shape)
    ranks = np.lexsort((_rows_at(order, part), -_rows_at(values, part)), axis=1)
    return _rows_at(part, ranks)
