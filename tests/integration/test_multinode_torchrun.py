"""Two "nodes" on localhost under torchrun (static rendezvous, two launches) train one DDP run."""

import json
import math
import os
import subprocess
import sys

import pytest

from lightning_parallel.runtime.ports import free_port

pytestmark = pytest.mark.slow

TINY = ["model=gpt_tiny", "trainer=cpu_test", "data.seq_len=32", "data.batch_size=4", "data.max_bytes=200000"]


# torchrun starts 4 new interpreters (2 "nodes" x 2) that import everything one after another: 90-290 s on 2 cores.
# With -m extended (the suite's time budget); lp-train under torchrun on one node stays in the default run
# (tests/integration/test_restart_after_lost_rank.py).
@pytest.mark.extended
def test_two_nodes_on_localhost_train_one_run(tmp_path):
    port, run_dir = free_port(), tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    nodes = []
    for node_rank in (0, 1):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
            f"--node-rank={node_rank}", "--master-addr=127.0.0.1", f"--master-port={port}",
            "-m", "lightning_parallel.cli.train", *TINY, "strategy=ddp", "trainer.num_nodes=2", "trainer.devices=1",
            f"hydra.run.dir={run_dir}",
        ]  # fmt: skip
        nodes.append(subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=300)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node_rank, (node, out) in enumerate(zip(nodes, outputs, strict=True)):
        assert node.returncode == 0, f"node {node_rank}:\n{out[-4000:]}"
    # One run of world size 2 across the two launches: each launch holds one global rank.
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in outputs[0] and "GLOBAL_RANK: 1, MEMBER: 2/2" in outputs[1]
    assert "2 (2 node(s) x 1 cpu process(es))" in outputs[0]
    result = json.loads((run_dir / "metrics.json").read_text())
    assert (result["world_size"], result["num_nodes"], result["layout"]) == (2, 2, "dp2 x pp1 x tp1")
    assert result["effective"]["global_batch_size"] == 8  # 4 per device x 2 nodes
    metrics = result["metrics"]
    # below a uniform guess: it trained
    assert math.isfinite(metrics["val_loss"]) and metrics["val_loss"] < math.log(256)
    assert list((run_dir / "checkpoints").glob("last*.ckpt"))
