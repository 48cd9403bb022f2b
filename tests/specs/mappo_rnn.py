"""mappo_rnn.py's spec (tests/specs/__init__.py): ippo_rnn.py's runs, with a recurrent centralised critic."""

import dataclasses

from specs import ippo_rnn

SPEC = dataclasses.replace(
    ippo_rnn.SPEC,
    built_from="ippo_rnn",
    # An eighth of the default's steps (CI's budget): 4 seeds ended at -22.4 to -20.8, greedy -23.2 to -21.2 (this
    # host); at ippo_rnn.py's 249,856, -21.2 to -19.9. A uniformly random policy returns about -27.5 per agent.
    learning_flags=("--total-timesteps", "122880"),
    target=-24.0,
    greedy_target=-25.0,
    first_kernel="actor/params/embedding/kernel",
)
