"""`pacerl plot`: the PNGs of a run, drawn from a synthetic metrics.jsonl written by the real writer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.image import imread

from pacerl import plots
from pacerl.cli import build_parser
from pacerl.trainer import metrics as trainer_metrics
from pacerl.trainer.metrics import MetricsWriter

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NAMES = ["reward.png", "staleness.png", "pool.png", "sat.png"]


def _write_run(run_dir: Path, steps: int = 30) -> None:
    """An async PACE run as `Run.record` logs it: every fifth step skipped (no loss keys), a rejection
    reason that first appears at step 10, a non-finite grad norm, and an evaluation row every 10 steps."""
    rng = np.random.default_rng(0)
    (run_dir / "config.json").parent.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(
        json.dumps({"filter": {"name": "pace", "pace": {"target_groups": 4}}})
    )
    with MetricsWriter(run_dir, tensorboard=False) as writer:
        version = 0
        for step in range(1, steps + 1):
            skipped = step % 5 == 0
            version += 0 if skipped else 1
            reward = min(1.0, step / steps + 0.1 * rng.standard_normal())
            gs_hist = rng.integers(0, 50, size=9)
            ws_hist = rng.integers(0, 50, size=9)
            row: dict[str, float] = {
                "reward": reward,
                "accuracy": reward / 2,
                "version": float(version),
                "updated": 0.0 if skipped else 1.0,
                "pool_groups": float(step % 6),
                "in_flight_groups": 4.0,
                "dropped_groups": float(step // 12),
                "elapsed_s": 0.5 * step,
                "staleness/mean_gs": float(rng.uniform(0, 1)),
                "staleness/mean_ws": float(rng.uniform(0, 2)),
                "staleness/mean_staleness": 1.5,
                "staleness/max_staleness": 3.0,
                **{f"staleness/gs_hist_{k}": float(c) for k, c in enumerate(gs_hist)},
                **{f"staleness/ws_hist_{k}": float(c) for k, c in enumerate(ws_hist)},
                "skipped/zero_advantage": float(step),
            }
            if step >= 10:
                row["rejected/pace_budget"] = float((step - 8) // 3)
            if not skipped:
                row.update(
                    loss=0.1,
                    entropy=0.6,
                    grad_norm=math.nan if step == 7 else 1.0,
                    clip_fraction=0.05,
                    sat_gate_rate=0.125,
                    sat_contraction=0.9,
                    mismatch=0.1,
                    mismatch_fresh=0.001,
                    routing_disagreement=0.2,
                )
            writer.write(step, row)
            if step % 10 == 0:
                writer.write(step, {"eval/accuracy": 0.3 + step / 100, "eval/version": float(version)})


def _check_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 200, image.shape
    # Not a blank canvas: a real share of the pixels differ from the background (the corner's colour).
    drawn = (image != image[0, 0]).any(axis=-1).mean()
    assert drawn > 0.02, f"{path.name}: only {drawn:.1%} of its pixels are drawn"


@pytest.mark.slow
def test_plot_command_writes_the_four_pngs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    _write_run(run_dir)
    args = build_parser().parse_args(["plot", str(run_dir)])

    assert args.handler(args) == 0

    expected = [run_dir / "plots" / name for name in NAMES]
    assert capsys.readouterr().out.split() == [str(path) for path in expected]
    for path in expected:
        _check_png(path)
    assert sorted(p.name for p in (run_dir / "plots").iterdir()) == sorted(NAMES)  # no partial files left


def test_missing_keys_say_not_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        for step in range(1, 4):
            writer.write(step, {"reward": 0.1 * step})
    drawn: dict[str, Figure] = {}
    save = plots.save_png

    def keep(figure: Figure, path: Path) -> Path:
        drawn[path.name] = figure
        return save(figure, path)

    monkeypatch.setattr(plots, "save_png", keep)

    paths = plots.plot_run(tmp_path)

    assert [path.name for path in paths] == NAMES
    for path in paths:
        _check_png(path)
    texts = {name: [t.get_text() for ax in fig.axes for t in ax.texts] for name, fig in drawn.items()}
    assert texts["reward.png"] == ["not recorded: accuracy", "not recorded: eval/*"]
    assert "not recorded: staleness/mean_gs, staleness/mean_ws" in texts["staleness.png"]
    assert "not recorded: rejected/<reason>" in texts["pool.png"]
    assert len(texts["sat.png"]) == 4


def test_a_directory_without_metrics_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"has no metrics\.jsonl; is it a run directory\?"):
        plots.plot_run(tmp_path)
    assert not (tmp_path / "plots").exists()


def test_load_merges_rows_by_step_and_skips_a_partial_last_line(tmp_path: Path) -> None:
    rows = [
        {"step": 1, "reward": 0.5, "loss": 1.0},
        {"step": 2, "reward": None, "nonfinite": ["reward"]},
        {"step": 2, "eval/accuracy": 0.25},
    ]
    text = "".join(json.dumps(row) + "\n" for row in rows) + '{"step": 3, "rew'
    (tmp_path / plots.METRICS_FILE).write_text(text)

    metrics = plots.load_run_metrics(tmp_path)

    assert metrics.steps.tolist() == [1, 2]
    np.testing.assert_array_equal(metrics.column("reward"), [0.5, np.nan])
    np.testing.assert_array_equal(metrics.column("loss"), [1.0, np.nan])  # a skipped step: absent, not 0
    np.testing.assert_array_equal(metrics.column("eval/accuracy"), [np.nan, 0.25])
    assert not metrics.has("nonfinite")
    assert not metrics.has("kl")
    assert np.isnan(metrics.column("kl")).all()


def test_load_names_a_broken_line(tmp_path: Path) -> None:
    (tmp_path / plots.METRICS_FILE).write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not JSON"):
        plots.load_run_metrics(tmp_path)
    (tmp_path / plots.METRICS_FILE).write_text('{"reward": 1.0}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:1: not a metrics row"):
        plots.load_run_metrics(tmp_path)
    (tmp_path / plots.METRICS_FILE).write_text("")
    with pytest.raises(ValueError, match="has no rows yet"):
        plots.load_run_metrics(tmp_path)


def test_smooth_is_a_trailing_mean_that_skips_nans() -> None:
    # window 2: [1], [1, 2], [2, nan], [nan, 4], [4, 6]
    np.testing.assert_allclose(plots.smooth([1.0, 2.0, np.nan, 4.0, 6.0], 2), [1.0, 1.5, 2.0, 4.0, 5.0])
    # window 3 over [nan, nan, 3, 9]: nothing finite, nothing, [3], [3, 9]
    np.testing.assert_array_equal(plots.smooth([np.nan, np.nan, 3.0, 9.0], 3), [np.nan, np.nan, 3.0, 6.0])
    np.testing.assert_array_equal(plots.smooth([2.0, 4.0], 1), [2.0, 4.0])
    with pytest.raises(ValueError, match="window"):
        plots.smooth([1.0], 0)
    assert [plots.smoothing_window(n) for n in (1, 30, 45, 200)] == [3, 3, 4, 20]


def test_metrics_file_name_matches_the_writer() -> None:
    assert plots.METRICS_FILE == trainer_metrics.METRICS_FILE
