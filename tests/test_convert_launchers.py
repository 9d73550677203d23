"""The converter under a real launcher: every command its ``--help`` shows under torchrun, started as torchrun starts
it (one process per rank, RANK / WORLD_SIZE set, no process group yet), dense at TP 2 and mixture-of-experts at EP 2.

The other converter tests run the launcher path inside a process group the test made first; the real launcher gives
none, and the first collective (rank 0 sharing the output folder) found no group: every other rank got None and died
with "cannot unpack non-iterable NoneType object" (issue 54). Each conversion here must round-trip the HF weights bit
for bit and ``verify`` must pass on the converted checkpoint."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from hf_reference import REPO, TINY_QWEN2, TINY_QWEN3_MOE, assert_bit_identical, hf_model


def _torchrun(*args, tmp_path, timeout=300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    with socket.socket() as probe:  # a free port for the rendezvous (torchrun's 0 reaches the ranks as 0)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
               "-m", "checkpoints_convert", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _weights(directory) -> dict[str, torch.Tensor]:
    from megatron_dynamo.models.checkpoint_io import HFCheckpointReader

    reader = HFCheckpointReader(str(directory))
    return {name: reader.get(name) for name in reader.names()}


@pytest.mark.distributed  # two torchrun ranks a command: the slow tier
@pytest.mark.parametrize("config,flag", [(TINY_QWEN2, "--tp"), (TINY_QWEN3_MOE, "--ep")], ids=["dense-tp2", "moe-ep2"])
def test_every_conversion_command_runs_under_torchrun(config, flag, tmp_path):
    source = tmp_path / "hf"
    hf_model(config, seed=3).save_pretrained(source)
    to_megatron = _torchrun("hf-to-megatron", "--hf", source, "--out", tmp_path / "meg", flag, 2, tmp_path=tmp_path)
    assert to_megatron.returncode == 0, to_megatron.stderr[-3000:]
    assert "NoneType" not in to_megatron.stderr
    back = _torchrun("megatron-to-hf", "--megatron", tmp_path / "meg", "--out", tmp_path / "back", flag, 2,
                     tmp_path=tmp_path)
    assert back.returncode == 0, back.stderr[-3000:]
    assert_bit_identical(_weights(tmp_path / "back"), _weights(source), f"hf -> megatron -> hf at {flag} 2")
    verify = _torchrun("verify", "--hf", source, "--megatron", tmp_path / "meg", flag, 2, tmp_path=tmp_path)
    assert verify.returncode == 0, verify.stderr[-3000:]
    assert "PASS" in verify.stdout + verify.stderr
    # one report, from rank 0, not one per process
    assert (verify.stdout + verify.stderr).count(": PASS") == 1
