"""The policy objectives of ppo.py and ppo_continuous.py (--objective ppo|dpo) against the papers'
formulas, written out in NumPy one sample at a time."""

import dataclasses
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import command_line, load_algorithm


def reference(objective: str, ratio: float, advantage: float, clip_eps=0.2, alpha=2.0, beta=0.6) -> float:
    """PPO (Schulman et al. 2017, eq. 7) and DPO (Lu et al. 2022, the discovered drift), as losses."""
    if objective == "ppo":
        return -min(ratio * advantage, min(max(ratio, 1 - clip_eps), 1 + clip_eps) * advantage)
    if advantage >= 0:
        x = (ratio - 1) * advantage
        drift = max(0.0, x - alpha * math.tanh(x / alpha))
    else:
        x = math.log(ratio) * advantage
        drift = max(0.0, x - beta * math.tanh(x / beta))
    return -(ratio * advantage - drift)


RATIOS = np.array([0.05, 0.5, 0.8, 0.95, 1.0, 1.05, 1.3, 2.0, 4.0, 12.0], np.float32)
ADVANTAGES = np.array([-3.0, -1.0, -0.2, 0.0, 0.3, 1.0, 2.5], np.float32)


@pytest.mark.parametrize("objective", ["ppo", "dpo"])
@pytest.mark.parametrize("alpha, beta", [(2.0, 0.6), (0.5, 1.5)])
def test_objective_matches_the_papers_formula(objective, alpha, beta):
    ppo = load_algorithm("ppo")
    config = ppo.Config(objective=objective, dpo_alpha=alpha, dpo_beta=beta)
    ratio, advantage = (x.ravel() for x in np.meshgrid(RATIOS, ADVANTAGES))
    got = np.asarray(
        jax.jit(lambda r, a: ppo.policy_objective(config, r, jnp.log(r), a, 0.2))(ratio, advantage), np.float64
    )
    want = [reference(objective, float(r), float(a), 0.2, alpha, beta) for r, a in zip(ratio, advantage, strict=True)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_dpo_drift_vanishes_near_ratio_one_and_grows_far_from_it():
    """At r = 1 both objectives are -A with gradient -A (the policy gradient); DPO's drift is
    nearly zero while (r - 1) A stays well below alpha, and grows once the policy has moved far."""
    ppo = load_algorithm("ppo")
    dpo = ppo.Config(objective="dpo")

    def loss(r, a):
        return ppo.policy_objective(dpo, r, jnp.log(r), a, 0.2)

    for a in (-1.0, 1.0):
        assert float(loss(1.0, a)) == pytest.approx(-a)
        assert float(jax.grad(loss)(1.0, a)) == pytest.approx(-a)
    assert float(loss(1.05, 1.0)) == pytest.approx(-1.05, abs=1e-4)  # drift ~ x^3 / (3 alpha^2)
    assert float(loss(4.0, 1.0)) > -4.0 + 0.5  # a large move pays back most of its gain


def test_both_ppo_files_use_the_same_objective():
    sources = {name: inspect.getsource(load_algorithm(name).policy_objective) for name in ("ppo", "ppo_continuous")}
    assert sources["ppo"] == sources["ppo_continuous"]


@pytest.mark.parametrize(
    "argv, option", [(["--objective", "trpo"], "--objective"), (["--dpo-alpha", "0"], "--dpo-alpha")]
)
def test_bad_objective_exits_2(argv, option, capsys):
    assert command_line(load_algorithm("ppo"), [*argv, "--runs-dir", "/tmp/never-written"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and option in err[0]


def test_dpo_trains_and_differs_from_ppo(ppo):
    config = ppo.Config(num_envs=4, num_steps=16, total_timesteps=4 * 16 * 4, num_minibatches=2, update_epochs=2)
    key = jax.random.PRNGKey(0)
    _, dpo_metrics = jax.device_get(jax.jit(ppo.make_train(dataclasses.replace(config, objective="dpo")))(key))
    assert dpo_metrics["finite"].all()
    _, ppo_metrics = jax.device_get(jax.jit(ppo.make_train(config))(key))
    assert not np.allclose(dpo_metrics["policy_loss"], ppo_metrics["policy_loss"])
