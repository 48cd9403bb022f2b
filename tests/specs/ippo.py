"""ippo.py's spec (tests/specs/__init__.py): the first multi-agent file, on JaxMARL's MPE simple_spread."""

from specs import SMALL_SEEDS, Spec, cli_flags

SPEC = Spec(
    train_config=dict(
        env_name="MPE_simple_spread_v3",
        num_envs=4,
        num_steps=16,
        total_timesteps=4 * 16 * 6,
        num_minibatches=2,
        update_epochs=2,
        num_seeds=1,
    ),
    train_updates=6,
    other_lr=1e-3,
    metrics={"policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction"},
    small=cli_flags(total_timesteps=2048, num_envs=4, num_steps=32, num_seeds=SMALL_SEEDS),
    steps_per_update=128,
    bad_inputs={
        "minibatches-do-not-divide": (
            ["--num-envs", "4", "--num-steps", "32", "--num-minibatches", "3"],
            "--num-minibatches",
        ),
        "agents-unlike": (["--env-name", "MPE_simple_speaker_listener_v4"], "--env-name"),
    },
    # An eighth of the default's steps; a uniformly random policy returns about -27.5 per agent (mappo.py: the same).
    learning_flags=("--total-timesteps", "249856"),
    target=-25.0,
    reach=3,
    greedy_target=-26.0,
    multi_agent=True,
    wrong_action_env="MPE_simple_facmac_3a_v1",
    env="MPE_simple_spread_v3",
    obs_dim=18,
    return_range=(-200.0, 0.0),
)
