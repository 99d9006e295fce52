"""Decoding a run's averaged model (fairseq-generate, or CTranslate2 by length bucket) and scoring
the decode, with the sentence-split oracle of the joined groups."""

import json
import math
import re
from pathlib import Path

from fairseq_rope_tools import metrics
from fairseq_rope_tools.cli import CommandFailed, plugin_dir, run_logged
from fairseq_rope_tools.deploy.engines import CTRANSLATE2
from fairseq_rope_tools.deploy.segmentation import remove_bpe
from fairseq_rope_tools.research.compare.progress import GeneratedLines, log
from fairseq_rope_tools.research.compare.variants import variant_spec
from fairseq_rope_tools.text_lines import read_lines


def extra_decodes(args, variant):
    """{row suffix: --model-overrides} of the decodes of a variant: the plain one, and RoPE
    frequency scalings."""
    decodes = {"": None}
    if variant_spec(variant).family == "transformer_rope" and args.extrapolation_scaling:
        from fairseq_rope.modules.rope_scaling import scaling_spec

        for spec in args.extrapolation_scaling:
            method, _, factor = spec.partition(":")
            # yarn and the dynamic kinds read the training length L (in tokens) the checkpoint
            # recorded, the same L for all of them, unless --rope-scaling-original-length names one
            scaling = scaling_spec(method)
            overrides = {"rope_scaling": method}
            if scaling.takes_factor:
                overrides["rope_scaling_factor"] = float(factor)
            if scaling.needs_training_length and args.rope_scaling_original_length:
                overrides["rope_scaling_original_length"] = args.rope_scaling_original_length
            decodes[f"+{method}x{float(factor):g}" if scaling.takes_factor else f"+{method}"] = overrides
    return decodes


CT2_BUCKETS = "+ctranslate2-buckets"  # the row suffix of the CTranslate2 length-bucket decode


def decode_settings(args, overrides):
    """Everything that decides the numbers of one decode of a trained run (the joined groups
    decide the test set)."""
    settings = {"overrides": overrides, "generate_args": args.generate_args,
                "decoding": [args.beam, args.lenpen, args.max_len_a, args.max_len_b]}
    if args.length_split:
        settings["joined_groups"] = args.joined_groups
    return settings


def wanted_decodes(args, variant):
    """{row suffix: decode settings} of a variant: fairseq-generate's (:func:`extra_decodes`) and, for
    RoPE with --ctranslate2-length-buckets, CTranslate2's."""
    wanted = {suffix: decode_settings(args, overrides) for suffix, overrides in extra_decodes(args, variant).items()}
    if args.ctranslate2_length_buckets is not None and variant_spec(variant).family == "transformer_rope":
        wanted[CT2_BUCKETS] = {**decode_settings(args, None), "engine": CTRANSLATE2.name,
                               "length_buckets": args.ctranslate2_length_buckets}
        if args.rope_scaling_original_length:  # the buckets' training length, as for fairseq's decodes
            wanted[CT2_BUCKETS]["rope_scaling_original_length"] = args.rope_scaling_original_length
    return wanted


def decode_with_ctranslate2(args, data, checkpoint, settings, log_path, name, slot, run_dir):
    """:func:`decode` through CTranslate2: the averaged model exported with --length-buckets, each
    sentence of the BPE'd test source decoded by the model of its length. Hypotheses have at most
    --max-len-b tokens (--max-len-a is 0: CTranslate2 caps lengths absolutely)."""
    export_dir, out = run_dir / "ct2_length_buckets", run_dir / f"hyp{CT2_BUCKETS}.bpe.txt"
    stats_file = run_dir / f"speed{CT2_BUCKETS}.json"
    training_length = settings.get("rope_scaling_original_length")
    log(f"{name}: exporting to CTranslate2, a model per length bucket")
    run_logged(["fairseq-rope-export", "--checkpoint", checkpoint, "--data-bin", data.data_bin, "--output-dir",
                export_dir, "--length-buckets", *settings["length_buckets"], "--if-changed", "--force",
                *(["--rope-scaling-original-length", training_length] if training_length else [])], log_path)
    log(f"{name}: decoding {args.gen_subset} with CTranslate2")
    run_logged(["fairseq-rope-translate", "--model-dir", export_dir, "--data-bin", data.data_bin,
                "--src", args.source_lang, "--tgt", args.target_lang, "--input-format", "bpe", "--output-format", "bpe",
                "--beam", args.beam, "--lenpen", args.lenpen, "--max-len", args.max_len_b, "--batch-size",
                args.batch_size, "--stats-json", stats_file, "--output", out,
                data.source_text], log_path, env=slot, append=True)
    words = (lambda line: remove_bpe(line, data.bpe_type)) if data.bpe_type else (lambda line: line)
    stats = json.loads(stats_file.read_text())
    return ([(words(s), words(h), None) for s, h in zip(read_lines(data.source_text), read_lines(out))],
            {"seconds": stats["seconds"], "buckets": stats["length_buckets"]["sentences"]})


def generate_seconds(log_path):
    """fairseq-generate's decoding time, model loading excluded ("Translated N sentences (...) in 12.3s")."""
    times = re.findall(r"Translated [\d,]+ sentences \([\d,]+ tokens\) in ([\d.]+)s", Path(log_path).read_text())
    return float(times[-1]) if times else None


def decode_test_set(args, data, checkpoint, overrides, log_path, name, slot):
    """Beam search on ``--gen-subset``: [(source, hypothesis, reference)] in test-set order,
    tokenized, subwords removed."""
    expected = max(end or 0 for _, end in data.groups.values())  # 0: a --data-bin subset of unknown size
    decoding = GeneratedLines(name, expected)
    cmd = ["fairseq-generate", data.data_bin, "--user-dir", plugin_dir(), "--path", checkpoint,
           "--source-lang", args.source_lang, "--target-lang", args.target_lang, "--gen-subset", args.gen_subset,
           "--beam", args.beam, "--lenpen", args.lenpen, "--max-len-a", args.max_len_a, "--max-len-b", args.max_len_b,
           "--batch-size", args.batch_size, "--num-workers", "0",
           # fairseq 0.12's batch_by_size leaves out a final partial batch (n mod 8 sentences);
           # fairseq_rope restores it, and a multiple of 1 has no partial batch at all
           "--required-batch-size-multiple", "1", *data.generate_args, *args.generate_args]
    if overrides:
        cmd += ["--model-overrides", repr(overrides)]
    run_logged(cmd, log_path, env=slot, on_line=decoding)
    rows = decoding.in_order()
    if expected and len(rows) != expected:
        raise CommandFailed(f"fairseq-generate translated {len(rows)} of {expected} test sentences (see {log_path})")
    return rows


def score_decode(args, data, rows, refs_tok, refs_raw):
    """Scores of one decode per test group and tokenized BLEU by source length."""
    hyps = [h for _, h, _ in rows]
    detok = metrics.moses_detokenize(hyps, args.target_lang)
    scores = {"sentences": len(rows), "bleu": {}, "sacrebleu": {}, "chrf": {}}
    for group, (start, end) in data.groups.items():
        end = len(rows) if end is None else end
        result, _ = metrics.score_all(hyps[start:end], refs_tok[start:end], refs_raw[start:end],
                                         args.target_lang, detok_hyps=detok[start:end])
        scores["bleu"][group] = result["tokenized_bleu_compound_split"]["score"]
        scores["sacrebleu"][group] = result["sacrebleu"]["score"]
        scores["chrf"][group] = result["chrf++"]["score"]
        scores["signatures"] = {"sacrebleu": result["sacrebleu"]["signature"], "chrf": result["chrf++"]["signature"]}
    if data.joined:
        scores["oracle"] = {group: oracle_scores(args, scores, group, data.groups[group], parts, hyps, refs_tok,
                                                 refs_raw) for group, parts in data.joined.items()}
    edges = [0, *args.length_buckets, math.inf]
    scores["bleu_by_length"] = {}
    for lo, hi in zip(edges[:-1], edges[1:]):
        label = f"{lo + 1}-{hi}" if hi != math.inf else f">{lo}"
        picked = [i for i, (s, _, _) in enumerate(rows) if lo < len(s.split()) <= hi]
        bleu = metrics.tokenized_bleu([hyps[i] for i in picked], [refs_tok[i] for i in picked])[0].score \
            if picked else math.nan
        scores["bleu_by_length"][label] = {"bleu": bleu, "sentences": len(picked)}
    return scores, detok


def oracle_scores(args, scores, group, line_range, parts, hyps, refs_tok, refs_raw):
    """The sentence-split oracle of a joined group: the decode's own hypotheses of the single
    sentences, joined as their sources were, scored against the group's references; and the
    share of it the decode of the joined inputs reached (``ratio``, decoded / oracle; None where
    the oracle scores 0)."""
    start, end = line_range
    joined = [" ".join(hyps[line] for line in lines) for lines in parts]
    result, _ = metrics.score_all(joined, refs_tok[start:end], refs_raw[start:end], args.target_lang)
    oracle = {"bleu": result["tokenized_bleu_compound_split"]["score"], "sacrebleu": result["sacrebleu"]["score"],
              "chrf": result["chrf++"]["score"]}
    ratio = {key: scores[key][group] / score if score else None for key, score in oracle.items()}
    return {**oracle, "ratio": ratio}
