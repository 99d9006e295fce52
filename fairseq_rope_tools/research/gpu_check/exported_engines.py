"""fairseq-rope-gpu-check, section 7: the RoPE model exported by fairseq-rope-export for each
engine of --engines (CTranslate2, ONNX Runtime: deploy/engines.py's registry) and decoded on the
device by fairseq-rope-translate's engine, through fairseq-rope-benchmark-ct2's worker, against
fairseq-generate's hypotheses."""

from fairseq_rope_tools.deploy import engines
from fairseq_rope_tools.research.benchmarks import engine_timings

#: per engine and device: what it computes in (compute type, weights exported as, the fairseq
#: precision it is compared with)
COMPUTE = {engines.CTRANSLATE2.name: engine_timings.CT2_CONFIGS,
           engines.ONNX.name: {"cpu": (("float32", "none", "fp32"),)}}


def exported_engine_section(engine, training, data_bin, work_dir, device, sizes, threads, decodes):
    """One engine's rows: per compute type the lines identical to fairseq-generate's and the speed-up."""
    problem = engine_timings.device_problem(device)  # a CTranslate2 wheel without CUDA, a GPU without float16, ...
    if problem:
        raise RuntimeError(problem)
    configs = COMPUTE[engine][device]
    export_format = engines.engine_named(engine).export_format
    checkpoint = training["runs"]["rope fp32"]["checkpoint"]
    models = {q: engine_timings.exported_model_dir(checkpoint, data_bin, work_dir / "ct2", q, export_format)
              for q in dict.fromkeys(q for _, q, _ in configs)}
    rows = []
    for compute_type, quantization, precision in configs:
        fairseq_seconds, sources, reference = decodes["rope", precision]
        ids = sorted(sources)
        seconds, hyps = engine_timings.engine_translate(engine, models[quantization], compute_type, None, threads,
                                                        [sources[i] for i in ids], device, sizes.max_len)
        rows.append({"compute_type": compute_type, "weights": "float32" if quantization == "none" else quantization,
                     "compared_with": f"fairseq-generate {precision}", "sentences": len(ids),
                     "identical": engine_timings.identical_count(hyps, [reference[i] for i in ids]),
                     # fairseq forces and scores </s> after the last token there, the engines stop: may differ
                     "fairseq_at_length_limit": sum(len(reference[i]) >= sizes.max_len for i in ids),
                     "sentences_per_second": round(len(ids) / seconds, 1),
                     "speedup": round(fairseq_seconds / seconds, 2)})
    float32 = next(r for r in rows if r["compute_type"] == "float32")
    return {"device": device, "rows": rows, "float32_identical_verdict": float32["identical"] == float32["sentences"]}
