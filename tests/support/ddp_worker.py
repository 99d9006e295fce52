"""Run `fairseq-train` unchanged, then dump this rank's parameters and world size.

Usage: python ddp_worker.py OUT.pt <fairseq-train arguments...>
Test instrumentation only: it records the Trainer fairseq builds so the test can compare the
parameters every rank ends with (fairseq saves checkpoints from rank 0 alone).
"""

import sys

import torch
import torch.distributed as dist
from fairseq import trainer as fairseq_trainer
from fairseq_cli import train

out_path = sys.argv.pop(1)
built = []
_original_init = fairseq_trainer.Trainer.__init__


def _recording_init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    built.append(self)


fairseq_trainer.Trainer.__init__ = _recording_init
train.cli_main()
(trainer,) = built
torch.save(
    {
        "world_size": dist.get_world_size(),
        "rank": dist.get_rank(),
        "num_updates": trainer.get_num_updates(),
        "params": {k: v.detach().cpu().clone() for k, v in trainer.model.state_dict().items()},
    },
    out_path,
)
