"""fairseq-rope-compare: position encodings compared under identical conditions (command.py is
the command; the layers below it: variants, runs, decoding, schedule, data, report)."""
