"""The report of fairseq-rope-compare: scores over seeds, significance tests
against the baseline (fairseq_rope_tools/research/significance.py), the joined groups against
their sentence-split oracle, results.md, results.json and the plots."""

import json
import math
import statistics
from pathlib import Path

from fairseq_rope_base.files import write_atomically, write_text_atomically
from fairseq_rope_tools.research import significance
from fairseq_rope_tools.text_lines import read_lines

METRICS = {"bleu": "tok_bleu", "sacrebleu": "sacrebleu", "chrf": "chrf"}  # result.json key -> test key
WRITTEN = ("results.md", "results.json", "valid_loss.png", "bleu_by_length.png")  # what write() makes in --out-dir


def rows_of(results):
    """(row name, variant, decode suffix) for every variant and extra decode, in order."""
    return [(variant + suffix, variant, suffix) for variant, runs in results.items() for suffix in runs[0]["decodes"]]


def over_seeds(values):
    """{"mean", "std" (sample; None for one seed), "per_seed"} of the finite values."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    return {"mean": statistics.fmean(values) if values else math.nan,
            "std": statistics.stdev(values) if len(values) > 1 else None, "per_seed": values}


def resolved_groups(data, results):
    """The test groups' line ranges; a --data-bin subset's end is the number of sentences decoded."""
    sentences = next(iter(results.values()))[0]["decodes"][""]["sentences"]
    return {name: [start, sentences if end is None else end] for name, (start, end) in data.groups.items()}


def test_significance(args, data, results, groups):
    """{group: {seed: {row: {metric: {score, mean, ci, p}}}}} and the tests' signatures: per seed,
    every row against the baseline's plain decode of the same seed."""
    baseline = args.variants[0]
    out, signatures = {}, {}
    for seed in args.seeds:
        run_dir = lambda variant, seed=seed: args.out_dir / "runs" / variant / f"seed{seed}"  # noqa: E731
        refs_tok = data.refs_tok if data.refs_tok is not None else read_lines(run_dir(baseline) / "ref.tok.txt")
        hyps, detok = {}, {}
        for row, variant, suffix in rows_of(results):
            hyps[row] = read_lines(run_dir(variant) / f"hyp{suffix}.tok.txt")
            detok[row] = read_lines(run_dir(variant) / f"hyp{suffix}.detok.txt")
        refs_raw = data.refs_raw
        if refs_raw is None:
            from fairseq_rope_tools.metrics import moses_detokenize

            refs_raw = moses_detokenize(refs_tok, args.target_lang)
        order = [baseline] + [row for row in hyps if row != baseline]
        for group, (start, end) in groups.items():
            tested, signatures = significance.paired_bootstrap(
                [(row, hyps[row][start:end]) for row in order], refs_tok[start:end], refs_raw[start:end],
                args.target_lang, detok={row: lines[start:end] for row, lines in detok.items()})
            out.setdefault(group, {})[str(seed)] = tested
    return out, signatures


def build(args, data, results):
    """Everything results.json holds."""
    groups = resolved_groups(data, results)
    tests, test_signatures = test_significance(args, data, results, groups)
    summary = {}
    for group in groups:
        for row, variant, suffix in rows_of(results):
            summary.setdefault(group, {})[row] = {
                key: over_seeds([r["decodes"][suffix][key][group] for r in results[variant]]) for key in METRICS}
            oracles = [r["decodes"][suffix].get("oracle", {}).get(group) for r in results[variant]]
            if all(oracles):  # a joined group: its sentence-split oracle, and the share of it reached
                summary[group][row]["oracle"] = {key: over_seeds([o[key] for o in oracles]) for key in METRICS}
                summary[group][row]["oracle_ratio"] = {key: over_seeds([o["ratio"][key] for o in oracles])
                                                       for key in METRICS}
    training = {variant: {key: over_seeds([r[key] for r in runs])
                          for key in ("valid_loss", "tokens_per_second", "train_seconds")}
                for variant, runs in results.items()}
    return {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "groups": groups, "baseline": args.variants[0],
            "references": "the corpus's own" if data.refs_raw is not None else "detokenized from the tokenized text",
            "significance_signatures": test_signatures, "summary": summary, "training": training,
            "significance": tests, "results": results}


# ---------------------------------------------------------------------------------- writing


def fmt(value, digits=2):
    return "n/a" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def fmt_seeds(stats, digits=2):
    text = fmt(stats["mean"], digits) + ("" if stats["std"] is None else f" ± {fmt(stats['std'], digits)}")
    return text + (f" ({', '.join(fmt(v, digits) for v in stats['per_seed'])})" if len(stats["per_seed"]) > 1 else "")


def joined_groups(report):
    """The test groups that have a sentence-split oracle, in order."""
    return [group for group, rows in report["summary"].items() if any("oracle" in stats for stats in rows.values())]


def percent(stats):
    return "n/a" if stats["mean"] is None or math.isnan(stats["mean"]) else f"{100 * stats['mean']:.1f} %"


def oracle_overview(report):
    """The share of the sentence-split oracle each decode reaches on each joined group, beside its
    score on the first group (the sentences as long as in training, with --length-split)."""
    joined = joined_groups(report)
    if not joined:
        return []
    first = next(iter(report["groups"]))
    lines = ["", "## Joined inputs against the sentence-split oracle", "",
             "tok BLEU of each joined group as a share of its sentence-split oracle (the same decode's hypotheses of "
             "the single sentences, joined as the sources were, against the same references), mean over seeds, "
             f"the oracle's BLEU in brackets; and the BLEU of `{first}`:", "",
             "| variant | " + " | ".join(joined) + f" | {first} |", "|---|" + "---|" * (len(joined) + 1)]
    summary = report["summary"]
    for row in summary[joined[0]]:
        cells = [f"{percent(stats['oracle_ratio']['bleu'])} ({fmt(stats['oracle']['bleu']['mean'])})"
                 if "oracle" in stats else "n/a" for stats in (summary[g][row] for g in joined)]
        lines.append(f"| `{row}` | " + " | ".join(cells) + f" | {fmt_seeds(summary[first][row]['bleu'])} |")
    return lines


def updates_spent(run):
    """The updates a run's model cost: its own, and with those of the model it started from."""
    updates = run.get("updates", {})
    own = updates.get("own", int(run["settings"]["recipe_env"]["MAX_UPDATE"]))
    total = updates.get("total", own)
    return f"{own}" + (f" ({total})" if total != own else "")


def own_settings(settings, common_env):
    """A run's own settings: train.sh's knobs that differ from ``common_env`` (the ones every
    variant is said to share), and its flags."""
    knobs = [f"{k}={v}" for k, v in settings["recipe_env"].items() if common_env.get(k) != v]
    start = settings.get("init_from")
    return knobs + ([f"INIT_FROM={start['variant']}"] if start else []) + settings["flags"]


def markdown(args, report):
    results, baseline = report["results"], report["baseline"]
    signatures = results[baseline][0]["decodes"][""].get("signatures", {})
    # every variant's knobs but a training recipe's own (listed under the training table)
    baseline_env = results[baseline][0]["settings"]["recipe_env"]
    common_env = {k: v for k, v in baseline_env.items() if not k.startswith("CONCAT_")}
    lines = [
        "# Position encodings compared", "",
        "Trained by `examples/wmt14_en_de/train.sh` with "
        f"{', '.join(f'{k}={v}' for k, v in common_env.items())}; "
        f"architecture size `{args.size}`; seeds {', '.join(map(str, args.seeds))}"
        + (f"; extra fairseq-train arguments `{' '.join(args.train_args)}`" if args.train_args else "")
        + f". Average of the last {args.average_last} update checkpoints; beam {args.beam}, length penalty "
        f"{args.lenpen}, at most {args.max_len_a:g} x source + {args.max_len_b} tokens"
        + (f"; extra fairseq-generate arguments `{' '.join(args.generate_args)}`" if args.generate_args else "") + ".",
        "",
        "Scores (fairseq-rope-score): **tok BLEU** -- tokenized BLEU with compound splitting, the convention of the "
        f"published WMT14 En-De numbers; **sacreBLEU** -- detokenized, `{signatures.get('sacrebleu', 'n/a')}`; "
        f"**chrF++** -- `{signatures.get('chrf', 'n/a')}`. "
        f"References for sacreBLEU and chrF++: {report['references']}.",
        "",
        "## Training", "",
        "| variant | valid loss | params | train tokens/s | train time (s) | updates (with its start's) |",
        "|---|---|---|---|---|---|",
    ]
    for variant, runs in results.items():
        stats = report["training"][variant]
        params = runs[0]["params"]
        lines.append(f"| `{variant}` | {fmt_seeds(stats['valid_loss'], 3)} | {f'{params:,}' if params else 'n/a'} | "
                     f"{fmt_seeds(stats['tokens_per_second'], 0)} | {fmt_seeds(stats['train_seconds'], 0)} | "
                     f"{updates_spent(runs[0])} |")
    lines.append("\nValidation loss: label-smoothed cross-entropy (base 2) at the last validation. Train time: the "
                 "variant's own, not its start's.")
    own = [f"`{variant}`: " + " ".join(own_settings(runs[0]["settings"], common_env))
           for variant, runs in results.items() if own_settings(runs[0]["settings"], common_env)]
    if own:
        lines.append("Each variant's own settings (train.sh's knobs where they differ from the above; CONCAT_*: "
                     "concatenation training; INIT_FROM: the variant whose averaged model of the same seed it "
                     "started from): " + "; ".join(own) + ".")
    lines += oracle_overview(report)
    names = significance.METRIC_NAMES
    for group, (start, end) in report["groups"].items():
        lines += ["", f"## {group} ({end - start} sentences)", "",
                  "Mean ± sample standard deviation over seeds (the per-seed values in brackets):", "",
                  "| variant | " + " | ".join(names[k] for k in METRICS.values()) + " |", "|---|---|---|---|"]
        for row, stats in report["summary"][group].items():
            lines.append(f"| `{row}` | " + " | ".join(fmt_seeds(stats[k]) for k in METRICS) + " |")
        if group in joined_groups(report):
            lines += ["", "The sentence-split oracle (the same decode's single-sentence hypotheses joined as the "
                      "sources were) and the share of it reached, mean over seeds:", "",
                      "| variant | " + " | ".join(f"{names[k]} oracle | %" for k in METRICS.values()) + " |",
                      "|---|" + "---|---|" * len(METRICS)]
            for row, stats in report["summary"][group].items():
                if "oracle" in stats:
                    cells = [f"{fmt_seeds(stats['oracle'][k])} | {percent(stats['oracle_ratio'][k])}" for k in METRICS]
                    lines.append(f"| `{row}` | " + " | ".join(cells) + " |")
        lines += ["", f"Per seed: score ± half-width of its 95 % bootstrap confidence interval, and the p-value of the "
                  f"paired bootstrap test against `{baseline}` of the same seed ({significance.RESAMPLES} resamples, "
                  "sacreBLEU's seed; * p < 0.05):", "",
                  "| variant | seed | " + " | ".join(f"{names[k]} | p" for k in METRICS.values()) + " |",
                  "|---|---|" + "---|---|" * len(METRICS)]
        for seed, rows in report["significance"][group].items():
            for row, tested in rows.items():
                cells = []
                for key in METRICS.values():
                    t = tested.get(key)
                    cells.append("n/a" if t is None else f"{t['score']:.2f} ± {t['ci']:.2f}")
                    cells.append("-" if t is None or t["p"] is None else f"{t['p']:.3f}{'*' if t['p'] < 0.05 else ''}")
                lines.append(f"| `{row}` | {seed} | " + " | ".join(cells) + " |")
    first = next(iter(results.values()))[0]["decodes"][""]["bleu_by_length"]
    buckets = list(first)
    lines += ["", "## tok BLEU by source length (words), all test groups together", "",
              "| variant | " + " | ".join(buckets) + " |", "|" + "---|" * (len(buckets) + 1)]
    for row, variant, suffix in rows_of(results):
        cells = [fmt_seeds(over_seeds([r["decodes"][suffix]["bleu_by_length"][b]["bleu"] for r in results[variant]]))
                 for b in buckets]
        lines.append(f"| `{row}` | " + " | ".join(cells) + " |")
    lines += ["| sentences | " + " | ".join(str(first[b]["sentences"]) for b in buckets) + " |"]
    lines += ["", "## Decoding time", "",
              f"The whole test set, model loading excluded (fairseq-generate's own timing; "
              f"fairseq-rope-translate's for CTranslate2), {args.threads} CPU thread(s) per run:", "",
              "| variant | seconds | sentences/s |", "|---|---|---|"]
    for row, variant, suffix in rows_of(results):
        timed = [(r["decodes"][suffix]["sentences"], (r["decodes"][suffix].get("decoding_time") or {}).get("seconds"))
                 for r in results[variant]]  # decodes of an older harness have no time
        seconds = over_seeds([t for _, t in timed])
        speed = over_seeds([n / t for n, t in timed if t])
        lines.append(f"| `{row}` | {fmt_seeds(seconds, 1)} | {fmt_seeds(speed, 1)} |")
    lines += ["", "![validation loss](valid_loss.png)", "", "![BLEU by source length](bleu_by_length.png)", ""]
    return "\n".join(lines)


def _save_png(fig, path):
    import matplotlib.pyplot as plt

    write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)


def plot(args, report):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant, runs in results.items():
        curves = [dict((u, loss) for u, loss, _ in r["valid_curve"]) for r in runs]
        updates = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        if updates:
            ax.plot(updates, [statistics.fmean(c[u] for c in curves) for u in updates], marker="o", ms=3, label=variant)
    ax.set(xlabel="update", ylabel="validation loss (base 2)",
           title=f"Validation loss, mean over {len(args.seeds)} seed(s)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    _save_png(fig, args.out_dir / "valid_loss.png")

    joined = joined_groups(report)
    fig, axes = plt.subplots(1, 2 if joined else 1, figsize=(14 if joined else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    for row, variant, suffix in rows_of(results):
        buckets = list(results[variant][0]["decodes"][suffix]["bleu_by_length"])
        values = [over_seeds([r["decodes"][suffix]["bleu_by_length"][b]["bleu"] for r in results[variant]])["mean"]
                  for b in buckets]
        ax.plot(range(len(buckets)), values, marker="o", label=row, linestyle="--" if suffix else "-")
    ax.set_xticks(range(len(buckets)))
    ax.set_xticklabels(buckets)
    ax.set(xlabel="source length (words)", ylabel="tok BLEU", title="BLEU by source length")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if joined:  # each test group, the joined ones with their sentence-split oracle marked
        ax = axes[0][1]
        groups = list(report["groups"])
        for row, _, suffix in rows_of(results):
            summary = {g: report["summary"][g][row] for g in groups}
            line, = ax.plot(range(len(groups)), [summary[g]["bleu"]["mean"] for g in groups], marker="o", label=row,
                            linestyle="--" if suffix else "-")
            at = [groups.index(g) for g in joined if "oracle" in summary[g]]
            ax.plot(at, [summary[groups[i]]["oracle"]["bleu"]["mean"] for i in at], marker="_", markersize=16,
                    markeredgewidth=2, linestyle="none", color=line.get_color())
        ax.plot([], [], marker="_", markersize=16, markeredgewidth=2, linestyle="none", color="gray",
                label="sentence-split oracle")
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(groups, rotation=20)
        ax.set(xlabel="test group", ylabel="tok BLEU", title="BLEU by test group; bars: the sentence-split oracle")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    _save_png(fig, args.out_dir / "bleu_by_length.png")


def write(args, report):
    write_text_atomically(args.out_dir / "results.json", json.dumps(report, indent=1))
    write_text_atomically(args.out_dir / "results.md", markdown(args, report))
    plot(args, report)
