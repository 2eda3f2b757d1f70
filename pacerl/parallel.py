"""Starting the ranks of `learner.parallel = "fsdp"` on one machine.

`pacerl train learner.parallel=fsdp learner.world_size=N` starts ranks 1..N-1 itself (`python -m
pacerl.parallel`, torchrun's environment variables set on each) and stays rank 0, which runs the whole
run: engine, driver, pool and loop, with the learner a `pacerl.trainer.distributed.LearnerGroup`. Under
torchrun (`torchrun --nproc-per-node N -m pacerl train ...`, also across nodes) every process runs `pacerl
train`, and ranks > 0 turn into learner ranks (`serve_rank`) before anything else is built. Either way rank 0
sends the others the model (class, config and weights) and the learner's config, so their shards start
from rank 0's weights, the warm start included.
"""

from __future__ import annotations

import contextlib
import copy
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import torch

from pacerl.trainer.distributed import LearnerGroup, Ranks, join, receive, send, serve_learner
from pacerl.trainer.learner import Learner, LearnerConfig

INIT = "__init__"
PARENT_PID = "PACERL_PARENT_PID"
"""Set on the ranks `pacerl train` starts: each ends itself when that process is gone."""


def is_learner_rank() -> bool:
    """Whether this process is a rank > 0 of a torchrun launch (it serves the learner only)."""
    return int(os.environ.get("RANK", "0")) > 0


def start_learner(model: Any, config: LearnerConfig, *, pad_id: int, threads: int) -> LearnerGroup:
    """Rank 0's learner over `config.world_size` ranks: the ranks are started here unless torchrun did;
    `model` itself stays unsharded (the learner shards a copy; `LearnerGroup.weights` brings the trained
    weights back)."""
    children: list[subprocess.Popen[bytes]] = []
    if "RANK" not in os.environ:
        children = _start_ranks(config.world_size, threads)
    try:
        ranks = join()
        if ranks.size != config.world_size:
            raise ValueError(f"learner.world_size is {config.world_size} but {ranks.size} ranks joined")
        state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
        send(ranks, (INIT, (type(model), model.config, state, config, pad_id), {}))
        learner = Learner(copy.deepcopy(model), config, pad_id=pad_id, ranks=ranks)
    except BaseException:
        for child in children:
            child.kill()
        raise
    return LearnerGroup(learner, ranks, children)


def serve_rank() -> None:
    """A rank > 0: join the group, build the learner from what rank 0 sends, then run its calls."""
    _end_with_parent()
    ranks = join()
    serve_learner(lambda: _build(ranks), ranks)


def _build(ranks: Ranks) -> Learner:
    name, (model_class, model_config, state, config, pad_id), _ = receive(ranks)
    if name != INIT:
        raise RuntimeError(f"rank 0 sent {name!r} before the model")
    model = model_class(model_config)
    model.load_state_dict(state)
    return Learner(model.eval(), config, pad_id=pad_id, ranks=ranks)


def _start_ranks(world_size: int, threads: int) -> list[subprocess.Popen[bytes]]:
    """Ranks 1..world_size-1 as child processes; sets this process's torchrun variables as rank 0."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    common = {
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        PARENT_PID: str(os.getpid()),
        # The ranks share the machine's cores with rank 0's engine.
        "OMP_NUM_THREADS": str(max(1, threads // world_size)),
    }
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "pacerl.parallel"],
            env={**os.environ, **common, "RANK": str(rank), "LOCAL_RANK": str(rank)},
        )
        for rank in range(1, world_size)
    ]
    os.environ.update({**common, "RANK": "0", "LOCAL_RANK": "0"})
    del os.environ[PARENT_PID]
    return children


def _end_with_parent() -> None:
    """A rank `pacerl train` started exits when its parent is gone (killed: no stop call ever comes)."""
    parent = os.environ.get(PARENT_PID)
    if parent is None:
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C reaches every rank; rank 0 decides
        serve_rank()
