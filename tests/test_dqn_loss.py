"""dqn.py's Q-learning targets and loss (plain and double DQN, MSE and Huber) against a NumPy
reference on hand-made batches with terminations and time-limit truncations, and the Polyak
target update against its closed form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_algorithm, numpy_mlp


def bound_td_loss(module, config, network):
    """module.td_loss with the config and network bound, taking the Q-network's own parameters (not {"q": ...})."""
    networks = module.Networks(q=network)
    return lambda online, target, *rest: module.td_loss(config, networks, {"q": online}, {"q": target}, *rest)


@pytest.fixture(scope="module")
def dqn():
    return load_algorithm("dqn")


numpy_q = numpy_mlp  # the Q-network's forward pass in float64 NumPy


def reference_targets(online, target, batch, gamma, double):
    """One transition at a time: y = r + gamma * (1 - terminated) * Q_target(final_obs, a')."""
    ys = []
    for i in range(len(batch.reward)):
        next_target = numpy_q(target, batch.final_obs[i : i + 1])[0]
        chooser = numpy_q(online, batch.final_obs[i : i + 1])[0] if double else next_target
        bootstrap = 0.0 if batch.terminated[i] else next_target[int(np.argmax(chooser))]
        ys.append(float(batch.reward[i]) + gamma * bootstrap)
    return np.array(ys)


def hparams(dqn, config, gamma=0.99):
    """The config's HParams with `gamma`: what td_loss reads the discount from."""
    return dqn.hparams_from(dqn.dataclasses.replace(config, gamma=gamma))


KEY = jax.random.PRNGKey(7)  # td_loss's key: DQN's loss draws nothing from it


@pytest.fixture(scope="module")
def q_setup(dqn):
    config = dqn.Config(hidden_size=16, num_layers=2)
    network = dqn.make_networks(config, 3, (4,)).q
    online = jax.device_get(network.init(jax.random.PRNGKey(0), jnp.zeros((1, 4))))
    target = jax.device_get(network.init(jax.random.PRNGKey(1), jnp.zeros((1, 4))))
    rng = np.random.default_rng(0)
    n = 64
    # Each transition is one of: continuing, truncated at a time limit (not terminated: its
    # final_obs is the state the limit cut off), terminated. The buffer has no truncated flag:
    # a truncation is exactly a transition that is not terminated.
    terminated = np.arange(n) % 3 == 2
    batch = dqn.Transition(
        obs=rng.normal(size=(n, 4)).astype(np.float32),
        action=rng.integers(0, 3, n).astype(np.int32),
        reward=rng.normal(size=n).astype(np.float32),
        terminated=terminated,
        final_obs=(2 * rng.normal(size=(n, 4))).astype(np.float32),
    )
    return config, network, online, target, batch


@pytest.mark.parametrize("double", [False, True])
@pytest.mark.parametrize("loss", ["huber", "mse"])
@pytest.mark.parametrize("gamma", [0.99, 0.5])
def test_td_loss_matches_reference(dqn, q_setup, double, loss, gamma):
    config, network, online, target, batch = q_setup
    config = dqn.dataclasses.replace(config, double_dqn=double, loss=loss)
    td_loss = bound_td_loss(dqn, config, network)
    value, aux = jax.jit(td_loss)(online, target, jax.tree.map(jnp.asarray, batch), hparams(dqn, config, gamma), KEY)
    want = reference_targets(online, target, batch, gamma, double)
    np.testing.assert_allclose(aux["target"], want, rtol=1e-5, atol=1e-5)
    q = numpy_q(online, batch.obs)[np.arange(len(batch.action)), batch.action]
    np.testing.assert_allclose(aux["q"], q, rtol=1e-5, atol=1e-5)
    error = q - want
    if loss == "huber":
        want_loss = np.where(np.abs(error) <= 1, 0.5 * error**2, np.abs(error) - 0.5).mean()
    else:
        want_loss = (error**2).mean()
    assert float(value) == pytest.approx(want_loss, rel=1e-5)

    # Terminated transitions: the target is the reward alone; all others bootstrap.
    term = batch.terminated
    np.testing.assert_allclose(np.asarray(aux["target"])[term], batch.reward[term], rtol=1e-6)
    assert (np.abs(np.asarray(aux["target"])[~term] - batch.reward[~term]) > 1e-4).all()


def test_double_dqn_changes_the_target(dqn, q_setup):
    """The batch is built so that online and target networks disagree on some argmax."""
    config, network, online, target, batch = q_setup
    chooser_online = numpy_q(online, batch.final_obs).argmax(-1)
    chooser_target = numpy_q(target, batch.final_obs).argmax(-1)
    assert (chooser_online != chooser_target)[~batch.terminated].any()
    got = {}
    for double in (False, True):
        td_loss = bound_td_loss(dqn, dqn.dataclasses.replace(config, double_dqn=double), network)
        got[double] = np.asarray(
            jax.jit(td_loss)(online, target, jax.tree.map(jnp.asarray, batch), hparams(dqn, config), KEY)[1]["target"]
        )
    assert not np.allclose(got[False], got[True])
    assert (got[True] <= got[False] + 1e-5).all()  # max over actions is the largest choice


def test_gradient_flows_only_through_the_online_q(dqn, q_setup):
    """The target is a constant: d loss / d target_params == 0."""
    config, network, online, target, batch = q_setup
    td_loss = bound_td_loss(dqn, config, network)
    args = (jax.tree.map(jnp.asarray, batch), hparams(dqn, config), KEY)
    grads = jax.grad(lambda t: td_loss(online, t, *args)[0])(target)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(grads))
    grads = jax.grad(lambda p: td_loss(p, target, *args)[0])(online)
    assert any(float(jnp.abs(g).max()) > 0.0 for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("tau", [1.0, 0.5, 0.005])
@pytest.mark.parametrize("count", [0, 1, 2, 5])
def test_polyak_update_is_count_updates_in_closed_form(dqn, tau, count):
    """k updates target <- tau * online + (1 - tau) * target with the same online parameters, one
    at a time in NumPy, equal the closed form train uses; tau = 1 copies the online network."""
    rng = np.random.default_rng(0)
    online, target = rng.normal(size=(2, 50)).astype(np.float32)
    want = target.astype(np.float64)
    for _ in range(count):
        want = tau * online + (1 - tau) * want
    got = np.asarray(jax.jit(dqn.polyak_update)(online, target, jnp.float32(tau), jnp.int32(count)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if tau == 1.0 and count > 0:
        np.testing.assert_array_equal(got, online)
    # On a tree of parameters, as train calls it: leaf by leaf.
    tree = jax.jit(dqn.polyak_update)({"a": online, "b": online[:3]}, {"a": target, "b": target[:3]}, tau, count)
    np.testing.assert_array_equal(tree["a"], got)
    np.testing.assert_array_equal(tree["b"], got[:3])
