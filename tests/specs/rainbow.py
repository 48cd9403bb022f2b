"""rainbow.py's spec (tests/specs/__init__.py): c51.py's runs, and the options rainbow.py adds."""

from specs import Spec, c51, dqn

SPEC = Spec(
    # c51.py's, with 2-step returns (windows cut at episode ends and at the newest write within the run).
    train_config=dict(**c51.SPEC.train_config, n_step=2),
    train_updates=5,
    other_lr=3e-4,
    metrics={"q_mean", "epsilon", "gradient_steps", "target_updates"},
    # c51.py's small run, and the options rainbow.py adds.
    small=c51.SPEC.small,
    steps_per_update=200,
    bad_inputs={
        "buffer-smaller-than-num-envs": (["--num-envs", "16", "--buffer-size", "8"], "--buffer-size"),
        "one-atom": (["--num-atoms", "1"], "--num-atoms"),
        "no-n-step": (["--n-step", "0"], "--n-step"),
        "alpha-above-one": (["--alpha", "1.5"], "--alpha"),
        "sweep-beta-negative": (["--sweep", "beta_start=0.4,-1"], "beta_start"),
        "priority-eps-zero": (["--priority-eps", "0"], "--priority-eps"),
    },
    # The default reached SOLVED on 23 of 24 seeds (results/seeds_cpu.md); its test learns Catch (specs/dqn.py).
    learning_flags=dqn.catch_run(60_000),
    target=dqn.CATCH_TARGET,
    reach=3,
    greedy_target=dqn.CATCH_GREEDY_TARGET,  # the greedy policy (no exploration) as well
    learning_checks=dqn.learning_checks,
    built_from="c51",
    first_kernel="NoisyDense_0/kernel",
)
