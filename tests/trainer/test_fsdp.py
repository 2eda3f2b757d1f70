"""The FSDP2 learner on two CPU ranks (gloo) equals the single-process learner on the same batch: the
loss, the global gradient (each parameter, gathered from its shards), the clipped gradient norm and the
updated weights, for the default loss (GSPO with SAT and R3), a token-mean loss with KL to a sharded
reference and an entropy bonus over two updates, and decoupled PPO (whose proximal pass is shared out);
checkpoints written with torch.distributed.checkpoint reshard: saved with 2 ranks they resume with 1 and
with 2, saved with 1 they resume with 2, and the next update is the uninterrupted run's."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from pacerl.agents.trajectory import RoutedExperts, Status, Trajectory
from pacerl.trainer.distributed import Ranks, join
from pacerl.trainer.learner import Learner, LearnerConfig
from pacerl.trainer.policy_losses import DecoupledPPOSettings, GRPOSettings, LossConfig
from tests.helpers import free_port
from tests.trainer.helpers import ragged_groups_of_small_model, small_model

WORLD = 2
FSDP = {"parallel": "fsdp", "world_size": WORLD}
CASES: dict[str, dict[str, Any]] = {
    # 24 sequences in micro-batches of 8: three, so rank 1 also runs one of its own with weight 0.
    "default": {"micro_batch_size": 8},
    "grpo_token_kl": {
        "loss": LossConfig(
            name="grpo", grpo=GRPOSettings(aggregation="token"), kl_coef=0.05, entropy_coef=0.01
        ),
        "micro_batch_size": 4,
        "minibatches": 2,
    },
    "decoupled_ppo": {
        "loss": LossConfig(name="decoupled_ppo", decoupled_ppo=DecoupledPPOSettings(aggregation="token")),
        "micro_batch_size": 5,
        "minibatches": 2,
    },
}
"""Learner settings per case (R3 and SAT on in all of them: the defaults)."""


def routed_groups() -> list[list[Trajectory]]:
    """The ragged groups of test_learner_updates (stale outliers for SAT to gate), each model token with
    recorded experts that differ from the live router's, so R3 changes the forward."""
    rng = np.random.default_rng(0)
    groups = []
    for group in ragged_groups_of_small_model(far=1.5):
        rebuilt = []
        for trajectory in group:
            model_segment = trajectory.segments[1]
            length = len(model_segment.tokens)
            routes = np.stack([[rng.permutation(8)[:2] for _ in range(2)] for _ in range(length)])
            copy_ = Trajectory.start(
                trajectory.id, trajectory.group_id, "task", trajectory.segments[0].tokens
            )
            copy_.append_model(
                list(model_segment.tokens),
                list(model_segment.logprobs or []),
                version=0,
                started_at=0.0,
                ended_at=0.0,
                finish_reason="stop",
                routed_experts=RoutedExperts.from_array(routes, num_experts=8),
            )
            copy_.finish(
                Status.COMPLETED, reason="", reward=trajectory.reward, completed_version=0, completed_at=0.0
            )
            rebuilt.append(copy_)
        groups.append(rebuilt)
    return groups


def learner_for(case: str, ranks: Ranks | None = None) -> Learner:
    """A learner on `small_model()` for `case`, sharded over `ranks` when given; its KL reference is moved
    away from the policy (the same way on every rank), so the KL term has a gradient."""
    settings = {**CASES[case], **(FSDP if ranks is not None else {})}
    model = small_model()
    reference = None
    if LossConfig().kl_coef != settings.get("loss", LossConfig()).kl_coef:
        reference = copy.deepcopy(model)
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for parameter in reference.parameters():
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    learner = Learner(model, LearnerConfig(**settings), ranks=ranks)
    if reference is not None:
        assert learner.reference is not None
        full = StateDictOptions(full_state_dict=True)  # every rank takes its shard of the whole
        set_model_state_dict(learner.reference, reference.state_dict(), options=full)
    return learner


def full_gradients(learner: Learner) -> dict[str, torch.Tensor]:
    """Each parameter's gradient, whole (a sharded one gathered from every rank)."""
    gradients = {}
    for name, parameter in learner.model.named_parameters():
        if parameter.grad is not None:
            grad = parameter.grad
            gradients[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad.clone()
    return gradients


def step_record(learner: Learner, groups: list[list[Trajectory]]) -> dict[str, Any]:
    result = learner.train_step(groups)
    assert result.updated, result.skipped
    return {
        "metrics": result.metrics,
        "gradients": full_gradients(learner),
        "weights": {name: tensor.clone() for name, tensor in learner.weights().items()},
    }


def rank_main(rank: int, port: int, out: str, groups: list[list[Trajectory]]) -> None:
    """One rank: every case's step, then the checkpoint round trips; rank 0 writes what it saw."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ranks = join("gloo")
    records: dict[str, Any] = {}
    for case in CASES:
        learner = learner_for(case, ranks)
        local = sum(p.to_local().numel() for p in learner.model.parameters())  # type: ignore[operator]
        records[case] = step_record(learner, groups)
        records[case]["local_numel"] = local
    # Resharding: this 2-rank learner saves after one step, then a fresh 2-rank learner loads it.
    learner = learner_for("default", ranks)
    learner.train_step(groups)
    learner.save(Path(out) / "saved-by-2")
    records["continued"] = step_record(learner, groups)
    reloaded = learner_for("default", ranks)
    reloaded.load(Path(out) / "saved-by-2")
    records["resumed-2-from-2"] = step_record(reloaded, groups)
    from_one = learner_for("default", ranks)
    from_one.load(Path(out) / "saved-by-1")
    records["resumed-2-from-1"] = step_record(from_one, groups)
    if rank == 0:
        torch.save(records, Path(out) / "records.pt")
    dist.destroy_process_group()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """What two ranks recorded (after one process saved the checkpoint they load from)."""
    out = tmp_path_factory.mktemp("fsdp")
    groups = routed_groups()
    single = learner_for("default")
    single.train_step(groups)
    single.save(out / "saved-by-1")
    mp.start_processes(rank_main, args=(free_port(), str(out), groups), nprocs=WORLD, start_method="spawn")
    records: dict[str, Any] = torch.load(out / "records.pt", weights_only=False)
    return records, out


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_take_the_single_process_step(sharded: tuple[dict[str, Any], Path], case: str) -> None:
    records, _ = sharded
    learner = learner_for(case)
    expected = step_record(learner, routed_groups())
    got = records[case]
    # Each rank held half the parameters (FSDP pads dim 0 up to a multiple of the ranks).
    total = sum(p.numel() for p in learner.model.parameters())
    assert total / WORLD <= got["local_numel"] < total / WORLD * 1.05
    for name in ("loss", "grad_norm", "entropy", "kl", "clip_fraction", "sat_gate_rate", "mismatch"):
        assert got["metrics"][name] == pytest.approx(expected["metrics"][name], rel=1e-5, abs=1e-7), name
    assert got["metrics"]["sat_gate_rate"] > 0  # SAT acted (the far outliers)
    assert got["metrics"]["r3_coverage"] == pytest.approx(expected["metrics"]["r3_coverage"], rel=1e-9)
    assert got["metrics"]["r3_coverage"] > 0  # the recorded experts were replayed
    assert got["metrics"]["grad_norm"] > LearnerConfig().grad_clip  # the global-norm clip acted
    if case == "grpo_token_kl":
        assert got["metrics"]["kl"] > 0
    assert got["gradients"].keys() == expected["gradients"].keys()
    for name, gradient in expected["gradients"].items():
        assert relative(got["gradients"][name], gradient) <= 1e-4, name
    for name, weight in expected["weights"].items():
        torch.testing.assert_close(got["weights"][name], weight, rtol=1e-5, atol=1e-6, msg=name)
    initial = small_model().state_dict()
    assert any(not torch.equal(weight, initial[name]) for name, weight in expected["weights"].items())


@pytest.mark.slow
def test_checkpoints_reshard_between_one_and_two_ranks(sharded: tuple[dict[str, Any], Path]) -> None:
    records, out = sharded
    groups = routed_groups()
    continued = records["continued"]["weights"]
    one = learner_for("default")
    one.load(out / "saved-by-2")  # saved by 2 ranks, resumed by 1
    assert one.version == 1
    resumed_by_one = step_record(one, groups)["weights"]
    uninterrupted = learner_for("default")
    uninterrupted.train_step(groups)
    expected_from_one = step_record(uninterrupted, groups)["weights"]
    for name, weight in continued.items():
        # The second update needs Adam's moments: wrong or missing optimizer state would show here.
        torch.testing.assert_close(resumed_by_one[name], weight, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(records["resumed-2-from-2"]["weights"][name], weight, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            records["resumed-2-from-1"]["weights"][name], expected_from_one[name], rtol=1e-5, atol=1e-6
        )
    first = learner_for("default")
    first.train_step(groups)
    assert any(not torch.equal(first.weights()[n], continued[n]) for n in continued)  # the step moved them


def gpu_rank_main(rank: int, port: int, out: str, groups: list[list[Trajectory]]) -> None:
    """One rank on its own GPU over NCCL (fp32, so the step is comparable with the CPU's)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["LOCAL_RANK"] = str(rank)
    ranks = join("nccl")
    model = small_model()
    config = LearnerConfig(**CASES["default"], parallel="fsdp", world_size=1, mixed_precision="fp32")
    learner = Learner(model, config, ranks=ranks)
    assert learner.device.type == "cuda"
    record = step_record(learner, groups)
    torch.save({"metrics": record["metrics"], "weights": record["weights"]}, Path(out) / "gpu.pt")
    dist.destroy_process_group()


@pytest.mark.gpu
def test_a_sharded_learner_on_a_gpu_takes_the_cpu_step(tmp_path: Path) -> None:
    """The device path: batches, advantages and SAT's threshold follow the shards onto the GPU (NCCL)."""
    assert torch.cuda.is_available(), "the GPU test of the FSDP learner needs a CUDA GPU"
    groups = routed_groups()
    mp.start_processes(
        gpu_rank_main, args=(free_port(), str(tmp_path), groups), nprocs=1, start_method="spawn"
    )
    got = torch.load(tmp_path / "gpu.pt", weights_only=False)
    expected = step_record(learner_for("default"), groups)
    assert got["metrics"]["loss"] == pytest.approx(expected["metrics"]["loss"], rel=1e-4, abs=1e-6)
    for name, weight in expected["weights"].items():
        torch.testing.assert_close(got["weights"][name].cpu(), weight, rtol=1e-4, atol=1e-5, msg=name)
