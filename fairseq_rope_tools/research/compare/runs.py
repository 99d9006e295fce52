"""One run of the harness: its settings, its training through the recipe (resumed when
interrupted), its averaged model, its decodes; reused when made before with the same settings."""

import json
import os
import re
import shutil
import time

from fairseq_rope_base.files import file_fingerprint, write_lines_atomically, write_text_atomically
from fairseq_rope_tools import metrics
from fairseq_rope_tools.cli import duration, run_logged
from fairseq_rope_tools.deploy.engines import CTRANSLATE2
from fairseq_rope_tools.recipes import recipe_step
from fairseq_rope_tools.research.compare.decoding import (
    CT2_BUCKETS,
    decode_test_set,
    decode_with_ctranslate2,
    generate_seconds,
    score_decode,
    wanted_decodes,
)
from fairseq_rope_tools.research.compare.progress import TrainingProgress, log
from fairseq_rope_tools.research.compare.variants import (
    architecture,
    base_variant,
    recipe_value,
    run_value,
    start_of,
    variant_spec,
)
from fairseq_rope_tools.training_log import parse_train_log

TRAIN_SH = recipe_step("wmt14_en_de", "train.sh")


RESULT_FORMAT = 3  # format 2 is upgraded (its trained model kept, its decodes redone); older is rerun


def run_settings(args, variant, seed, start_sha256=None):
    """Everything that decides a run's trained model (the threads per training aside); each
    decode's own settings are :func:`decode_settings`. A variant that starts from another's model
    is decided by that model too: ``start_sha256``, its averaged.pt's (given once it is trained)."""
    spec = variant_spec(variant)
    flags = spec.flags + (["--rope-random-positions", f"{recipe_value(args, variant, 'rope_random_positions'):g}"]
                          if spec.random_positions else [])
    # the variant that names the model, its own settings in flags and recipe_env: a run of
    # rope_concat@concat-max-sentences=3 is a run of rope_concat with --concat-max-sentences 3
    settings = {"variant": base_variant(variant), "seed": seed, "arch": architecture(spec.family, args.size),
                "flags": flags, "recipe_env": recipe_env(args, variant), "train_args": args.train_args,
                "average_last": args.average_last, "data": args.data_source}
    if start_of(args, variant):  # only then: the settings of the runs from scratch stay those made before
        settings["init_from"] = {"variant": start_of(args, variant), "sha256": start_sha256}
    return settings


def start_checkpoint(args, variant, seed):
    """The averaged model of the run ``variant`` of ``seed`` starts from."""
    return args.out_dir / "runs" / start_of(args, variant) / f"seed{seed}" / "averaged.pt"


def recipe_env(args, variant):
    """The knobs of examples/wmt14_en_de/train.sh the comparison sets for a variant (all else:
    its defaults)."""
    max_update = run_value(args, variant, "max_update")
    env = {"MAX_UPDATE": max_update, "LR": args.lr, "WARMUP_UPDATES": run_value(args, variant, "warmup_updates"),
           "UPDATE_FREQ": 1, "SAVE_INTERVAL_UPDATES": run_value(args, variant, "save_interval_updates"),
           "KEEP_INTERVAL_UPDATES": args.average_last,
           # a progress line every 2 % of the way, at most every 100 updates (the recipe's interval)
           "LOG_INTERVAL": min(100, max(1, max_update // 50)),
           "NUM_WORKERS": 0}
    if args.max_tokens:
        env["MAX_TOKENS"] = args.max_tokens
    if args.dropout is not None:
        env["DROPOUT"] = args.dropout
    if variant_spec(variant).concatenation:
        env.update(CONCAT_MAX_SENTENCES=recipe_value(args, variant, "concat_max_sentences"),
                   CONCAT_PROB=f"{recipe_value(args, variant, 'concat_prob'):g}")
        if recipe_value(args, variant, "concat_from_epoch") > 1:  # else the settings of the runs made before it
            env["CONCAT_FROM_EPOCH"] = recipe_value(args, variant, "concat_from_epoch")
    return {k: str(v) for k, v in env.items()}


def average_last(save_dir, k, output, log_path):
    """Average the last k update checkpoints with fairseq-rope-average."""
    found = [p for p in os.listdir(save_dir) if re.match(r"^checkpoint_\d+_\d+\.pt$", p)]
    n = min(k, len(found))
    if n == 0:
        shutil.copy(save_dir / "checkpoint_last.pt", output)
        return 1
    run_logged(["fairseq-rope-average", "--inputs", save_dir,
                "--num-update-checkpoints", n, "--output", output], log_path)
    return n


def run_one(args, data, variant, seed, slot, start=None):
    """Train, average, decode and score one variant with one seed; ``slot``: the environment of
    the CPU threads or GPU this run may use; ``start``: the result of the run it starts from, if
    any. A run trained before with the same settings is not trained again: only the decodes that
    are new or decided by other settings are made."""
    name = f"{variant} seed {seed}"
    run_dir = args.out_dir / "runs" / variant / f"seed{seed}"
    result_file = run_dir / "result.json"
    averaged = run_dir / "averaged.pt"
    settings = run_settings(args, variant, seed,
                            start and file_fingerprint(start_checkpoint(args, variant, seed))[1])
    wanted = wanted_decodes(args, variant)
    started = time.time()
    result = json.loads(result_file.read_text()) if result_file.exists() and not args.overwrite else None
    if result and result.get("format") == 2:  # its settings held the decodes' too; those are redone
        for key in ("generate_args", "decoding", "extrapolation_scaling"):
            result["settings"].pop(key, None)
        result["format"] = RESULT_FORMAT
    if result and (result.get("format") != RESULT_FORMAT or result.get("settings") != settings
                   or not averaged.exists()):
        log(f"{name}: {result_file} was made by other settings or an older harness; running it again")
        result = None
    # the updates the model cost, its start's included (recorded on results made before this record too)
    own_updates = int(settings["recipe_env"]["MAX_UPDATE"])
    updates = {"own": own_updates, "total": own_updates + (start["updates"]["total"] if start else 0)}
    if result is None:
        result = train_and_average(args, data, name, run_dir, settings, averaged, slot,
                                   start and start_checkpoint(args, variant, seed))
        result["updates"] = updates
        # saved now, so that a decode that fails or is interrupted does not cost the training
        write_text_atomically(result_file, json.dumps(result, indent=1))
    elif result.get("decode_settings") == wanted:
        if result.get("updates") != updates:
            result["updates"] = updates
            write_text_atomically(result_file, json.dumps(result, indent=1))
        log(f"{name}: done before, reusing {result_file}")
        return result
    else:
        result["updates"] = updates  # written with the new decodes
        log(f"{name}: reusing the trained model of {result_file}; decoding what is new or changed")
    done_before = result.get("decode_settings", {})
    decodes = {}
    for suffix, wanted_settings in wanted.items():
        if done_before.get(suffix) == wanted_settings:
            decodes[suffix] = result["decodes"][suffix]
            continue
        log_path = run_dir / f"generate{suffix}.log"
        if wanted_settings.get("engine") == CTRANSLATE2.name:
            rows, speed = decode_with_ctranslate2(args, data, averaged, wanted_settings, log_path,
                                                  f"{name}{suffix}", slot, run_dir)
        else:
            rows = decode_test_set(args, data, averaged, wanted_settings["overrides"], log_path,
                          f"{name}: decoding {args.gen_subset}{suffix}", slot)
            speed = {"seconds": generate_seconds(log_path)}
        refs_tok = data.refs_tok if data.refs_tok is not None else [t for _, _, t in rows]
        refs_raw = (data.refs_raw if data.refs_raw is not None
                    else metrics.moses_detokenize(refs_tok, args.target_lang))
        decodes[suffix], detok = score_decode(args, data, rows, refs_tok, refs_raw)
        decodes[suffix]["decoding_time"] = speed
        write_lines_atomically(run_dir / f"hyp{suffix}.tok.txt", (h for _, h, _ in rows))
        write_lines_atomically(run_dir / f"hyp{suffix}.detok.txt", detok)
        if data.refs_tok is None:
            write_lines_atomically(run_dir / "ref.tok.txt", refs_tok)
    for suffix in set(result["decodes"]) - set(wanted):  # no longer asked for: no stale files either
        for stale in (f"generate{suffix}.log", f"hyp{suffix}.tok.txt", f"hyp{suffix}.detok.txt",
                      f"hyp{suffix}.bpe.txt", f"speed{suffix}.json"):
            (run_dir / stale).unlink(missing_ok=True)
        if suffix == CT2_BUCKETS:
            shutil.rmtree(run_dir / "ct2_length_buckets", ignore_errors=True)
    result.update(decodes=decodes, decode_settings=wanted)
    write_text_atomically(result_file, json.dumps(result, indent=1))
    log(f"{name}: done in {duration(time.time() - started)}; tok BLEU "
        + ", ".join(f"{k} {v:.2f}" for k, v in decodes[""]["bleu"].items()))
    return result


def interrupted_training(run_dir, settings, overwrite):
    """Seconds an interrupted training of these settings in ``run_dir`` had run, if it can be
    resumed from its checkpoint_last.pt; else None."""
    progress_file = run_dir / "training.json"
    if overwrite or not (run_dir / "checkpoints" / "checkpoint_last.pt").exists() or not progress_file.exists():
        return None
    try:
        progress = json.loads(progress_file.read_text())
    except ValueError:
        return None
    return progress["seconds"] if progress.get("settings") == settings else None


def train_and_average(args, data, name, run_dir, settings, averaged, slot, init_from=None):
    """Train one run with the recipe (from the model ``init_from``, if given) and average its last
    checkpoints into ``averaged``: the run's result without decodes. An interrupted training of
    the same settings is resumed from its last checkpoint (train.sh resumes from
    checkpoint_last.pt), its log continued."""
    save_dir = run_dir / "checkpoints"
    progress_file = run_dir / "training.json"
    seconds_before = interrupted_training(run_dir, settings, args.overwrite)
    if seconds_before is None:
        shutil.rmtree(run_dir, ignore_errors=True)
        save_dir.mkdir(parents=True)
        seconds_before = 0.0
        log(f"{name}: training {' '.join([settings['arch'], *settings['flags']])} for "
            f"{settings['recipe_env']['MAX_UPDATE']} updates" + (f" from {init_from}" if init_from else "") + " "
            f"(log: {run_dir / 'train.log'})")
    else:
        log(f"{name}: resuming its interrupted training from {save_dir / 'checkpoint_last.pt'} "
            f"(log: {run_dir / 'train.log'})")

    def record_elapsed(seconds):
        write_text_atomically(progress_file, json.dumps({"settings": settings, "seconds": seconds}))

    record_elapsed(seconds_before)
    progress = TrainingProgress(name, int(settings["recipe_env"]["MAX_UPDATE"]), seconds_before, record_elapsed)
    env = {**slot, **settings["recipe_env"], "DATA_BIN": str(data.data_bin), "SAVE_DIR": str(save_dir),
           "ARCH": settings["arch"], "SRC": args.source_lang, "TGT": args.target_lang, "SEED": str(settings["seed"]),
           "LOG_FILE": os.devnull}  # train.sh would tee into a log of its own; train.log is ours
    if init_from is not None:
        env["INIT_FROM"] = str(init_from)
    # through env(1), so that each attempt's first line in train.log is the complete command to rerun it by hand
    run_logged(["env", *(f"{k}={v}" for k, v in env.items()), "bash", TRAIN_SH, *settings["flags"], *args.train_args],
               run_dir / "train.log", name="train.sh", on_line=progress, append=True)
    with open(run_dir / "train.log", encoding="utf-8", errors="replace") as f:
        result = {"format": RESULT_FORMAT, "settings": settings, "variant": settings["variant"],
                  "seed": settings["seed"], "train_seconds": progress.elapsed(), **parse_train_log(f)}
    result["averaged_checkpoints"] = average_last(save_dir, args.average_last, averaged, run_dir / "average.log")
    if not args.keep_checkpoints:
        shutil.rmtree(save_dir)
    progress_file.unlink()
    result.update(decodes={}, decode_settings={})
    return result
