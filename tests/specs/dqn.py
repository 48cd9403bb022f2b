"""dqn.py's spec (tests/specs/__init__.py), whose configs and checks the files made from it share."""

import numpy as np

from specs import SMALL_SEEDS, Spec, cli_flags


def learning_checks(dqn, config, metrics, greedy, tmp_path):
    np.testing.assert_array_equal(metrics["gradient_steps"].sum(-1), dqn.total_gradient_steps(config))


# dqn.py's learning test: the default command for half the default's steps, whose 300k would take a large share of
# CI's budget. The lowest of 16 seeds at 150k (docs/results.md) ended at 248 (greedy 224); at 150 (greedy 100), one miss
# of four allowed, a file that learns passes and one that does not (random play returns about 22) fails. The default's
# own counts over 24 seeds: benchmarks/results/seeds_cpu.md.
SHORT_RUN, SHORT_TARGET, SHORT_GREEDY_TARGET = cli_flags(total_timesteps=150_000), 150.0, 100.0


# The files made from dqn.py (c51.py, qr_dqn.py, iqn.py, rainbow.py) share its buffer and training loop, which its own
# learning test runs on CartPole above; theirs run the default Config on bsuite's Catch (9-step episodes, +1 for a
# caught ball, -1 for a missed one; random play about -0.6), which they learn in a fraction of CartPole's steps (CI's
# budget). Per-seed returns there, 4 seeds each of `--seed 0` and `1` (docs/results.md): 0.96 or more, every greedy 1.
def catch_run(total_timesteps: int) -> tuple:
    return cli_flags(env_name="Catch-bsuite", total_timesteps=total_timesteps)


CATCH_TARGET, CATCH_GREEDY_TARGET = 0.8, 0.8

SPEC = Spec(
    # dqn.py's (and c51.py's, qr_dqn.py's and iqn.py's): num_envs=3 divides neither interval, so gradient steps
    # and target updates fall between vectorized steps.
    train_config=dict(
        num_envs=3,
        num_steps=8,
        total_timesteps=3 * 8 * 5,
        buffer_size=50,
        batch_size=16,
        learning_starts=30,
        train_frequency=4,
        target_update_frequency=10,
        eps_fraction=0.5,
        num_seeds=1,
    ),
    train_updates=5,
    other_lr=1e-3,
    metrics={"q_mean", "epsilon", "gradient_steps", "target_updates"},
    # 2 seeds of 12 updates, gradient steps from update 3.
    small=cli_flags(total_timesteps=2400, num_envs=4, num_steps=50, num_seeds=SMALL_SEEDS)
    + cli_flags(buffer_size=1000, batch_size=32, learning_starts=400, train_frequency=4)
    + cli_flags(target_update_frequency=100, eval_episodes=4),
    steps_per_update=200,
    bad_inputs={
        "buffer-smaller-than-num-envs": (["--num-envs", "16", "--buffer-size", "8"], "--buffer-size"),
        # 2e9 slots of 41 B for 8 seeds: 656 GB; refused before allocating, naming the size.
        "buffer-beyond-memory": (["--buffer-size", "2000000000"], "656 GB"),
        "unknown-loss": (["--loss", "l1"], "--loss"),
        "sweep-tau-zero": (["--sweep", "tau=0.5,0"], "tau"),
    },
    # The default reached SOLVED on 24 of 24 seeds (benchmarks/results/seeds_cpu.md); the test runs half its steps.
    learning_flags=SHORT_RUN,
    target=SHORT_TARGET,
    reach=3,
    greedy_target=SHORT_GREEDY_TARGET,  # the greedy policy (no exploration) as well
    learning_checks=learning_checks,
)
