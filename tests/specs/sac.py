"""sac.py's spec (tests/specs/__init__.py), whose runs and checks td3.py's share."""

import numpy as np

from specs import SMALL_SEEDS, Spec, cli_flags


def learning_checks(module, config, metrics, greedy, tmp_path):
    """sac.py and td3.py: every gradient step the schedule promises was taken (the greedy policy, the squashed
    mean or the actor without noise, is held to the target by the spec's greedy_target)."""
    np.testing.assert_array_equal(metrics["gradient_steps"].sum(-1), module.total_gradient_steps(config))


SPEC = Spec(
    # Pendulum: every episode ends at the last step, all 4 envs together (so the mean return divides
    # by 4, exact however XLA computes x / n). 4 envs and a train interval of 3 divide neither way:
    # rounds of gradient steps fall between vectorized steps, some of which owe two; learning starts
    # inside the first update.
    train_config=dict(
        env_name="Pendulum-v1",
        num_envs=4,
        num_steps=50,
        total_timesteps=4 * 50 * 4,
        buffer_size=800,
        batch_size=16,
        learning_starts=100,
        train_frequency=3,
        hidden_size=16,
        num_seeds=1,
    ),
    train_updates=4,
    other_lr=3e-3,
    metrics={"actor_loss", "q_mean", "entropy", "alpha", "gradient_steps"},
    small=cli_flags(total_timesteps=800, num_envs=4, num_steps=50, num_seeds=SMALL_SEEDS)
    + cli_flags(buffer_size=800, batch_size=32, learning_starts=200, hidden_size=32, eval_episodes=4),
    steps_per_update=200,
    bad_inputs={
        "buffer-smaller-than-num-envs": (["--num-envs", "16", "--buffer-size", "8"], "--buffer-size"),
        # 2e9 slots of 33 B (Pendulum) for 8 seeds: 528 GB; refused before allocating, naming the size.
        "buffer-beyond-memory": (["--buffer-size", "2000000000"], "528 GB"),
        "negative-alpha": (["--alpha", "-0.1"], "--alpha"),
        "log-std-bounds-reversed": (["--log-std-min", "3"], "--log-std-min"),
        "zero-gradient-steps": (["--gradient-steps", "0"], "--gradient-steps"),
        "unknown-activation": (["--activation", "gelu"], "--activation"),
        "sweep-tau-zero": (["--sweep", "tau=0.5,0"], "tau"),
    },
    target=-200.0,
    reach=3,  # 24 of 24 seeds reached it here (benchmarks/results/seeds_cpu.md)
    greedy_target=-200.0,
    learning_checks=learning_checks,
    diverge=("--lr", "1e30"),
    wrong_action_env="CartPole-v1",
    env="Pendulum-v1",
    obs_dim=3,
    return_range=(-3300, 0),  # Pendulum pays at most pi^2 + 0.1 * 8^2 + 0.001 * 2^2 = 16.27 a step, 200 steps
    first_kernel="actor/params/Dense_0/kernel",  # the critics' first layer reads obs and action
    tolerance=(2e-3, 1e-3),  # as ppo_continuous: Pendulum amplifies rounding differences
    # sac.py's 200 Pendulum steps per env amplify that rounding far more than test_train's RTOL, ATOL allow: its
    # batched and single runs agree bit for bit under the command line's XLA code but differ by up to 6e-5 in
    # Adam's moments under the tests' (conftest.TEST_XLA_FLAGS); on an AVX-512 AMD EPYC a sweep point and its
    # run differed by 5e-5 in an actor weight. test_train's checks take the command line's tolerance.
    train_tolerance=(2e-3, 1e-3),
)
