"""Multi-token-prediction layers under tensor/expert parallelism (compiler/parallel/plan.py shards
the MTP blocks as the stack's): DeepSeek-V3's tiny twin with its MTP layer on 2 gloo ranks
(tp=2, ep=2, eager) gives one process's main and MTP logits, so the MTP drafter (which runs its
steps on every rank: zoo/serve/parallel.py) can serve under torchrun."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_logits_close

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = ["checkpoint.mtp=true"]

WORKER = r"""
import sys, torch, torch.distributed as dist, zoo
from zoo.compiler.parallel.mesh import shutdown

path, rank, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
m = zoo.from_pretrained(path, compile=False, max_batch=2, max_seq=32,
                        overrides=["checkpoint.mtp=true", "runtime.parallel.tp=2", "runtime.parallel.ep=2"])
ids = torch.tensor(eval(sys.argv[5]))
if rank == 0:
    torch.save(m.prefill(ids, return_mtp=True), out)
else:
    m.prefill(ids, return_mtp=True)
shutdown()
"""


def test_mtp_layers_under_two_ranks_equal_one_process(tmp_path):
    import zoo
    from tests.deepseek_v3_fixtures import add_shard, make_mtp_layer, mtp_hub_tensors
    from tests.serve_fixtures import free_port
    from tests.test_deepseek_v3 import make_reference

    path = tmp_path / "v3"
    ref = make_reference(path, {}, {"max_shard_size": "150KB"})
    block, extra = make_mtp_layer(ref.config)
    add_shard(path, "model-mtp.safetensors", mtp_hub_tensors(block, extra, ref.config.num_hidden_layers))
    ids = torch.randint(0, ref.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    port, out = free_port(), tmp_path / "rank0.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(path), str(rank), str(port), str(out),
                               str(ids.tolist())], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        m = zoo.from_pretrained(str(path), compile=False, max_batch=2, max_seq=32, overrides=OVERRIDES)
        want, (want_mtp,) = m.prefill(ids, return_mtp=True)
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, stderr) in zip(procs, results):
        assert p.returncode == 0, stderr[-3000:]
    got, (got_mtp,) = torch.load(out)
    assert_logits_close(got, want, 1e-4, "main logits, 2 ranks")
    assert_logits_close(got_mtp, want_mtp, 1e-4, "mtp logits, 2 ranks")
