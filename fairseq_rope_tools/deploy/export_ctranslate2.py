#!/usr/bin/env python3
"""Export a fairseq translation checkpoint to a CTranslate2 model directory (or, with --format onnx,
to ONNX graphs for the ONNX Runtime engine): a bundle that holds everything fairseq-rope-translate
needs.

    fairseq-rope-export --checkpoint checkpoints/avg_last5.pt \\
        --data-bin work/wmt14_en_de/data-bin --output-dir ct2/wmt14_en_de [--quantization int8]
    fairseq-rope-export --format onnx ... --output-dir onnx/wmt14_en_de

The bundle (fairseq_rope_tools.deploy.exported): the model, and, from the work directory
prepare.sh wrote (``--work-dir``, by default the data-bin's parent when prepare.sh wrote it), the
source segmentation -- subword-nmt ``bpe.codes`` and ``bpe.vocab.SRC`` with the vocabulary
threshold, or sentencepiece ``spm.model`` -- and ``bundle.json``: the languages, the
tokenisation and BPE settings, and the sha256 of every file, which fairseq-rope-translate
verifies before it loads anything. Without a work dir the bundle holds the model only (raw text
then needs fairseq-rope-translate --work-dir). The BPE must be the one the data-bin was binarized
with (as data-bin/.done records it).

Converts ``transformer_rope*`` checkpoints (either ``--rope-layout``, any ``--rope-fraction`` and
``--rope-theta``, and the ``--rope-scaling`` kinds CTranslate2 can compute: ``linear``, and ``yarn``
as CTranslate2's ``Su`` scaling with its logit temperature folded into the query and key
projections; see fairseq_rope_tools.deploy.ctranslate2_scaling) and stock fairseq ``transformer*``
checkpoints (sinusoidal or learned positions), so that both can be compared in the same engine. The
encoder and decoder specs are built directly: CTranslate2 rotates queries and keys in
self-attention by ``rotary_dim`` channels, pairing adjacent channels (``rotary_interleave``,
our ``interleaved``) or halves (our ``half``), with base ``rotary_base`` (``--rope-theta``); the
layer weights are copied with CTranslate2's own fairseq converter helpers. Decoding starts from
fairseq's ``</s>`` and appends ``</s>`` to each source, as fairseq does, so
``ctranslate2.Translator(OUT).translate_batch([tokens, ...])`` takes sources as the fairseq
dictionary's tokens, with nothing added by the caller.

``--length-buckets [S ...]`` writes, for inputs longer than in training, the plain model and one
static-yarn model per factor S (default 1.5 2 3 4) at the training length L the checkpoint recorded,
each an export of its own, into one directory with ``length_buckets.json``; fairseq-rope-translate
sends each sentence to the model of its length, as ``--rope-scaling dynamic-yarn`` would scale it.

``--format onnx`` writes the encoder (with every decoder layer's encoder-decoder keys and values)
and one decoding step as ONNX graphs, float32 (fairseq_rope_tools.deploy.onnx_graphs): every
model above and ``--rope-cross-attention`` models, which CTranslate2 cannot rotate; not RoPER,
linear attention, Shaw relative positions or the per-sentence scalings (all reasons said at once).

A model the engine cannot represent (rotary cross-attention, RoPER, linear attention, ntk or
the per-sentence scalings, Shaw relative positions, ...) is refused before anything is written, with one line
that names the flag; so is a checkpoint that cannot be loaded, or a data-bin whose dictionaries
do not fit its embeddings.

The output rule: the export replaces only what it wrote. ``--output-dir`` must be a new path;
with ``--force`` it may also be an empty directory or an earlier export, recognised by its
``export_info.json`` and ``model.bin`` (and no file an export does not write). Any other
directory, one that holds the checkpoint or the data-bin above all, is refused in one line and
left as it is. The model is written into a hidden directory beside the output
(``.NAME.XXXXXXXX.tmp``) that takes its place in one rename when complete, as every tool here
replaces a directory (``fairseq_rope_base.files.replace_directory``); the export it replaces is
deleted last, and what a killed export left is removed by the next one to the same name.

``export_info.json`` records the checkpoint the model came from: its real path, and the size and
sha256 of the bytes that were converted (hashed before and after loading; a checkpoint replaced
meanwhile is refused), which ``--if-changed`` compares; the model's ``max_source_positions``,
``max_target_positions`` and training length L; and the sha256 of the vocabularies written.
``--if-changed`` also exports again a directory without a bundle (older versions), one whose
files do not match its manifest, and one whose segmentation is not the work dir's. Of a --length-buckets
export, ``--if-changed`` also checks every bucket's own ``export_info.json`` against the manifest
(fairseq_rope_tools.deploy.exported.verified_bucket_manifest): a bucket of another checkpoint, or
at another factor or L, is exported again, never kept.
"""

import argparse
import os
import sys

from fairseq_rope.plugin_options import INFERENCE, PLUGIN_OPTIONS, options_with_role
from fairseq_rope_tools.cli import ArgumentParser, UserError, command
from fairseq_rope_tools.deploy.checkpoint_export import (
    DEFAULT_BUCKET_FACTORS,
    FORMATS,
    QUANTIZATIONS,
    check_bucket_factors,
    check_format,
    check_original_length,
    export,
    is_current,
)
from fairseq_rope_tools.deploy.exported import CTRANSLATE2_MODEL_FORMAT, read_bundle


@command
def main(argv=None):
    p = ArgumentParser(prog="fairseq-rope-export", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="fairseq checkpoint (.pt), e.g. an average of the last 5")
    p.add_argument("--data-bin", required=True, help="the fairseq data-bin the model was trained on (dictionaries)")
    p.add_argument("--work-dir",
                   help="the directory prepare.sh wrote for the model, whose segmentation (tok/ and bpe/ steps) the "
                        "export bundles (default: the data-bin's parent, when prepare.sh wrote it; else the export "
                        "holds the model only)")
    p.add_argument("--output-dir", required=True,
                   help="CTranslate2 model directory to write: a new path (or, with --force, an empty directory "
                        "or an earlier export)")
    p.add_argument("--format", choices=FORMATS, default=CTRANSLATE2_MODEL_FORMAT, dest="model_format",
                   help="ctranslate2 (default): a CTranslate2 model; onnx: the encoder and a decoding step as ONNX "
                        "graphs for --engine onnx, which also takes --rope-cross-attention models (docs/deploy.md)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                   help="weight type of the exported model (default: none, i.e. float32)")
    p.add_argument("--force", action="store_true",
                   help="replace --output-dir if it is an earlier export (export_info.json) or empty; any "
                        "other directory is refused")
    p.add_argument("--length-buckets", nargs="*", type=float, metavar="S",
                   help="export plain RoPE for sentences within the training length L and one static yarn model "
                        "per factor S for longer ones (default factors: "
                        f"{' '.join(f'{f:g}' for f in DEFAULT_BUCKET_FACTORS)}), into one directory with a manifest; "
                        "fairseq-rope-translate sends each sentence to the model of its length")
    p.add_argument("--if-changed", action="store_true",
                   help="do nothing when --output-dir already holds an export of this checkpoint (size and "
                        "sha256) with the same --quantization and scaling; otherwise export (with --force: over it)")
    # the plugin's inference options, as --model-overrides sets them at generate time
    rescaled = p.add_argument_group("decoding with rescaled frequencies (default: the checkpoint's)")
    inference_options = sorted(options_with_role(INFERENCE))
    for name in inference_options:
        rescaled.add_argument(PLUGIN_OPTIONS[name].flag, **PLUGIN_OPTIONS[name].argparse_kwargs(), default=None)
    args = p.parse_args(argv)
    overrides = {name: getattr(args, name) for name in inference_options if getattr(args, name) is not None}
    buckets = None
    if args.length_buckets is not None:
        buckets = check_bucket_factors(args.length_buckets or DEFAULT_BUCKET_FACTORS)
    check_original_length(overrides)
    check_format(args.model_format, args.quantization, buckets)
    if not os.path.isfile(args.checkpoint):
        raise UserError(f"--checkpoint {args.checkpoint} is not a file")
    if not os.path.isdir(args.data_bin):
        raise UserError(f"--data-bin {args.data_bin} is not a directory")
    if args.work_dir is not None and not os.path.isdir(args.work_dir):
        raise UserError(f"--work-dir {args.work_dir} is not a directory")
    if args.if_changed and is_current(args.output_dir, args.checkpoint, args.quantization, overrides, buckets,
                                      args.data_bin, args.work_dir, args.model_format):
        print(f"{args.output_dir} holds this checkpoint ({args.quantization}) already: nothing to do", file=sys.stderr)
        return
    out = export(args.checkpoint, args.data_bin, args.output_dir, args.quantization, args.force, overrides, buckets,
                 args.work_dir, args.model_format)
    kind = f", plain and yarn x{' x'.join(f'{f:g}' for f in buckets)}" if buckets else ""
    held = read_bundle(out)["segmentation"]
    what = args.quantization if args.model_format == CTRANSLATE2_MODEL_FORMAT else args.model_format
    print(f"wrote {out} ({what}{kind}): " + (
        f"a bundle with its segmentation ({held['bpe']})" if held else
        "the model only, no work dir of prepare.sh beside --data-bin: raw text will need fairseq-rope-translate "
        "--work-dir (or export with --work-dir)"), file=sys.stderr)


if __name__ == "__main__":
    main()
