"""ppo_rnn.py's spec (tests/specs/__init__.py)."""

import numpy as np

from specs import SMALL_SEEDS, SOLVED, Spec, cli_flags


def memoryless_ppo_stays_below(bound: float):
    """Learning checks of a memory file (ppo_rnn.py, ppo_trxl.py): memory is what works. ppo.py's MLP (its own
    defaults), fed the same observations with the same seeds for the same number of steps, ends below `bound`
    on every seed."""

    def learning_checks(module, config, metrics, greedy, tmp_path):
        from test_learning import command_line_run

        from conftest import load_algorithm
        from onefile_harness import stats

        module.validate(config)  # registers the file's memory envs with gymnax, where ppo.py finds them
        same_run = ["--env-name", config.env_name, "--total-timesteps", config.total_timesteps]
        mlp_metrics, _ = command_line_run(
            load_algorithm("ppo"), [*same_run, "--num-seeds", config.num_seeds], tmp_path / "mlp", own_process=False
        )
        mlp_finals = stats.final_returns(mlp_metrics)
        assert (mlp_finals < bound).all(), f"ppo.py final returns per seed without memory: {np.round(mlp_finals, 2)}"

    return learning_checks


SPEC = Spec(
    # 4 envs of CartPole without velocities, 2 minibatches of 2 whole env sequences.
    train_config=dict(
        env_name="CartPole-v1-no-velocity",
        num_envs=4,
        num_steps=16,
        total_timesteps=4 * 16 * 6,
        num_minibatches=2,
        update_epochs=2,
        num_seeds=1,
        hidden_size=16,
    ),
    train_updates=6,
    other_lr=1e-3,
    metrics={"policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction"},
    small=cli_flags(total_timesteps=2048, num_envs=4, num_steps=32, num_seeds=SMALL_SEEDS),
    steps_per_update=128,
    bad_inputs={
        "minibatches-do-not-divide-envs": (["--num-envs", "4", "--num-minibatches", "3"], "--num-minibatches"),
        "negative-num-layers": (["--num-layers", "-1"], "--num-layers"),
    },
    # CartPole-v1 observing only cart position and pole angle: the velocities must be remembered.
    target=SOLVED,
    reach=3,  # 24 of 24 seeds reached it here (benchmarks/results/seeds_cpu.md)
    learning_checks=memoryless_ppo_stays_below(200.0),  # velocity-hidden CartPole
    env="CartPole-v1-no-velocity",
    obs_dim=2,
    first_kernel="input_gates/kernel",
)
