"""The speed benchmarks (fairseq-rope-benchmark-speed, -benchmark-ct2, -benchmark-serve,
-ablate-rotation) and the timing libraries they share (speed_measures.py, engine_timings.py)."""
