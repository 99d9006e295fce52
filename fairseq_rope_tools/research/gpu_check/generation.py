"""fairseq-rope-gpu-check, sections 4 and 5: the fp32-trained models decode the test set with
fairseq-generate (fairseq-rope-benchmark-ct2's settings), and the RoPE / sinusoidal speed ratios."""

from fairseq_rope_tools.research.benchmarks import engine_timings
from fairseq_rope_tools.research.gpu_check.common import run_lanes
from fairseq_rope_tools.research.gpu_check.training import MODELS, PRECISIONS, REFERENCE_ROTATION_RUN


def generation_section(training, data_bin, device, sizes, threads, decodes):
    """Beam-4 decodes of the test set by each fp32-trained model, per precision of fairseq-generate;
    the hypotheses go into ``decodes`` {(model, precision): (seconds, sources, hypotheses)}."""
    jobs = {}
    for model in MODELS:
        checkpoint = training["runs"][f"{model} fp32"]["checkpoint"]
        for precision in engine_timings.FAIRSEQ_PRECISIONS[device]:
            jobs[(model, precision)] = (lambda checkpoint=checkpoint, precision=precision:
                                        engine_timings.fairseq_generate(checkpoint, data_bin, threads, device,
                                                                        precision, sizes.max_len))
    rows = {}
    for (model, precision), (seconds, sources, hyps, _) in run_lanes(jobs, sizes.lanes).items():
        decodes[model, precision] = seconds, sources, hyps
        rows[f"{model} {precision}"] = {"sentences": len(hyps), "seconds": round(seconds, 3),
                                        "sentences_per_second": round(len(hyps) / seconds, 1),
                                        "tokens_per_second": round(sum(map(len, hyps.values())) / seconds, 1)}
    return {"beam": engine_timings.BEAM, "lenpen": engine_timings.LENPEN, "max_len": sizes.max_len,
            "batch_size": engine_timings.BATCH, "runs": rows}


def speed_section(training, generation):
    """RoPE / sinusoidal ratios (above 1: RoPE is faster)."""
    def ratio(rows, key, suffix):
        rope, sinusoidal = rows.get(f"rope {suffix}", {}), rows.get(f"sinusoidal {suffix}", {})
        if key not in rope or key not in sinusoidal:
            return None
        return round(rope[key] / sinusoidal[key], 3)

    out = {}
    for precision in PRECISIONS:
        out[f"training {precision} words/s"] = ratio(training["runs"], "words_per_second", precision)
        out[f"training {precision} updates/s"] = ratio(training["runs"], "updates_per_second", precision)
    for precision in ("fp32", "fp16"):
        out[f"generation {precision} sentences/s"] = ratio(generation["runs"], "sentences_per_second", precision)
    fused, reference = training["runs"].get("rope fp16", {}), training["runs"].get(REFERENCE_ROTATION_RUN, {})
    kernel = {}
    if "words_per_second" in fused and "words_per_second" in reference:
        kernel["training fp16 words/s"] = round(fused["words_per_second"] / reference["words_per_second"], 3)
    return {"rope_over_sinusoidal": {k: v for k, v in out.items() if v is not None},
            "fused_over_reference_rotation": kernel}

