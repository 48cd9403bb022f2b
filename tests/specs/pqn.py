"""pqn.py's spec (tests/specs/__init__.py)."""

import numpy as np

from specs import SMALL_SEEDS, SOLVED, Spec, cli_flags


def learning_checks(pqn, config, metrics, greedy, tmp_path):
    # Training episodes are epsilon-greedy: they are scored at the configured final epsilon.
    np.testing.assert_allclose(metrics["epsilon"][:, -1], config.eps_end, rtol=1e-6)


SPEC = Spec(
    # 4-step rollouts: no CartPole episode ends within the first update, later ones do.
    train_config=dict(
        num_envs=8,
        num_steps=4,
        total_timesteps=8 * 4 * 6,
        num_minibatches=2,
        update_epochs=2,
        num_seeds=1,
        hidden_size=32,
        eps_start=0.9,
        eps_end=0.1,
        eps_fraction=0.5,
    ),
    train_updates=6,
    other_lr=3e-3,
    metrics={"q_mean", "epsilon"},
    small=cli_flags(total_timesteps=1024, num_envs=8, num_steps=16, num_minibatches=2, num_seeds=SMALL_SEEDS),
    steps_per_update=128,
    bad_inputs={
        "minibatches-do-not-divide": (
            ["--num-envs", "4", "--num-steps", "32", "--num-minibatches", "3"],
            "--num-minibatches",
        ),
        "epsilon-above-1": (["--eps-start", "1.5"], "--eps-start"),
        "lambda-below-0": (["--q-lambda", "-0.1"], "--q-lambda"),
        "zero-reward-scale": (["--reward-scale", "0"], "--reward-scale"),
        "sweep-epsilon-out-of-range": (["--sweep", "eps-end=0.1,2"], "--eps-end"),
        "sweep-ppo-only-field": (["--sweep", "gae-lambda=0.9"], "--sweep"),
    },
    target=SOLVED,
    reach=3,  # 24 of 24 seeds reached it here (benchmarks/results/seeds_cpu.md)
    learning_checks=learning_checks,
)
