#!/usr/bin/env python3
"""Compare position encodings for translation under identical conditions, in one command.

Every variant is trained with the same hyper-parameters, update budget and seeds; the last
``--average-last`` update checkpoints are averaged (``scripts/average_checkpoints.py``); the
average is decoded with beam 4 and length penalty 0.6 and scored with sacreBLEU. Output in
``--out-dir``:

* ``results.md`` -- one row per variant: BLEU (mean and sample std over seeds, per test group),
  final validation loss, parameters, training tokens/s;
* ``results.json`` -- every number of every run;
* ``valid_loss.png`` -- validation loss per update, one line per variant (mean over seeds);
* ``bleu_by_length.png`` -- BLEU by source-length bucket.

Variants: ``sinusoidal``, ``learned``, ``none`` (stock fairseq ``transformer``), ``rpe``
(Shaw et al. 2018, ``transformer_rpe``), ``rope``, ``roper`` (``--rope-values``),
``rope_linear`` (``--attention-kind linear``).

Data, one of:

* ``--data-bin DIR``: an existing fairseq data-bin, decoded on ``--gen-subset``;
* ``--raw-dir DIR``: whitespace-tokenized ``{train,valid,test}.{SRC,TGT}``, binarized here with a
  joined dictionary;
* ``--quickstart-corpus``: the synthetic corpus of ``scripts/generate_corpus.py``.

With raw text, ``--length-split L`` trains on pairs whose both sides have at most L tokens and
tests on four groups: test pairs up to L tokens, test pairs longer than L, and consecutive
test pairs concatenated to 2x and 3x length -- how each encoding extrapolates. RoPE variants
can additionally be decoded with frequency scaling (``--extrapolation-scaling yarn:4``), the
same checkpoint run through ``--model-overrides``.

Example::

    python scripts/compare_position_encodings.py --quickstart-corpus --out-dir work/compare \\
        --size tiny --seeds 1 2 3 --max-update 3000 --length-split 20 \\
        --extrapolation-scaling ntk:3 yarn:3
"""

import argparse
import json
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from text_lines import InputError, read_lines  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# name -> (model family, flags); the family is mapped to an architecture by --size
VARIANTS = {
    "sinusoidal": ("transformer", []),
    "learned": ("transformer", ["--encoder-learned-pos", "--decoder-learned-pos"]),
    "none": ("transformer", ["--no-token-positional-embeddings"]),
    "rpe": ("transformer_rpe", []),
    "rope": ("transformer_rope", []),
    "roper": ("transformer_rope", ["--rope-values"]),
    "rope_linear": ("transformer_rope", ["--attention-kind", "linear"]),
}
SIZES = {
    "tiny": {"transformer": "transformer_tiny", "transformer_rope": "transformer_rope_tiny",
             "transformer_rpe": "transformer_rpe_tiny"},
    "base": {"transformer": "transformer", "transformer_rope": "transformer_rope",
             "transformer_rpe": "transformer_rpe"},
    "wmt_en_de": {"transformer": "transformer_wmt_en_de", "transformer_rope": "transformer_rope_wmt_en_de",
                  "transformer_rpe": "transformer_rpe_wmt_en_de"},
}
GROUPS_FILE = "test_groups.json"


def log(message):
    print(f"[compare] {message}", flush=True)


def run(cmd, log_path=None, env_extra=None):
    """Run a console script of this environment; its output goes to ``log_path``."""
    exe = BIN / cmd[0]
    cmd = [str(exe) if exe.exists() else cmd[0], *map(str, cmd[1:])]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(env_extra or {})
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if log_path is not None:
        Path(log_path).write_text(" ".join(shlex.quote(c) for c in cmd) + "\n" + proc.stdout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:2])} ... failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
    return proc.stdout


# ---------------------------------------------------------------------------------- data


def read_pairs(raw_dir, split, src, tgt):
    """The sentence pairs of RAW_DIR/SPLIT.{SRC,TGT}, read strictly (scripts/text_lines.py)."""
    src_path, tgt_path = Path(raw_dir) / f"{split}.{src}", Path(raw_dir) / f"{split}.{tgt}"
    sources, targets = read_lines(src_path), read_lines(tgt_path)
    if len(sources) != len(targets):
        raise InputError(f"{src_path} ({len(sources)} lines) and {tgt_path} ({len(targets)} lines) are not parallel")
    return [(a.split(), b.split()) for a, b in zip(sources, targets)]


def write_pairs(prefix, pairs, src, tgt):
    with open(f"{prefix}.{src}", "w") as fs, open(f"{prefix}.{tgt}", "w") as ft:
        for a, b in pairs:
            fs.write(" ".join(a) + "\n")
            ft.write(" ".join(b) + "\n")


def concatenated(pairs, n):
    """Consecutive pairs joined n at a time: test sentences n times as long."""
    return [
        (sum((p[0] for p in pairs[i:i + n]), []), sum((p[1] for p in pairs[i:i + n]), []))
        for i in range(0, len(pairs) - n + 1, n)
    ]


def prepare_raw(raw_dir, out_dir, src, tgt, length_split):
    """Binarize raw text; the test set is the concatenation of named groups, whose line ranges
    are recorded in ``test_groups.json``."""
    text_dir = out_dir / "text"
    text_dir.mkdir(parents=True, exist_ok=True)
    train, valid, test = (read_pairs(raw_dir, s, src, tgt) for s in ("train", "valid", "test"))
    if length_split:
        short = lambda p: max(len(p[0]), len(p[1])) <= length_split  # noqa: E731
        train, valid = [p for p in train if short(p)], [p for p in valid if short(p)]
        groups = [
            (f"test <= {length_split}", [p for p in test if short(p)]),
            (f"test > {length_split}", [p for p in test if not short(p)]),
            ("test x2", concatenated(test, 2)),
            ("test x3", concatenated(test, 3)),
        ]
        if not train or not valid:
            raise ValueError(f"--length-split {length_split} leaves no training or validation pairs")
    else:
        groups = [("test", test)]
    groups = [(name, pairs) for name, pairs in groups if pairs]
    write_pairs(text_dir / "train", train, src, tgt)
    write_pairs(text_dir / "valid", valid, src, tgt)
    write_pairs(text_dir / "test", [p for _, pairs in groups for p in pairs], src, tgt)
    ranges, start = {}, 0
    for name, pairs in groups:
        ranges[name] = [start, start + len(pairs)]
        start += len(pairs)
    data_bin = out_dir / "data-bin"
    if data_bin.exists():
        shutil.rmtree(data_bin)
    run(["fairseq-preprocess", "--source-lang", src, "--target-lang", tgt,
         "--trainpref", text_dir / "train", "--validpref", text_dir / "valid", "--testpref", text_dir / "test",
         "--destdir", data_bin, "--joined-dictionary", "--workers", "1"], log_path=out_dir / "preprocess.log")
    (data_bin / GROUPS_FILE).write_text(json.dumps(ranges, indent=1))
    log(f"binarized {len(train)} train / {len(valid)} valid pairs; test groups "
        + ", ".join(f"{k}: {v[1] - v[0]}" for k, v in ranges.items()))
    return data_bin


def quickstart_corpus(out_dir, args):
    """The synthetic corpus of scripts/generate_corpus.py, punctuation split off as tokens."""
    raw = out_dir / "corpus"
    run([sys.executable, REPO / "scripts" / "generate_corpus.py", "--out-dir", raw, "--seed", args.corpus_seed,
         "--train-size", args.corpus_train_size, "--valid-size", 300, "--test-size", 500,
         "--src", args.source_lang, "--tgt", args.target_lang])
    tokenized = out_dir / "corpus-tok"
    tokenized.mkdir(exist_ok=True)
    for path in raw.iterdir():
        lines = path.read_text().splitlines()
        (tokenized / path.name).write_text("".join(re.sub(r"([.,;:!?])", r" \1 ", l).strip() + "\n" for l in lines))
    return tokenized


# ---------------------------------------------------------------------------------- runs


def train_command(args, data_bin, variant, seed, save_dir):
    family, flags = VARIANTS[variant]
    save_every = args.save_interval_updates or max(1, args.max_update // (2 * args.average_last))
    return [
        "fairseq-train", data_bin, "--user-dir", REPO / "fairseq_rope", "--task", "translation",
        "--arch", SIZES[args.size][family], *flags,
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", args.lr,
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", args.warmup_updates, "--warmup-init-lr", "1e-07",
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--dropout", args.dropout, "--max-tokens", args.max_tokens, "--max-update", args.max_update,
        "--seed", seed, "--save-dir", save_dir, "--no-epoch-checkpoints",
        "--save-interval-updates", save_every, "--keep-interval-updates", args.average_last,
        "--validate-interval-updates", save_every, "--log-format", "json",
        "--log-interval", max(1, args.max_update // 20), "--num-workers", "0",
        *(["--share-all-embeddings"] if args.share_all_embeddings else []),
        *shlex.split(args.train_args),
    ]


def parse_train_log(text):
    valid, wps, epoch_wps, params = [], [], [], None
    for line in text.splitlines():
        m = re.search(r"num\. (?:shared )?model params: ([\d,]+)", line)
        if m:
            params = int(m.group(1).replace(",", ""))
        brace = line.find("{")
        if brace < 0:
            continue
        try:
            record = json.loads(line[brace:])
        except ValueError:
            continue
        if "| valid |" in line and "valid_loss" in record:
            valid.append((int(float(record["valid_num_updates"])), float(record["valid_loss"]),
                          float(record.get("valid_nll_loss", "nan"))))
        elif "| train_inner |" in line and "wps" in record:
            wps.append(float(record["wps"]))
        elif "| train |" in line and "train_wps" in record:
            epoch_wps.append(float(record["train_wps"]))
    curve = sorted({u: (loss, nll) for u, loss, nll in valid}.items())
    speeds = wps or epoch_wps
    return {
        "valid_curve": [[u, loss, nll] for u, (loss, nll) in curve],
        "valid_loss": curve[-1][1][0] if curve else float("nan"),
        "valid_nll_loss": curve[-1][1][1] if curve else float("nan"),
        "params": params,
        "tokens_per_second": statistics.fmean(speeds) if speeds else float("nan"),
    }


def average_last(save_dir, k, output):
    """Average the last k update checkpoints with scripts/average_checkpoints.py."""
    found = [p for p in os.listdir(save_dir) if re.match(r"^checkpoint_\d+_\d+\.pt$", p)]
    n = min(k, len(found))
    if n == 0:
        shutil.copy(save_dir / "checkpoint_last.pt", output)
        return 1
    run([sys.executable, REPO / "scripts" / "average_checkpoints.py", "--inputs", save_dir,
         "--num-update-checkpoints", n, "--output", output])
    return n


def decode(args, data_bin, checkpoint, subset, log_path, overrides=None):
    """Beam search on ``subset``; returns {id: (source tokens, hypothesis, reference)}."""
    cmd = ["fairseq-generate", data_bin, "--user-dir", REPO / "fairseq_rope", "--path", checkpoint,
           "--gen-subset", subset, "--beam", args.beam, "--lenpen", args.lenpen,
           "--max-len-a", args.max_len_a, "--max-len-b", args.max_len_b,
           "--batch-size", args.batch_size, "--num-workers", "0",
           # fairseq 0.12's batch_by_size leaves out a final partial batch (n mod 8 sentences);
           # fairseq_rope restores it, and a multiple of 1 has no partial batch at all
           "--required-batch-size-multiple", "1", *shlex.split(args.generate_args)]
    if overrides:
        cmd += ["--model-overrides", repr(overrides)]
    out = run(cmd, log_path=log_path)
    rows = {}
    for line in out.splitlines():
        kind, _, rest = line.partition("-")
        if kind not in ("S", "T", "H") or "\t" not in rest:
            continue
        fields = rest.split("\t")
        if not fields[0].isdigit():
            continue
        entry = rows.setdefault(int(fields[0]), {})
        entry[kind] = fields[-1]
    return {i: (r.get("S", ""), r.get("H", ""), r.get("T", "")) for i, r in rows.items()}


def bleu(pairs):
    import sacrebleu

    if not pairs:
        return float("nan")
    hyps, refs = zip(*pairs)
    return sacrebleu.corpus_bleu(list(hyps), [list(refs)], tokenize="none", force=True).score


def score(outputs, groups, buckets):
    by_group = {}
    for name, (start, end) in groups.items():
        by_group[name] = bleu([(h, r) for i, (s, h, r) in outputs.items() if start <= i < end])
    edges = [0, *buckets, math.inf]
    by_length = {}
    for lo, hi in zip(edges[:-1], edges[1:]):
        label = f"{lo + 1}-{hi}" if hi != math.inf else f">{lo}"
        pairs = [(h, r) for s, h, r in outputs.values() if lo < len(s.split()) <= hi]
        by_length[label] = {"bleu": bleu(pairs), "sentences": len(pairs)}
    return {"bleu": by_group, "bleu_by_length": by_length}


def run_one(args, data_bin, groups, variant, seed):
    run_dir = args.out_dir / "runs" / variant / f"seed{seed}"
    result_file = run_dir / "result.json"
    if result_file.exists() and not args.overwrite:
        log(f"{variant} seed {seed}: done before, reusing {result_file}")
        return json.loads(result_file.read_text())
    save_dir = run_dir / "checkpoints"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    save_dir.mkdir(parents=True)
    log(f"{variant} seed {seed}: training ({args.max_update} updates)")
    started = time.time()
    train_log = run(train_command(args, data_bin, variant, seed, save_dir), log_path=run_dir / "train.log",
                    env_extra={"OMP_NUM_THREADS": str(args.threads)})
    result = {"variant": variant, "seed": seed, "train_seconds": time.time() - started, **parse_train_log(train_log)}
    averaged = run_dir / "averaged.pt"
    result["averaged_checkpoints"] = average_last(save_dir, args.average_last, averaged)
    decodes = {"": None}
    if VARIANTS[variant][0] == "transformer_rope":
        for spec in args.extrapolation_scaling:
            method, factor = spec.split(":")
            overrides = {"rope_scaling": method, "rope_scaling_factor": float(factor)}
            if method == "yarn":
                overrides["rope_scaling_original_length"] = int(args.length_split or args.yarn_original_length)
            decodes[f"+{method}x{float(factor):g}"] = overrides
    result["decodes"] = {}
    for suffix, overrides in decodes.items():
        outputs = decode(args, data_bin, averaged, args.gen_subset, run_dir / f"generate{suffix}.log", overrides)
        expected = max(end for _, end in groups.values())
        if expected < 10 ** 12 and len(outputs) != expected:
            raise RuntimeError(f"fairseq-generate translated {len(outputs)} of {expected} test sentences "
                               f"(see {run_dir / f'generate{suffix}.log'})")
        result["decodes"][suffix] = score(outputs, groups, args.length_buckets)
    if not args.keep_checkpoints:
        shutil.rmtree(save_dir)
    result_file.write_text(json.dumps(result, indent=1))
    main_bleu = result["decodes"][""]["bleu"]
    log(f"{variant} seed {seed}: BLEU " + ", ".join(f"{k} {v:.2f}" for k, v in main_bleu.items()))
    return result


# ---------------------------------------------------------------------------------- report


def mean_spread(values):
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else float("nan"))


def fmt(mean, spread, digits=2):
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.{digits}f}" + ("" if math.isnan(spread) else f" ± {spread:.{digits}f}")


def rows_of(results):
    """(row name, variant, decode suffix) for every variant and extra decode, in order."""
    rows = []
    for variant, runs in results.items():
        for suffix in runs[0]["decodes"]:
            rows.append((variant + suffix, variant, suffix))
    return rows


def write_report(args, results, groups):
    lines = [
        "# Position encodings compared",
        "",
        f"Architecture size `{args.size}`, {args.max_update} updates, max tokens {args.max_tokens}, "
        f"lr {args.lr}, seeds {', '.join(map(str, args.seeds))}; average of the last "
        f"{args.average_last} update checkpoints; beam {args.beam}, length penalty {args.lenpen}, "
        f"at most {args.max_len_a:g} x source + {args.max_len_b} output tokens. "
        "BLEU: sacreBLEU on the tokenized text (`tokenize=none`), mean ± sample standard deviation over "
        "seeds. Validation loss: label-smoothed cross-entropy (base 2) at the last validation.",
        "",
    ]
    group_names = list(groups)
    header = ["variant", *(f"BLEU {g}" for g in group_names), "valid loss", "params", "train tokens/s"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row, variant, suffix in rows_of(results):
        runs = results[variant]
        cells = [f"`{row}`"]
        for g in group_names:
            cells.append(fmt(*mean_spread([r["decodes"][suffix]["bleu"][g] for r in runs])))
        if suffix:
            cells += ["(same model)", "", ""]
        else:
            cells.append(fmt(*mean_spread([r["valid_loss"] for r in runs]), digits=3))
            params = runs[0]["params"]
            cells.append(f"{params:,}" if params else "n/a")
            cells.append(fmt(*mean_spread([r["tokens_per_second"] for r in runs]), digits=0))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "BLEU by source length (tokens), all test groups together:", ""]
    buckets = list(next(iter(results.values()))[0]["decodes"][""]["bleu_by_length"])
    lines += ["| variant | " + " | ".join(buckets) + " |", "|" + "---|" * (len(buckets) + 1)]
    for row, variant, suffix in rows_of(results):
        cells = [fmt(*mean_spread([r["decodes"][suffix]["bleu_by_length"][b]["bleu"] for r in results[variant]]))
                 for b in buckets]
        lines.append(f"| `{row}` | " + " | ".join(cells) + " |")
    counts = next(iter(results.values()))[0]["decodes"][""]["bleu_by_length"]
    lines += ["| sentences | " + " | ".join(str(counts[b]["sentences"]) for b in buckets) + " |", ""]
    lines += ["![validation loss](valid_loss.png)", "", "![BLEU by source length](bleu_by_length.png)", ""]
    (args.out_dir / "results.md").write_text("\n".join(lines))


def plot(args, results):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant, runs in results.items():
        curves = [dict((u, loss) for u, loss, _ in r["valid_curve"]) for r in runs]
        updates = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        if updates:
            ax.plot(updates, [statistics.fmean(c[u] for c in curves) for u in updates], marker="o", ms=3, label=variant)
    ax.set_xlabel("update")
    ax.set_ylabel("validation loss (base 2)")
    ax.set_title(f"Validation loss, mean over {len(args.seeds)} seed(s)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out_dir / "valid_loss.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row, variant, suffix in rows_of(results):
        buckets = list(results[variant][0]["decodes"][suffix]["bleu_by_length"])
        values = [mean_spread([r["decodes"][suffix]["bleu_by_length"][b]["bleu"] for r in results[variant]])[0]
                  for b in buckets]
        ax.plot(range(len(buckets)), values, marker="o", label=row, linestyle="--" if suffix else "-")
    ax.set_xticks(range(len(buckets)))
    ax.set_xticklabels(buckets)
    ax.set_xlabel("source length (tokens)")
    ax.set_ylabel("BLEU")
    ax.set_title("BLEU by source length")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out_dir / "bleu_by_length.png", dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--data-bin", type=Path, help="existing fairseq data-bin")
    data.add_argument("--raw-dir", type=Path, help="whitespace-tokenized {train,valid,test}.{SRC,TGT}")
    data.add_argument("--quickstart-corpus", action="store_true", help="generate the synthetic corpus")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--source-lang", default="en")
    p.add_argument("--target-lang", default="de")
    p.add_argument("--corpus-train-size", type=int, default=20000)
    p.add_argument("--corpus-seed", type=int, default=1)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--size", choices=list(SIZES), default="tiny", help="architecture size of every variant")
    p.add_argument("--max-update", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-updates", type=int, default=None, help="default: max-update / 10")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--share-all-embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help="default: on when the data is binarized here (joined dictionary)")
    p.add_argument("--train-args", default="", help="extra fairseq-train arguments, the same for every variant")
    p.add_argument("--generate-args", default="", help="extra fairseq-generate arguments (e.g. --remove-bpe)")
    p.add_argument("--save-interval-updates", type=int, default=None,
                   help="checkpoint (and validation) interval; default: max-update / (2 x average-last)")
    p.add_argument("--average-last", type=int, default=5, help="average this many last update checkpoints")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--lenpen", type=float, default=0.6)
    p.add_argument("--max-len-a", type=float, default=1.2, help="hypotheses have at most a x source + b tokens")
    p.add_argument("--max-len-b", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--gen-subset", default="test")
    p.add_argument("--length-split", type=int, default=None, metavar="L",
                   help="train on pairs of at most L tokens; test on longer and concatenated ones (raw data only)")
    p.add_argument("--extrapolation-scaling", nargs="*", default=[], metavar="METHOD:FACTOR",
                   help="also decode RoPE variants with --rope-scaling METHOD (linear, ntk, yarn) and this factor")
    p.add_argument("--yarn-original-length", type=int, default=64,
                   help="training length for yarn without --length-split")
    p.add_argument("--length-buckets", type=int, nargs="+", default=[10, 20, 30, 40],
                   help="upper edges of the source-length buckets")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each training")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep the per-update checkpoints")
    p.add_argument("--overwrite", action="store_true", help="rerun runs that already have a result")
    args = p.parse_args(argv)
    if args.length_split and args.data_bin:
        p.error("--length-split needs raw text (--raw-dir or --quickstart-corpus)")
    for spec in args.extrapolation_scaling:
        method, _, factor = spec.partition(":")
        if method not in ("linear", "ntk", "yarn") or not re.fullmatch(r"\d+(\.\d+)?", factor or ""):
            p.error(f"--extrapolation-scaling expects METHOD:FACTOR with METHOD linear, ntk or yarn; got {spec!r}")
    if args.warmup_updates is None:
        args.warmup_updates = max(1, args.max_update // 10)
    if args.share_all_embeddings is None:
        args.share_all_embeddings = args.data_bin is None
    return args


def main(argv=None):
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.data_bin:
        data_bin = args.data_bin.resolve()
        groups_file = data_bin / GROUPS_FILE
        groups = json.loads(groups_file.read_text()) if groups_file.exists() and args.gen_subset == "test" else None
    else:
        raw = quickstart_corpus(args.out_dir, args) if args.quickstart_corpus else args.raw_dir
        try:
            data_bin = prepare_raw(raw, args.out_dir, args.source_lang, args.target_lang, args.length_split)
        except InputError as e:
            sys.exit(f"error: {e}")
        groups = json.loads((data_bin / GROUPS_FILE).read_text())
    if groups is None:
        groups = {args.gen_subset: [0, 10 ** 12]}
    results = {}
    for variant in args.variants:
        results[variant] = [run_one(args, data_bin, groups, variant, seed) for seed in args.seeds]
    (args.out_dir / "results.json").write_text(json.dumps(
        {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
         "groups": groups, "results": results}, indent=1))
    write_report(args, results, groups)
    plot(args, results)
    log(f"wrote {args.out_dir / 'results.md'}")
    print((args.out_dir / "results.md").read_text())


if __name__ == "__main__":
    main()
