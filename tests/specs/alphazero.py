"""alphazero.py's spec (tests/specs/__init__.py): ppo.py's small runs, each action a search's."""

from specs import SMALL_SEEDS, SOLVED, Spec, cli_flags

SPEC = Spec(
    train_config=dict(
        num_envs=4,
        num_steps=16,
        total_timesteps=4 * 16 * 6,
        num_minibatches=2,
        update_epochs=2,
        num_seeds=1,
        num_simulations=4,
    ),
    train_updates=6,
    other_lr=1e-3,
    metrics={"policy_loss", "value_loss", "entropy"},
    small=cli_flags(total_timesteps=2048, num_envs=4, num_steps=32, num_seeds=SMALL_SEEDS),
    steps_per_update=128,
    bad_inputs={
        "minibatches-do-not-divide": (
            ["--num-envs", "4", "--num-steps", "32", "--num-minibatches", "3"],
            "--num-minibatches",
        ),
        "num-simulations-zero": (["--num-simulations", "0"], "--num-simulations"),
        "considered-actions-zero": (["--max-considered-actions", "0"], "--max-considered-actions"),
    },
    target=SOLVED,
    reach=3,
    built_from="ppo",
)
