"""iqn.py's network, its quantile Huber loss with sampled levels (value and jax.grad gradient) and its
distributional target, against plain NumPy references written one transition (and one level pair) at a
time as Dabney et al. 2018 ("Implicit Quantile Networks") state them, on hand-made batches with
terminations and time-limit truncations. N, N' and K differ throughout, so a loss that swapped the
prediction and target axes, or weighted by the target levels, could not match."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_algorithm

NUM_ACTIONS, OBS_DIM = 3, 4
N, N_TARGET, K = 5, 7, 3  # levels regressed, target levels, levels that pick actions: all different
KEY = jax.random.PRNGKey(7)


def bound_td_loss(module, config, network):
    """module.td_loss with the config and network bound, taking the Q-network's own parameters (not {"q": ...})."""
    networks = module.Networks(q=network)
    return lambda online, target, *rest: module.td_loss(config, networks, {"q": online}, {"q": target}, *rest)


@pytest.fixture(scope="module")
def iqn():
    return load_algorithm("iqn")


def numpy_iqn(params, x, taus, embedding_dim):
    """The Q-network in float64 NumPy for one observation x [OBS_DIM] at levels taus [M]: [M, actions].
    psi = relu hidden layers of x; phi_j = relu(sum_i cos(pi i tau_j) w_ij + b_j); then relu(Dense(psi * phi))
    and the output layer (Dense_0 .. Dense_{L-1} hidden, then phi's, the merge's and the output's)."""
    layers = params["params"]
    dense = lambda name, h: h @ np.float64(layers[name]["kernel"]) + np.float64(layers[name]["bias"])  # noqa: E731
    names = sorted(layers, key=lambda name: int(name.split("_")[1]))
    psi = np.float64(x)
    for name in names[:-3]:
        psi = np.maximum(dense(name, psi), 0.0)
    cosines = np.cos(np.pi * np.arange(embedding_dim)[None, :] * np.float64(taus)[:, None])  # [M, embedding_dim]
    phi = np.maximum(dense(names[-3], cosines), 0.0)
    return dense(names[-1], np.maximum(dense(names[-2], psi[None, :] * phi), 0.0))


def reference_loss(quantiles, taus, targets, kappa):
    """Eq. 3 of the paper for one transition, as a double loop: sum over the N estimates i of the mean over the
    N' targets j of |tau_i - 1{u < 0}| * L_kappa(u) / kappa, u = target_j - quantile_i; tau_i is the level of
    estimate i (never a target's level)."""
    total = 0.0
    for i in range(len(quantiles)):
        for j in range(len(targets)):
            u = float(targets[j]) - float(quantiles[i])
            huber = 0.5 * u * u if abs(u) <= kappa else kappa * (abs(u) - 0.5 * kappa)
            total += abs(taus[i] - (1.0 if u < 0 else 0.0)) * huber / kappa / len(targets)
    return total


def reference_gradient(quantiles, taus, targets, kappa):
    """d reference_loss / d quantile_i: -mean_j |tau_i - 1{u < 0}| * clip(u, -kappa, kappa) / kappa."""
    grad = np.zeros(len(quantiles))
    for i in range(len(quantiles)):
        for j in range(len(targets)):
            u = float(targets[j]) - float(quantiles[i])
            grad[i] -= abs(taus[i] - (1.0 if u < 0 else 0.0)) * np.clip(u, -kappa, kappa) / kappa / len(targets)
    return grad


@pytest.fixture(scope="module")
def setup(iqn):
    config = iqn.Config(
        hidden_size=16, embedding_dim=8, num_taus=N, num_target_taus=N_TARGET, num_action_taus=K, kappa=1.0
    )
    network = iqn.make_networks(config, NUM_ACTIONS, (OBS_DIM,)).q
    init = lambda seed: network.init(jax.random.PRNGKey(seed), jnp.zeros((1, OBS_DIM)), jnp.zeros((1, N)))  # noqa: E731
    rng, n = np.random.default_rng(0), 48
    batch = iqn.Transition(  # continuing, truncated (not terminated: bootstraps from final_obs), terminated
        obs=rng.normal(size=(n, OBS_DIM)).astype(np.float32),
        action=rng.integers(0, NUM_ACTIONS, n).astype(np.int32),
        reward=rng.normal(size=n).astype(np.float32),
        terminated=np.arange(n) % 3 == 2,
        final_obs=(2 * rng.normal(size=(n, OBS_DIM))).astype(np.float32),
    )
    return config, network, jax.device_get(init(0)), jax.device_get(init(1)), batch


def test_the_network_matches_numpy_at_any_levels(iqn, setup):
    config, network, online, _, batch = setup
    taus = np.random.default_rng(1).uniform(size=(len(batch.obs), 6)).astype(np.float32)
    got = np.asarray(jax.jit(network.apply)(online, batch.obs, taus))
    assert got.shape == (len(batch.obs), 6, NUM_ACTIONS)
    want = np.stack([numpy_iqn(online, x, t, config.embedding_dim) for x, t in zip(batch.obs, taus, strict=True)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # The quantile function rises in tau somewhere: the levels reach the output.
    assert not np.allclose(got[:, :1], got[:, 1:2])


def test_q_values_are_the_mean_of_k_quantiles_at_levels_drawn_from_the_key(iqn, setup):
    config, network, online, _, batch = setup
    got = np.asarray(jax.jit(lambda p, o, k: iqn.q_values(config, network, p, o, k))(online, batch.obs, KEY))
    taus = np.asarray(jax.random.uniform(KEY, (len(batch.obs), K)))  # the draw q_values states
    want = [numpy_iqn(online, x, t, config.embedding_dim).mean(0) for x, t in zip(batch.obs, taus, strict=True)]
    np.testing.assert_allclose(got, np.stack(want), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("double", [False, True])
@pytest.mark.parametrize("gamma, kappa", [(0.99, 1.0), (0.5, 0.3)])
def test_td_loss_matches_reference(iqn, setup, double, gamma, kappa):
    """With the levels the loss drew from its key (aux): a' is the argmax of the chooser's (the online network's
    under double DQN) mean of K quantiles at final_obs; target_j = r + gamma (1 - terminated) Z_target(final_obs,
    tau'_j)[a']; the loss, the batch mean of reference_loss of the taken action's quantiles at the levels tau_i."""
    config, network, online, target, batch = setup
    config = dataclasses.replace(config, double_dqn=double)
    hp = iqn.hparams_from(dataclasses.replace(config, gamma=gamma, kappa=kappa))
    td_loss = jax.jit(bound_td_loss(iqn, config, network))
    value, aux = jax.device_get(td_loss(online, target, jax.tree.map(jnp.asarray, batch), hp, KEY))
    taus, target_taus = aux["taus"], aux["target_taus"]
    assert taus.shape == (len(batch.obs), N) and target_taus.shape == (len(batch.obs), N_TARGET)
    assert aux["target"].shape == (len(batch.obs), N_TARGET)
    losses = []
    for b in range(len(batch.obs)):
        next_quantiles = numpy_iqn(target, batch.final_obs[b], target_taus[b], config.embedding_dim)  # [N', A]
        a_next = int(np.argmax(aux["next_q"][b]))
        y = float(batch.reward[b]) + gamma * (0.0 if batch.terminated[b] else 1.0) * next_quantiles[:, a_next]
        np.testing.assert_allclose(aux["target"][b], y, rtol=1e-4, atol=1e-5)
        quantiles = numpy_iqn(online, batch.obs[b], taus[b], config.embedding_dim)[:, batch.action[b]]
        np.testing.assert_allclose(aux["q"][b], quantiles.mean(), rtol=1e-4, atol=1e-5)
        losses.append(reference_loss(quantiles, taus[b], y, kappa))
    assert float(value) == pytest.approx(np.mean(losses), rel=1e-4)
    # Terminated: every target is the reward; truncated (not terminated): they bootstrap from final_obs.
    term = batch.terminated
    np.testing.assert_allclose(aux["target"][term], np.repeat(batch.reward[term, None], N_TARGET, 1), rtol=1e-6)
    assert (np.abs(aux["target"][~term] - batch.reward[~term, None]).max(-1) > 1e-4).all()


@pytest.mark.parametrize("double", [False, True])
def test_the_next_action_is_picked_by_k_levels_of_the_chooser(iqn, setup, double):
    """next_q (aux), whose argmax is a', is the chooser's (the online network under double DQN, else the target)
    mean of K quantiles at final_obs, at the K levels td_loss draws from the third part of its key."""
    config, network, online, target, batch = setup
    config = dataclasses.replace(config, double_dqn=double)
    aux = jax.device_get(
        jax.jit(bound_td_loss(iqn, config, network))(online, target, batch, iqn.hparams_from(config), KEY)[1]
    )
    taus = np.asarray(jax.random.uniform(jax.random.split(KEY, 3)[2], (len(batch.obs), K)))
    chooser = online if double else target
    want = [numpy_iqn(chooser, x, t, config.embedding_dim).mean(0) for x, t in zip(batch.final_obs, taus, strict=True)]
    np.testing.assert_allclose(aux["next_q"], np.stack(want), rtol=1e-4, atol=1e-5)
    other = [
        numpy_iqn(target if double else online, x, t, config.embedding_dim).mean(0)
        for x, t in zip(batch.final_obs, taus, strict=True)
    ]
    assert (np.argmax(np.stack(want), -1) != np.argmax(np.stack(other), -1)).any(), (
        "the networks must disagree somewhere"
    )


@pytest.mark.parametrize("kappa", [1.0, 0.3])
def test_quantile_huber_loss_and_its_autodiff_gradient_match_numpy(iqn, kappa):
    """quantile_huber_loss with each row's own sampled levels: value and jax.grad gradient against the
    NumPy double loops, |u| on both sides of kappa."""
    rng = np.random.default_rng(3)
    quantiles, targets = rng.normal(size=(6, N)), 2 * rng.normal(size=(6, N_TARGET))
    taus = rng.uniform(size=(6, N))
    u = targets[:, None, :] - quantiles[:, :, None]
    assert (np.abs(u) < kappa).any() and (np.abs(u) > kappa).any()
    loss = lambda q: iqn.quantile_huber_loss(q, jnp.float32(taus), jnp.float32(targets), jnp.float32(kappa))  # noqa: E731
    value, grad = jax.jit(jax.value_and_grad(loss))(jnp.float32(quantiles))
    rows = list(zip(quantiles, taus, targets, strict=True))
    assert float(value) == pytest.approx(np.mean([reference_loss(*row, kappa) for row in rows]), rel=1e-5)
    want = np.stack([reference_gradient(*row, kappa) for row in rows]) / len(rows)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)
    # The levels weight the estimates: the same quantiles at the levels 1 - tau give another loss.
    swapped = iqn.quantile_huber_loss(jnp.float32(quantiles), jnp.float32(1 - taus), jnp.float32(targets), kappa)
    assert abs(float(swapped) - float(value)) > 1e-3


def test_gradient_flows_only_through_the_online_network(iqn, setup):
    config, network, online, target, batch = setup
    td_loss = bound_td_loss(iqn, config, network)
    batch, hp = jax.tree.map(jnp.asarray, batch), iqn.hparams_from(config)
    grads = jax.jit(jax.grad(lambda p, t: td_loss(p, t, batch, hp, KEY)[0], argnums=(0, 1)))(online, target)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(grads[1]))
    assert all(float(jnp.abs(g).max()) > 0.0 for g in jax.tree.leaves(grads[0]))


def test_the_loss_draws_its_levels_from_its_key(iqn, setup):
    config, network, online, target, batch = setup
    td_loss = jax.jit(bound_td_loss(iqn, config, network))
    hp = iqn.hparams_from(config)
    first, again, other = (td_loss(online, target, batch, hp, k)[1] for k in (KEY, KEY, jax.random.PRNGKey(8)))
    np.testing.assert_array_equal(first["taus"], again["taus"])
    assert not np.allclose(first["taus"], other["taus"])
    assert not np.allclose(first["target_taus"], other["target_taus"])


def test_the_greedy_action_is_the_argmax_of_q_values(iqn, setup):
    config, network, online, _, batch = setup
    env = types.SimpleNamespace(num_actions=NUM_ACTIONS, obs_shape=(OBS_DIM,))  # all the policy reads of its env
    act = jax.jit(jax.vmap(iqn.make_act(config, env=env), in_axes=(None, 0, None)))
    actions = np.asarray(act({"q": online}, batch.obs, KEY))
    action_taus_key = jax.random.split(KEY)[0]  # make_act's draw for the levels
    q = jax.vmap(lambda o: iqn.q_values(config, network, online, o, action_taus_key))(batch.obs)
    np.testing.assert_array_equal(actions, np.argmax(q, -1))


@pytest.mark.parametrize(
    "change, option",
    [
        (dict(num_taus=0), "--num-taus"),
        (dict(num_target_taus=0), "--num-target-taus"),
        (dict(num_action_taus=0), "--num-action-taus"),
        (dict(embedding_dim=0), "--embedding-dim"),
        (dict(kappa=float("nan")), "--kappa"),
    ],
)
def test_new_options_are_validated(iqn, change, option):
    with pytest.raises(iqn.ConfigError, match=option):
        iqn.validate(iqn.Config(**change))
