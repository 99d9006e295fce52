"""Is a difference in BLEU real? sacreBLEU's paired bootstrap resampling (Koehn 2004;
``sacrebleu.significance.PairedTest`` with ``test_type="bs"``) on the metrics of
fairseq-rope-score: compound-split tokenized BLEU, detokenized sacreBLEU and chrF++.

For each system it gives the corpus score, the mean of the resampled scores and the half-width
of their 95 % interval; for every system after the first (the baseline) the p-value of the
hypothesis that it is no different from the baseline. The resamples are drawn from
sacreBLEU's fixed seed (``SACREBLEU_SEED``, 12345 by default), so a rerun gives the same
numbers.

sacreBLEU counts resampled differences strictly larger than the observed one, so a system with
exactly the baseline's score (the same output line for line, or both at 0 BLEU) would get the
smallest possible p-value, 1 / (resamples + 1), as if the difference were significant. No
difference was observed then, and its p-value is 1.
"""


from fairseq_rope_tools import metrics

RESAMPLES = 1000
# metric key -> what the reports call it
METRIC_NAMES = {"tok_bleu": "tok BLEU", "sacrebleu": "sacreBLEU", "chrf": "chrF++"}


def _paired_bs(named_systems, metrics, references, n_samples):
    """sacreBLEU's paired bootstrap; returns ({key: [Result per system]}, {key: signature})."""
    from sacrebleu.significance import PairedTest

    signatures, scores = PairedTest(named_systems, metrics, [references], test_type="bs", n_samples=n_samples)()
    # sacreBLEU keys its results by the metric's own name (BLEU, chrF2++), in the order given
    names = [name for name in scores if name != "System"]
    return ({key: scores[name] for key, name in zip(metrics, names)},
            {key: str(signatures[name]) for key, name in zip(metrics, names)})


def paired_bootstrap(systems, refs_tok, refs_raw=None, lang="de", detok=None, n_samples=RESAMPLES):
    """``systems``: [(name, tokenized hypotheses)], the baseline first, each as long as
    ``refs_tok``. With untokenized references ``refs_raw``, sacreBLEU and chrF++ are tested too,
    on the Moses-detokenized hypotheses (``detok[name]`` when already at hand).

    Returns ``({name: {metric: {"score", "mean", "ci", "p"}}}, {metric: signature})``, metrics
    ``tok_bleu``, ``sacrebleu``, ``chrf``; ``p`` is None for the baseline."""
    for name, hyps in systems:
        if len(hyps) != len(refs_tok):
            raise ValueError(f"{name}: {len(hyps)} hypotheses for {len(refs_tok)} references")
    results, signatures = _paired_bs(
        [(name, [metrics.compound_split(h) for h in hyps]) for name, hyps in systems],
        {"tok_bleu": metrics.tokenized_bleu_metric()},
        [metrics.compound_split(r) for r in refs_tok], n_samples)
    if refs_raw is not None:
        detok = detok or {}
        detokenized = [(name, detok.get(name) or metrics.moses_detokenize(hyps, lang)) for name, hyps in systems]
        more, more_signatures = _paired_bs(
            detokenized, {"sacrebleu": metrics.sacrebleu_metric(), "chrf": metrics.chrf_pp_metric()},
            refs_raw, n_samples)
        results.update(more)
        signatures.update(more_signatures)
    out = {}
    for i, (name, _) in enumerate(systems):
        out[name] = {}
        for key, per_system in results.items():
            result, baseline = per_system[i], per_system[0]
            p = None if i == 0 else 1.0 if result.score == baseline.score else float(result.p_value)
            out[name][key] = {"score": result.score, "mean": float(result.mean), "ci": float(result.ci), "p": p}
    return out, signatures
