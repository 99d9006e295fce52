"""fairseq-rope-gpu-check: the command (command.py) and one module per section of its report."""
