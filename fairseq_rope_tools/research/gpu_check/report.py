"""fairseq-rope-gpu-check's report: the verdicts over its sections, and report.md, one renderer
per section (report.json is the sections as they are)."""

import math


def verdicts(report):
    """{check: True / False / None (not run, or not reached yet)} over the report; a step that
    failed fails its check."""
    def verdict(section, value):
        return None if section not in report else bool(value(report[section]))

    return {"kernel within tolerance": verdict("kernel", lambda kernel: kernel.get("pass")),
            "RoPE fp16 loss within tolerance of fp32": None if "training" not in report else
            report["training"].get("fp16_verdict", {}).get("pass", False),
            **{f"{name} float32 identical to fairseq": verdict(key, lambda rows: rows.get("float32_identical_verdict"))
               for key, name in EXPORTED_ENGINES},
            # None while the check runs: the steps not reached yet may still fail
            "every step ran": False if failed_steps(report) else (True if report.get("complete") else None)}


def failed_steps(report):
    """The names of the sections, and of the training runs, that failed."""
    sections = {name: s for name, s in report.items() if isinstance(s, dict)}
    runs = sections.get("training", {}).get("runs", {})
    return [name for name, step in {**sections, **runs}.items() if step.get("status") == "failed"]


def cell(value, digits=4):
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.{digits}g}"
    return "-" if value is None else str(value)


def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def failed_md(section):
    return f"**failed**: {section['error']}" if section.get("status") == "failed" else None


def environment_md(env):
    gpu = env.get("gpu", {})
    rows = [("device", env["device"]), ("GPU", gpu.get("name")), ("compute capability", gpu.get("capability")),
            ("GPU memory (GiB)", gpu.get("memory_gib")), ("CUDA", env["cuda"]), ("torch", env["torch"]),
            ("Triton", env["triton"]), ("CTranslate2", env["ctranslate2"]), ("fairseq", env["fairseq"]),
            ("Python", env["python"]), ("CPU", env["cpu"])]
    return markdown_table(("", ""), rows)


def kernel_md(kernel):
    rows = [(dtype, r["cases"], r["forward_abs"], r["forward_ulps"], r["backward_abs"], r["backward_ulps"],
             r["tolerance"], "pass" if r["pass"] else "**FAIL**") for dtype, r in kernel["dtypes"].items()]
    return (f"{kernel['backend']}, shapes (T, B, H, head_dim) {kernel['shapes']}; largest errors against "
            "the rotation computed in fp64 and rounded once to the dtype, in ulps of the dtype at the reference "
            "value (fp32 is judged by its absolute error: results near zero make its ulps large).\n\n"
            + markdown_table(("dtype", "cases", "forward abs", "forward ulps", "backward abs", "backward ulps",
                              "tolerance", "verdict"), rows))


def training_md(training):
    runs = {name: run for name, run in training["runs"].items() if "valid_curve" in run}
    updates = sorted({u for run in runs.values() for u, *_ in run["valid_curve"]})

    def at(run, update):  # valid loss at a validation, and the last train loss logged by then
        valid = {u: loss for u, loss, _ in run["valid_curve"]}.get(update)
        logged = [loss for u, loss in run["train_curve"] if u <= update]
        return f"{cell(valid)} / {cell(logged[-1]) if logged else '-'}"

    curves = markdown_table(("update", *runs), [(u, *(at(run, u) for run in runs.values())) for u in updates])
    skipped = [f"- {name}: {run.get('error', run['status'])}" for name, run in training["runs"].items()
               if "valid_curve" not in run]
    summary = markdown_table(("run", "arch", "final valid loss", "final train loss", "words/s", "updates/s", "seconds"),
                    [(name, r["arch"], r["final_valid_loss"], r["final_train_loss"], r["words_per_second"],
                      r["updates_per_second"], r["seconds"]) for name, r in runs.items()])
    v = training["fp16_verdict"]
    verdict = (f"RoPE fp16 final validation loss {cell(v['fp16'])} vs fp32 {cell(v['fp32'])}: fp16 higher by "
               f"{cell(v['rope_excess'])} (relative; sinusoidal: {cell(v['sinusoidal_excess'])}), allowed "
               f"{cell(v['allowed'])} (tolerance {v['tolerance']} plus sinusoidal's excess): "
               f"**{'pass' if v['pass'] else 'FAIL'}**"
               if v["pass"] is not None else f"RoPE fp16 vs fp32: {v['status']}")
    return "\n\n".join([f"{training['updates']} updates on {training['device']}; validation / train loss "
                        f"(label-smoothed cross-entropy, base 2); plot: {training['plot']}", curves, summary,
                        "\n".join(skipped), verdict])


def generation_md(generation):
    rows = [(name, r["sentences"], r["seconds"], r["sentences_per_second"], r["tokens_per_second"])
            for name, r in generation["runs"].items()]
    return (f"fairseq-generate, beam {generation['beam']}, lenpen {generation['lenpen']}, at most "
            f"{generation['max_len']} tokens, batch {generation['batch_size']}; decoding time only.\n\n"
            + markdown_table(("model and precision", "sentences", "seconds", "sentences/s", "tokens/s"), rows))


def speed_md(speed):
    from fairseq_rope.modules.fused_rotary import FUSED_SWITCH  # here: the plugin loads torch and fairseq
    parts = [markdown_table(("RoPE / sinusoidal", "ratio"), speed["rope_over_sinusoidal"].items())]
    if speed.get("fused_over_reference_rotation"):
        parts.append(markdown_table((f"RoPE, fused kernel / reference rotation ({FUSED_SWITCH}=0)", "ratio"),
                           speed["fused_over_reference_rotation"].items()))
    return "\n\n".join(parts)


def bandwidth_md(bw):
    return markdown_table(("", ""), [("q and k (T, B, H, head_dim)", bw["shape"]), ("dtype", bw["dtype"]),
                            ("bytes read + written", bw["bytes_moved"]), ("GB/s", bw["gb_per_s"]),
                            ("device copy GB/s", bw["copy_gb_per_s"]), ("peak GB/s", bw["peak_gb_per_s"]),
                            ("peak from", bw["peak_source"]), ("% of peak", bw["percent_of_peak"])])


def exported_engine_md(section):
    rows = [(r["compute_type"], r["weights"], r["compared_with"], f"{r['identical']}/{r['sentences']}",
             r["fairseq_at_length_limit"], r["sentences_per_second"], f"{r['speedup']}x") for r in section["rows"]]
    return ("The RoPE model, exported by fairseq-rope-export, decoded with fairseq-generate's settings. A "
            "hypothesis that reaches the length limit may differ: fairseq forces and scores </s> after it, "
            "the engine stops.\n\n"
            + markdown_table(("compute type", "weights", "compared with", "identical lines",
                              "fairseq lines at the length limit", "sentences/s", "speed-up"), rows))


#: the sections of the exported engines (report key, name): deploy/engines.py's names
EXPORTED_ENGINES = (("ctranslate2", "CTranslate2"), ("onnx", "ONNX Runtime"))
SECTIONS = (("environment", "Environment", environment_md), ("kernel", "Fused rotation kernel", kernel_md),
            ("training", "Training", training_md), ("generation", "Generation", generation_md),
            ("speed", "Speed: RoPE / sinusoidal", speed_md), ("bandwidth", "Fused rotation bandwidth", bandwidth_md),
            *((key, name, exported_engine_md) for key, name in EXPORTED_ENGINES))


def report_markdown(report):
    mode = "tiny (CPU plumbing check: the numbers mean nothing)" if report["tiny"] else "full"
    if not report["complete"]:
        mode += f"; **incomplete**: written {report['seconds']} s into the check, which has not finished"
    parts = [f"# GPU check ({mode})", "## Verdicts", markdown_table(("check", "result"), [
        (k, {True: "pass", False: "**FAIL**", None: "not run"}[v]) for k, v in report["verdicts"].items()])]
    not_asked = {key for key, _ in EXPORTED_ENGINES} - set(report.get("engines", ()))
    for key, title, render in SECTIONS:
        if key in not_asked:
            continue
        section = report.get(key)
        parts += [f"## {title}", "not reached yet" if section is None else failed_md(section) or render(section)]
    return "\n\n".join(parts) + "\n"

