"""--track tensorboard and --track wandb (offline): what they stream can be read back and equals
metrics.npz; --eval-only reproduces a run's greedy evaluation; --render draws one frame per step (gymnax's
envs, and JaxMARL's MPE for a multi-agent file).

TensorBoard event files are read with tensorboardX's own protobuf classes, and W&B's offline run
file with wandb's, through the record framing both use (checksum, length, type)."""

import json
import pathlib
import struct

import numpy as np
import pytest
from specs import SPECS

from conftest import load_algorithm, run_dir_of
from conftest import run_main as main_in_process
from onefile_harness import evaluation, protocol

SMALL = [*SPECS["ppo"].small, "--quiet"]  # 2 seeds, 16 updates


def run_main(argv, capsys):
    """ppo.py's command line in this process, which must succeed: (run directory, stdout)."""
    code, out, err = main_in_process(load_algorithm("ppo"), argv, capsys)
    assert code == 0, err
    return run_dir_of(out), out


def metrics_of(run_dir):
    with np.load(run_dir / "metrics.npz") as npz:
        return {k: npz[k] for k in npz.files}


def tensorboard_scalars(folder: pathlib.Path) -> dict:
    """{tag: {step: value}} from every event file: TFRecord framing (length, crc, data, crc)."""
    from tensorboardX.proto import event_pb2

    scalars = {}
    for path in folder.glob("events.out.tfevents.*"):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def wandb_history(path: pathlib.Path) -> list[dict]:
    """The history rows of a W&B run file: a 7-byte header, then LevelDB-style records
    (checksum, length, type) in 32 KiB blocks, each a wandb Record protobuf."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, pending, rows = path.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record.FromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return rows


def test_tensorboard_holds_every_update_of_every_seed(tmp_path, capsys):
    pytest.importorskip("tensorboardX")
    run_dir, _ = run_main([*SMALL, "--runs-dir", tmp_path, "--track", "tensorboard"], capsys)
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    metrics = metrics_of(run_dir)
    steps = metrics["env_steps"][0, 0]
    for seed in (0, 1):
        for name in ("loss", "entropy", "episodes_finished"):
            logged = scalars[f"{name}/seed{seed}"]
            assert sorted(logged) == list(steps)
            np.testing.assert_allclose([logged[s] for s in steps], metrics[name][0, seed], rtol=1e-6)
        returns = metrics["episode_return"][0, seed]  # NaN where no episode ended: not logged
        logged = scalars[f"episode_return/seed{seed}"]
        assert sorted(logged) == list(steps[np.isfinite(returns)])


def test_wandb_offline_holds_every_update_of_every_seed(tmp_path, capsys, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir, _ = run_main([*SMALL, "--runs-dir", tmp_path, "--track", "wandb"], capsys)
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/*.wandb")
    rows = wandb_history(run_file)
    metrics = metrics_of(run_dir)
    assert len(rows) == metrics["loss"].shape[-1]
    for row, loss in zip(rows, metrics["loss"][0, 1], strict=True):
        assert row["loss/seed1"] == pytest.approx(float(loss), rel=1e-6)


def test_eval_only_reproduces_the_evaluation(tmp_path, capsys):
    run_dir, _ = run_main([*SMALL, "--runs-dir", tmp_path], capsys)
    summary = json.loads((run_dir / "summary.json").read_text())
    run_main(["--eval-only", run_dir], capsys)
    evaluation = json.loads((run_dir / "evaluation.json").read_text())
    assert evaluation["points"][0]["eval_return_mean"] == summary["eval_return_mean"]


@pytest.mark.slow  # drawing CartPole through pygame and matplotlib takes ~0.2 s a frame
def test_render_writes_one_frame_per_step_of_the_episode(tmp_path, capsys):
    pytest.importorskip("pygame")
    from PIL import Image

    # One update of training: the greedy episodes are short (a trained policy's 500 frames would
    # take minutes to draw, and drawing is all this tests).
    run_dir, _ = run_main([*SMALL, "--total-timesteps", "128", "--runs-dir", tmp_path], capsys)
    _, out = run_main(["--eval-only", run_dir, "--render"], capsys)
    for seed in (0, 1):  # the episode's length, as the command line reported it
        length = int(next(line for line in out.splitlines() if line.startswith(f"seed{seed}.gif")).split()[1])
        with Image.open(run_dir / "episodes" / f"seed{seed}.gif") as gif:
            assert gif.n_frames == length
        assert 1 <= length <= 500


def test_render_refuses_what_gymnax_cannot_draw():
    algo = protocol.load(load_algorithm("ppo"))
    with pytest.raises(protocol.UsageError, match="cannot draw DeepSea-bsuite"):
        evaluation.drawable_env(algo, "DeepSea-bsuite")
    ippo = protocol.load(load_algorithm("ippo"))
    with pytest.raises(protocol.UsageError, match="MPE envs .*, not switch_riddle"):  # JaxMARL's, not an MPE env
        evaluation.drawable_env(ippo, "switch_riddle")


@pytest.mark.slow  # a small run and its evaluation compiled, then 26 frames drawn by matplotlib: ~25 s
def test_render_draws_a_multi_agent_files_mpe_episode(tmp_path, capsys):
    """ippo.py's --render: JaxMARL's MPEVisualizer draws one frame per step of MPE's 26-step greedy episode."""
    from PIL import Image

    ippo = load_algorithm("ippo")
    small = [*SPECS["ippo"].small, "--num-seeds", "1", "--quiet", "--runs-dir", str(tmp_path)]
    code, out, err = main_in_process(ippo, small, capsys)
    assert code == 0, err
    code, out, err = main_in_process(ippo, ["--eval-only", str(run_dir_of(out)), "--render"], capsys)
    assert code == 0 and "seed0.gif: 26 steps" in out, err
    with Image.open(run_dir_of(out) / "episodes" / "seed0.gif") as gif:
        assert gif.n_frames == 26
