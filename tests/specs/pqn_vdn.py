"""pqn_vdn.py's spec (tests/specs/__init__.py): pqn.py's small runs and bad inputs, on JaxMARL's MPE simple_spread."""

import dataclasses

from specs import ippo, pqn

SPEC = dataclasses.replace(
    pqn.SPEC,
    # pqn.py's small run, two updates longer (MPE's first episodes end at its 26th step, in the 7th update), at
    # pqn.py's defaults where test_train's sweep points move a value to this file's default.
    train_config={
        **pqn.SPEC.train_config,
        **dict(env_name=ippo.ENV, total_timesteps=8 * 4 * 8, gamma=0.99, q_lambda=0.65, reward_scale=0.1),
    },
    train_updates=8,
    bad_inputs={**pqn.SPEC.bad_inputs, "agents-unlike": ippo.SPEC.bad_inputs["agents-unlike"]},
    # A tenth of the default's steps (16 seeds here: -18.8 to -20.3); a uniformly random policy returns about -27.5.
    learning_flags=("--total-timesteps", "98304"),
    target=-23.0,
    reach=3,
    greedy_target=-24.0,
    **{field: getattr(ippo.SPEC, field) for field in ("multi_agent", "wrong_action_env", "env", "return_range")},
    obs_dim=ippo.SPEC.obs_dim + 3,  # the first layer reads an agent's observation and its one-hot id (3 agents)
    # Its Runner and HParams are pqn.py's (its multi-agent episodes go through ippo.py's runs): the fast loop and the
    # harness-only tests leave them to pqn.py (conftest.BUILT_FROM).
    built_from="pqn",
)
