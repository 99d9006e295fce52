"""The tools around the fairseq_rope plugin, one console command each (``fairseq-rope-*``):

* ``deploy``: export a checkpoint to CTranslate2, translate raw text with either engine;
* ``checkpoints``: average checkpoints, score BLEU;
* ``research``: the position-encoding comparison, significance, benchmarks, plots, gpu_check;
* ``data``: the corpus builders and the recipe's text steps.

Importing a tool loads only what it needs: this package and its ``files``, ``cli``,
``text_lines`` and ``training_log`` modules are standard library only, so that translating with
CTranslate2 and the recipe's text steps never load torch or fairseq.
"""
