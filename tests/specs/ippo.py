"""ippo.py's spec (tests/specs/__init__.py): ppo.py's small runs and bad inputs, on JaxMARL's MPE simple_spread."""

import dataclasses

from specs import ppo

ENV = "MPE_simple_spread_v3"
SPEC = dataclasses.replace(
    ppo.SPEC,
    train_config={**ppo.SPEC.train_config, "env_name": ENV},
    bad_inputs={
        **ppo.SPEC.bad_inputs,
        "agents-unlike": (["--env-name", "MPE_simple_speaker_listener_v4"], "--env-name"),
    },
    # An eighth of the default's steps; a uniformly random policy returns about -27.5 per agent (mappo.py: the same).
    learning_flags=("--total-timesteps", "249856"),
    target=-25.0,
    reach=3,
    greedy_target=-26.0,
    multi_agent=True,
    wrong_action_env="MPE_simple_facmac_3a_v1",
    env=ENV,
    obs_dim=18,
    return_range=(-200.0, 0.0),
)
