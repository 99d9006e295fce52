"""Paired A/B measurements: run A and B alternately, summarise by medians and by the ratio B / A of
each adjacent pair, and pool the pairs of several runs.

Pairs, not two independent samples, because a shared machine drifts: two adjacent repetitions see
the same load, so their ratio cancels most of it. Standard library only.
"""

import random
import statistics


def alternate(fn_a, fn_b, reps, on_rep=None):
    """A B A B ...; the order inside a pair flips every repetition (A B, B A, A B ...) so that
    neither side always runs second. Returns the values of A and of B, pair by pair.
    ``on_rep(rep)``, if given, is called as each pair starts (rep 1 to ``reps``)."""
    a_values, b_values = [], []
    for rep in range(reps):
        if on_rep is not None:
            on_rep(rep + 1)
        if rep % 2 == 0:
            a_values.append(fn_a())
            b_values.append(fn_b())
        else:
            b_values.append(fn_b())
            a_values.append(fn_a())
    return a_values, b_values


def median_interval(ratios, resamples=2000, seed=0):
    """95 % bootstrap percentile interval of the median of ``ratios`` (None below 5 of them):
    how well a run pins the median down on a noisy machine."""
    if len(ratios) < 5:
        return None
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return [medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]]


def summarise(a_values, b_values, higher_is_better=True):
    """Medians of A (``baseline``) and B (``rope``) and of the per-pair ratios B / A."""
    ratios = [b / a for a, b in zip(a_values, b_values) if a]  # no ratio to zero page faults
    return {
        "baseline": statistics.median(a_values),
        "rope": statistics.median(b_values),
        "ratio_median": statistics.median(ratios) if ratios else None,
        "ratio_min": min(ratios) if ratios else None,
        "ratio_max": max(ratios) if ratios else None,
        "ratio_median_ci95": median_interval(ratios),
        "baseline_all": a_values,
        "rope_all": b_values,
        "ratios": ratios,
        "higher_is_better": higher_is_better,
    }


def summarise_counts(a_values, b_values, unit):
    """Medians of counts (page faults) of A and B. Counts, not speeds: their ratio means little
    (and nothing when one side is zero), so none is given."""
    result = summarise(a_values, b_values, higher_is_better=False)
    result.update(unit=unit, ratio_median=None, ratio_min=None, ratio_max=None, ratio_median_ci95=None)
    return result


def pool_ratios(runs):
    """Pool the per-pair ratios of several runs (each ``{row: summary}``) row by row, rows in the
    order they first appear: ``{row: {runs, pairs, ratio_median, ratio_median_ci95, ratio_min,
    ratio_max}}`` for every row that has ratios."""
    pooled = {}
    for key in dict.fromkeys(k for results in runs for k in results):
        with_ratios = [results[key]["ratios"] for results in runs if key in results and results[key].get("ratios")]
        ratios = [r for run_ratios in with_ratios for r in run_ratios]
        if ratios:
            pooled[key] = {"runs": len(with_ratios), "pairs": len(ratios), "ratio_median": statistics.median(ratios),
                           "ratio_median_ci95": median_interval(ratios), "ratio_min": min(ratios),
                           "ratio_max": max(ratios)}
    return pooled
