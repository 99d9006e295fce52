"""Reading fairseq-train's log: losses, validation and speed per update.

Standard library only.
"""

import json
import math
import re
from typing import Iterable

# fairseq-train logs one line per --log-interval updates (train_inner), one per validation
# (valid) and one per epoch (train), in --log-format simple (the recipe's) or json:
#   ... | train_inner | epoch 001:     25 / 164 loss=9.648, nll_loss=9.529, ..., num_updates=25, ...
#   ... | valid | epoch 001 | valid on 'valid' subset | loss 7.5 | nll_loss 7.2 | ... | num_updates 100
#   ... | valid | {"epoch": 1, "valid_loss": "7.5", ..., "valid_num_updates": "100"}

_LOG_KIND = re.compile(r"\| (train_inner|train|valid) \| (.*)$")
_MODEL_PARAMS = re.compile(r"num\. (?:shared )?model params: ([\d,]+)")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?$")


def parse_train_line(line: str, subset: str = "valid"):
    """``(kind, {name: number})`` for a train_inner, train or valid line of fairseq-train's log
    (names without their ``train_``/``valid_`` prefix: loss, nll_loss, wps, num_updates, ...),
    ``("params", {"params": n})`` for the model-size line, else None. Only ``subset`` counts
    as validation (in --log-format simple, which names it; json lines do not)."""
    m = _MODEL_PARAMS.search(line)
    if m:
        return "params", {"params": int(m.group(1).replace(",", ""))}
    m = _LOG_KIND.search(line)
    if not m:
        return None
    kind, rest = m.groups()
    if rest.startswith("{"):
        try:
            record = json.loads(rest)
        except ValueError:
            return None
        # json names carry the subset ("valid_loss", "train_wps"; train_inner's do not)
        prefix = f"{kind}_"
        pairs = ((name[len(prefix):] if name.startswith(prefix) else name, value) for name, value in record.items())
    elif kind == "train_inner":
        pairs = (field.split("=", 1) for field in rest.split(", ") if "=" in field)
        pairs = ((name.rsplit(" ", 1)[-1], value) for name, value in pairs)
    else:
        if kind == "valid" and f"valid on '{subset}' subset" not in rest:
            return None
        pairs = (field.split(" ", 1) for field in rest.split(" | ") if " " in field)
    fields = {}
    for name, value in pairs:
        value = str(value).strip()
        if _NUMBER.match(value):
            fields[name] = float(value)
    return (kind, fields) if "num_updates" in fields else None


def parse_train_log(lines: Iterable[str], subset: str = "valid") -> dict:
    """What a fairseq-train log says about the run: ``params`` (None if not logged),
    ``train_curve`` [[update, loss]], ``valid_curve`` [[update, loss, nll_loss]] (for a resumed
    run the last value logged for an update wins), ``valid_loss`` / ``valid_nll_loss`` at the
    last validation (nan without one), ``tokens_per_second`` and ``updates_per_second``, the means
    of the logged train_inner words and updates per second (of the per-epoch values when no
    train_inner line was logged), and ``speed_curve`` [[update, words/s, updates/s]] of the
    train_inner lines."""
    if isinstance(lines, str):
        lines = lines.splitlines()
    params, train, valid, speed_curve = None, {}, {}, {}
    epoch = {"wps": [], "ups": []}
    for line in lines:
        parsed = parse_train_line(line, subset)
        if parsed is None:
            continue
        kind, fields = parsed
        if kind == "params":
            params = fields["params"]
            continue
        update = int(fields["num_updates"])
        if kind == "valid" and "loss" in fields:
            valid[update] = (fields["loss"], fields.get("nll_loss", math.nan))
        elif kind == "train_inner":
            if "loss" in fields:
                train[update] = fields["loss"]
            speed_curve[update] = [fields.get("wps", math.nan), fields.get("ups", math.nan)]
        elif kind == "train":
            for name, values in epoch.items():
                if name in fields:
                    values.append(fields[name])
    curve = sorted(valid.items())

    def mean_speed(index, name):
        # per update, so that the intervals a resumed run logged twice count once
        values = [speeds[index] for speeds in speed_curve.values() if not math.isnan(speeds[index])] or epoch[name]
        return sum(values) / len(values) if values else math.nan

    return {
        "params": params,
        "train_curve": [[u, loss] for u, loss in sorted(train.items())],
        "valid_curve": [[u, loss, nll] for u, (loss, nll) in curve],
        "valid_loss": curve[-1][1][0] if curve else math.nan,
        "valid_nll_loss": curve[-1][1][1] if curve else math.nan,
        "tokens_per_second": mean_speed(0, "wps"),
        "updates_per_second": mean_speed(1, "ups"),
        "speed_curve": [[u, *speeds] for u, speeds in sorted(speed_curve.items())],
    }
