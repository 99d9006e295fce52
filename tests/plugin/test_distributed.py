"""Two CPU ranks train transformer_rope together (gloo, fairseq's legacy DDP)."""

import socket
import subprocess
import sys

import pytest
import torch
from support.commands import REPO, SCRIPTS

pytestmark = pytest.mark.e2e



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_cpu_ranks_train_in_sync(tiny_data_bin, tmp_path):
    port = free_port()
    procs = []
    for rank in (0, 1):
        cmd = [
            sys.executable, str(SCRIPTS / "ddp_worker.py"), str(tmp_path / f"rank{rank}.pt"),
            str(tiny_data_bin / "data-bin"), "--user-dir", "fairseq_rope",
            "--arch", "transformer_rope_tiny", "--task", "translation",
            "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "800", "--max-update", "6",
            "--save-dir", str(tmp_path / "ckpt"), "--no-save", "--seed", "1",
            "--cpu", "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp",
            "--distributed-world-size", "2", "--distributed-rank", str(rank), "--device-id", str(rank),
            "--distributed-no-spawn", "--distributed-init-method", f"tcp://127.0.0.1:{port}",
            "--num-workers", "0", "--log-format", "simple",
        ]
        log = open(tmp_path / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"}), log))
    for proc, log in procs:
        proc.wait(timeout=600)
        log.close()
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in (0, 1)]
    for proc_log, text in zip(procs, logs):
        assert proc_log[0].returncode == 0, text[-3000:]
    assert "distributed init (rank 0)" in logs[0] and "training on 2 devices" in logs[0]
    states = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert [s["world_size"] for s in states] == [2, 2]
    assert [s["rank"] for s in states] == [0, 1]
    assert states[0]["num_updates"] == states[1]["num_updates"] == 6
    p0, p1 = states[0]["params"], states[1]["params"]
    assert p0.keys() == p1.keys()
    for key in p0:
        assert torch.equal(p0[key], p1[key]), key
