"""c51.py's projected distributional Bellman target and cross-entropy loss, and qr_dqn.py's quantile
Huber loss (its value and its jax.grad gradient), against plain NumPy references written one transition
(and one atom or quantile pair) at a time as the papers state them, on hand-made batches with terminations
and time-limit truncations; the greedy policies against the mean of the distributions, and the new
options' validation."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_algorithm, numpy_mlp

NUM_ACTIONS, OBS_DIM = 3, 4


def bound_td_loss(module, config, network):
    """module.td_loss with the config and network bound, taking the Q-network's own parameters (not {"q": ...})."""
    networks = module.Networks(q=network)
    return lambda online, target, *rest: module.td_loss(config, networks, {"q": online}, {"q": target}, *rest)


@pytest.fixture(scope="module")
def c51():
    return load_algorithm("c51")


@pytest.fixture(scope="module")
def qr_dqn():
    return load_algorithm("qr_dqn")


def numpy_heads(params, x, width):
    """The network's forward pass in float64 NumPy: [n, num_actions, width] (logits or quantiles)."""
    return numpy_mlp(params, x).reshape(len(x), NUM_ACTIONS, width)


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def make_batch(module, n=48, reward_scale=3.0, seed=0):
    """Each transition is one of: continuing, truncated at a time limit (not terminated: its
    final_obs is the state the limit cut off), terminated. The buffer has no truncated flag: a
    truncation is exactly a transition that is not terminated and bootstraps from final_obs."""
    rng = np.random.default_rng(seed)
    return module.Transition(
        obs=rng.normal(size=(n, OBS_DIM)).astype(np.float32),
        action=rng.integers(0, NUM_ACTIONS, n).astype(np.int32),
        reward=(reward_scale * rng.normal(size=n)).astype(np.float32),
        terminated=np.arange(n) % 3 == 2,
        final_obs=(2 * rng.normal(size=(n, OBS_DIM))).astype(np.float32),
    )


_LOSSES = {}
KEY = jax.random.PRNGKey(7)  # td_loss's key: neither loss draws anything from it


def jitted_loss(module, config, network):
    """One compiled td_loss per file and config, shared by the tests (the HParams, gamma and kappa
    among them, are inputs)."""
    key = (module.__name__, config)
    if key not in _LOSSES:
        _LOSSES[key] = jax.jit(bound_td_loss(module, config, network))
    return _LOSSES[key]


def hparams(module, config, **values):
    """The config's HParams with `values` (gamma, kappa): what td_loss reads them from."""
    return module.hparams_from(dataclasses.replace(config, **values))


def init_pair(module, config):
    network = module.make_networks(config, NUM_ACTIONS, (OBS_DIM,)).q
    online = jax.device_get(network.init(jax.random.PRNGKey(0), jnp.zeros((1, OBS_DIM))))
    target = jax.device_get(network.init(jax.random.PRNGKey(1), jnp.zeros((1, OBS_DIM))))
    return network, online, target


# --------------------------------------------------------------------------------------
# C51
# --------------------------------------------------------------------------------------
V_MIN, V_MAX, ATOMS = -10.0, 10.0, 11  # dz = 2: atoms at the even integers


def reference_projection(probs, shifted, v_min, v_max, num_atoms):
    """Bellemare et al. 2017, Algorithm 1, one shifted atom at a time: clip Tz_j into [v_min, v_max],
    b = (Tz_j - v_min) / dz, l = floor(b), u = ceil(b); m_l += p_j (u - b), m_u += p_j (b - l),
    and all of p_j on m_l when b is a grid point (l == u)."""
    dz = (v_max - v_min) / (num_atoms - 1)
    m = np.zeros(num_atoms)
    for j in range(len(probs)):
        tz = min(max(float(shifted[j]), v_min), v_max)
        b = (tz - v_min) / dz
        lower, upper = int(np.floor(b)), int(np.ceil(b))
        if lower == upper:
            m[lower] += probs[j]
        else:
            m[lower] += probs[j] * (upper - b)
            m[upper] += probs[j] * (b - lower)
    return m


def atoms_of(c51, config):
    return np.asarray(c51.support(config), np.float64)


@pytest.fixture(scope="module")
def c51_setup(c51):
    config = c51.Config(hidden_size=16, num_layers=2, num_atoms=ATOMS, v_min=V_MIN, v_max=V_MAX)
    network, online, target = init_pair(c51, config)
    batch = make_batch(c51)
    # Terminal transitions whose reward is a grid point, lies between two, and lies beyond either bound.
    reward = batch.reward.copy()
    reward[[2, 5, 8, 11]] = [4.0, 3.5, 25.0, -30.0]
    return config, network, online, target, batch._replace(reward=reward)


def project(c51, config, probs, shifted):
    return np.asarray(jax.jit(c51.project)(jnp.float32(probs), jnp.float32(shifted), c51.support(config)))


def test_projection_matches_reference_on_random_distributions(c51, c51_setup):
    config = c51_setup[0]
    rng = np.random.default_rng(1)
    probs = rng.dirichlet(np.ones(ATOMS), size=32)
    shifted = rng.uniform(-15, 15, size=(32, ATOMS))  # some beyond either bound
    got = project(c51, config, probs, shifted)
    want = np.stack([reference_projection(p, s, V_MIN, V_MAX, ATOMS) for p, s in zip(probs, shifted, strict=True)])
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-5)  # mass is conserved
    assert (got >= 0).all()


def test_projection_puts_atoms_beyond_the_bounds_on_the_end_atoms(c51, c51_setup):
    config = c51_setup[0]
    probs = np.random.default_rng(2).dirichlet(np.ones(ATOMS), size=2)
    shifted = np.stack([np.linspace(10.5, 40, ATOMS), np.linspace(-40, -10.01, ATOMS)])
    got = project(c51, config, probs, shifted)
    np.testing.assert_allclose(got[0], np.eye(ATOMS)[-1], atol=1e-6)
    np.testing.assert_allclose(got[1], np.eye(ATOMS)[0], atol=1e-6)


def test_projection_of_atoms_exactly_on_grid_points(c51, c51_setup):
    """A shift by a whole number of atoms moves every atom's mass onto one atom, none onto its
    neighbours (the floor == ceil case); the atoms shifted past v_max pile up on the last one."""
    config = c51_setup[0]
    atoms = atoms_of(c51, config)
    probs = np.random.default_rng(3).dirichlet(np.ones(ATOMS), size=1)
    got = project(c51, config, probs, atoms[None] + 4.0)[0]  # two atoms up
    want = np.concatenate([[0, 0], probs[0, :-3], [probs[0, -3:].sum()]])
    np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_allclose(got, reference_projection(probs[0], atoms + 4.0, V_MIN, V_MAX, ATOMS), atol=1e-6)
    # One atom exactly on a grid point inside the support, the others between two.
    shifted = atoms + 1.0
    shifted[3] = 6.0
    got = project(c51, config, probs, shifted[None])[0]
    np.testing.assert_allclose(got, reference_projection(probs[0], shifted, V_MIN, V_MAX, ATOMS), atol=1e-6)


def reference_c51(c51, config, online, target, batch, gamma, double):
    """One transition at a time: the target's next distribution at a' (argmax of the expected
    value by the target network, or by the online one under double DQN), its atoms shifted to
    r + gamma (1 - terminated) z and projected; the loss, the batch mean of -sum_i m_i log p_i."""
    atoms = atoms_of(c51, config)
    targets, losses, qs = [], [], []
    for b in range(len(batch.reward)):
        next_probs = softmax(numpy_heads(target, batch.final_obs[b : b + 1], ATOMS)[0])
        chooser = softmax(numpy_heads(online, batch.final_obs[b : b + 1], ATOMS)[0]) if double else next_probs
        a_next = int(np.argmax(chooser @ atoms))
        shifted = float(batch.reward[b]) + gamma * (0.0 if batch.terminated[b] else 1.0) * atoms
        m = reference_projection(next_probs[a_next], shifted, V_MIN, V_MAX, ATOMS)
        logits = numpy_heads(online, batch.obs[b : b + 1], ATOMS)[0, batch.action[b]]
        log_p = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        targets.append(m)
        losses.append(-(m * log_p).sum())
        qs.append(softmax(logits) @ atoms)
    return np.array(targets), float(np.mean(losses)), np.array(qs)


def c51_loss(c51, config, network, online, target, batch, gamma):
    td_loss = jitted_loss(c51, config, network)
    return td_loss(online, target, jax.tree.map(jnp.asarray, batch), hparams(c51, config, gamma=gamma), KEY)


@pytest.mark.parametrize("double", [False, True])
@pytest.mark.parametrize("gamma", [0.99, 0.5])
def test_c51_loss_matches_reference(c51, c51_setup, double, gamma):
    config, network, online, target, batch = c51_setup
    config = dataclasses.replace(config, double_dqn=double)
    value, aux = c51_loss(c51, config, network, online, target, batch, gamma)
    want_target, want_loss, want_q = reference_c51(c51, config, online, target, batch, gamma, double)
    got = np.asarray(aux["target"])
    assert got.shape == (len(batch.reward), ATOMS)
    np.testing.assert_allclose(got, want_target, atol=1e-5)
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(aux["q"], want_q, rtol=1e-5, atol=1e-5)
    assert float(value) == pytest.approx(want_loss, rel=1e-5)


def test_c51_terminal_transitions_collapse_to_the_reward(c51, c51_setup):
    """A terminated transition's target is the reward alone: all mass on the one or two atoms
    around it (on one exactly when it is a grid point, on an end atom beyond the bounds); a
    truncated one (not terminated) bootstraps from final_obs and spreads further."""
    config, network, online, target, batch = c51_setup
    got = np.asarray(c51_loss(c51, config, network, online, target, batch, 0.99)[1]["target"])
    atoms = atoms_of(c51, config)
    for b in np.flatnonzero(batch.terminated):
        r = float(np.clip(batch.reward[b], V_MIN, V_MAX))
        near = np.abs(atoms - r) < 2.0 - 1e-6  # the atoms within one spacing of the reward
        assert got[b, ~near].max(initial=0.0) < 1e-6, b
        np.testing.assert_allclose(got[b] @ atoms, r, atol=1e-4)  # the projection keeps the mean
    np.testing.assert_allclose(got[2], np.eye(ATOMS)[7], atol=1e-6)  # reward 4.0: the atom 4
    np.testing.assert_allclose(got[5, [6, 7]], [0.25, 0.75], atol=1e-6)  # reward 3.5: between 2 and 4
    np.testing.assert_allclose(got[8], np.eye(ATOMS)[-1], atol=1e-6)  # reward 25: the last atom
    np.testing.assert_allclose(got[11], np.eye(ATOMS)[0], atol=1e-6)  # reward -30: the first atom
    assert ((got[~batch.terminated] > 1e-4).sum(-1) > 2).all()


def test_c51_double_dqn_picks_the_next_action_by_the_online_expected_value(c51, c51_setup):
    config, network, online, target, batch = c51_setup
    atoms = atoms_of(c51, config)
    by_online = (softmax(numpy_heads(online, batch.final_obs, ATOMS)) @ atoms).argmax(-1)
    by_target = (softmax(numpy_heads(target, batch.final_obs, ATOMS)) @ atoms).argmax(-1)
    differ = (by_online != by_target) & ~batch.terminated
    assert differ.any(), "the batch must have transitions where the two networks disagree"
    got = {}
    for double in (False, True):
        cfg = dataclasses.replace(config, double_dqn=double)
        got[double] = np.asarray(c51_loss(c51, cfg, network, online, target, batch, 0.99)[1]["target"])
    next_probs = softmax(numpy_heads(target, batch.final_obs, ATOMS))
    for b in np.flatnonzero(differ):
        shifted = float(batch.reward[b]) + 0.99 * atoms
        for double, action in ((True, by_online[b]), (False, by_target[b])):
            want = reference_projection(next_probs[b, action], shifted, V_MIN, V_MAX, ATOMS)
            np.testing.assert_allclose(got[double][b], want, atol=1e-5)
    assert not np.allclose(got[False][differ], got[True][differ])
    np.testing.assert_allclose(got[False][~differ], got[True][~differ], atol=1e-6)


def test_c51_gradient_flows_only_through_the_online_network(c51, c51_setup):
    config, network, online, target, batch = c51_setup
    td_loss = bound_td_loss(c51, config, network)
    batch, hp = jax.tree.map(jnp.asarray, batch), hparams(c51, config)
    grads = jax.jit(jax.grad(lambda p, t: td_loss(p, t, batch, hp, KEY)[0], argnums=(0, 1)))(online, target)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(grads[1]))
    assert any(float(jnp.abs(g).max()) > 0.0 for g in jax.tree.leaves(grads[0]))


# --------------------------------------------------------------------------------------
# QR-DQN
# --------------------------------------------------------------------------------------
QUANTILES = 8


def reference_quantile_huber(theta, targets, kappa):
    """Dabney et al. 2018, eq. 10 as a double loop: sum over the estimates i of the mean over the
    targets j of |tau_i - 1{u < 0}| * L_kappa(u) / kappa, with u = target_j - theta_i."""
    n = len(theta)
    total = 0.0
    for i in range(n):
        tau = (2 * i + 1) / (2 * n)
        acc = 0.0
        for j in range(len(targets)):
            u = float(targets[j]) - float(theta[i])
            huber = 0.5 * u * u if abs(u) <= kappa else kappa * (abs(u) - 0.5 * kappa)
            acc += abs(tau - (1.0 if u < 0 else 0.0)) * huber / kappa
        total += acc / len(targets)
    return total


def reference_qr(online, target, batch, gamma, kappa, double):
    """One transition at a time: target_j = r + gamma (1 - terminated) theta_target(final_obs, a')_j,
    a' the argmax of the mean quantile (by the online network under double DQN); the loss is the
    batch mean of reference_quantile_huber of the taken action's quantiles."""
    targets, losses = [], []
    for b in range(len(batch.reward)):
        next_theta = numpy_heads(target, batch.final_obs[b : b + 1], QUANTILES)[0]
        chooser = numpy_heads(online, batch.final_obs[b : b + 1], QUANTILES)[0] if double else next_theta
        a_next = int(np.argmax(chooser.mean(-1)))
        bootstrap = 0.0 if batch.terminated[b] else 1.0
        y = float(batch.reward[b]) + gamma * bootstrap * next_theta[a_next]
        theta = numpy_heads(online, batch.obs[b : b + 1], QUANTILES)[0, batch.action[b]]
        targets.append(y)
        losses.append(reference_quantile_huber(theta, y, kappa))
    return np.array(targets), float(np.mean(losses))


@pytest.fixture(scope="module")
def qr_setup(qr_dqn):
    config = qr_dqn.Config(hidden_size=16, num_layers=2, num_quantiles=QUANTILES)
    network, online, target = init_pair(qr_dqn, config)
    return config, network, online, target, make_batch(qr_dqn, reward_scale=1.0)


@pytest.mark.parametrize("double", [False, True])
@pytest.mark.parametrize("kappa", [1.0, 0.3])
def test_quantile_huber_loss_matches_reference(qr_dqn, qr_setup, double, kappa):
    config, network, online, target, batch = qr_setup
    config = dataclasses.replace(config, double_dqn=double)
    td_loss = jitted_loss(qr_dqn, config, network)
    gamma = 0.9
    hp = hparams(qr_dqn, config, gamma=gamma, kappa=kappa)
    value, aux = td_loss(online, target, jax.tree.map(jnp.asarray, batch), hp, KEY)
    want_target, want_loss = reference_qr(online, target, batch, gamma, kappa, double)
    got = np.asarray(aux["target"])
    assert got.shape == (len(batch.reward), QUANTILES)
    np.testing.assert_allclose(got, want_target, rtol=1e-5, atol=1e-5)
    theta = numpy_heads(online, batch.obs, QUANTILES)[np.arange(len(batch.action)), batch.action]
    np.testing.assert_allclose(aux["q"], theta.mean(-1), rtol=1e-5, atol=1e-5)
    assert float(value) == pytest.approx(want_loss, rel=1e-5)
    # Terminated: every target quantile is the reward; truncated (not terminated): they bootstrap.
    term = batch.terminated
    np.testing.assert_allclose(got[term], np.repeat(batch.reward[term, None], QUANTILES, 1), rtol=1e-6)
    assert (np.abs(got[~term] - batch.reward[~term, None]).max(-1) > 1e-4).all()
    # |u| both below and above kappa occur, so both branches of the Huber loss are checked.
    u = got[:, None, :] - theta[:, :, None]
    assert (np.abs(u) < kappa).any() and (np.abs(u) > kappa).any()


def test_qr_double_dqn_picks_the_next_action_by_the_online_mean(qr_dqn, qr_setup):
    config, network, online, target, batch = qr_setup
    by_online = numpy_heads(online, batch.final_obs, QUANTILES).mean(-1).argmax(-1)
    by_target = numpy_heads(target, batch.final_obs, QUANTILES).mean(-1).argmax(-1)
    differ = (by_online != by_target) & ~batch.terminated
    assert differ.any()
    got = {}
    for double in (False, True):
        td_loss = jitted_loss(qr_dqn, dataclasses.replace(config, double_dqn=double), network)
        args = (jax.tree.map(jnp.asarray, batch), hparams(qr_dqn, config, gamma=0.99, kappa=1.0), KEY)
        got[double] = np.asarray(td_loss(online, target, *args)[1]["target"])
    assert not np.allclose(got[False][differ], got[True][differ])
    np.testing.assert_allclose(got[False][~differ], got[True][~differ], rtol=1e-6)


@pytest.mark.parametrize("kappa", [1.0, 2.0])
def test_quantile_gradient_signs_and_asymmetry(qr_dqn, kappa):
    """d loss / d theta_i is negative (gradient descent raises theta_i) when every target lies above
    it, positive when every target lies below; beyond kappa its size is tau_i above and 1 - tau_i
    below (the Huber slope kappa divided by kappa), and within kappa tau_i |u| / kappa resp.
    (1 - tau_i) |u| / kappa: low quantiles move up slowly and down fast, high ones the reverse."""
    tau = np.asarray(qr_dqn.quantile_midpoints(QUANTILES))
    np.testing.assert_allclose(tau, (2 * np.arange(QUANTILES) + 1) / (2 * QUANTILES))
    grad = jax.jit(jax.grad(qr_dqn.quantile_huber_loss), static_argnums=())
    theta = jnp.zeros((1, QUANTILES))
    for offset, far in ((5.0, True), (0.25, False)):  # u = +-offset: beyond kappa or within it
        for sign in (1.0, -1.0):
            targets = jnp.full((1, 6), sign * offset)
            g = np.asarray(grad(theta, targets, jnp.float32(kappa)))[0]
            slope = 1.0 if far else offset / kappa
            if sign > 0:
                assert (g < 0).all()
                np.testing.assert_allclose(g, -tau * slope, rtol=1e-5)
            else:
                assert (g > 0).all()
                np.testing.assert_allclose(g, (1 - tau) * slope, rtol=1e-5)
    # With the same targets the loss's reference agrees too (batch of one).
    targets = np.random.default_rng(4).normal(size=(1, 5))
    theta = np.random.default_rng(5).normal(size=(1, QUANTILES))
    got = float(jax.jit(qr_dqn.quantile_huber_loss)(jnp.float32(theta), jnp.float32(targets), jnp.float32(kappa)))
    assert got == pytest.approx(reference_quantile_huber(theta[0], targets[0], kappa), rel=1e-5)


def reference_quantile_huber_gradient(theta, targets, kappa):
    """d reference_quantile_huber / d theta_i, one pair at a time: the Huber loss's slope in u is
    clip(u, -kappa, kappa) and du / d theta_i = -1, so the gradient is
    -mean_j |tau_i - 1{u < 0}| * clip(u, -kappa, kappa) / kappa."""
    n = len(theta)
    grad = np.zeros(n)
    for i in range(n):
        tau = (2 * i + 1) / (2 * n)
        for j in range(len(targets)):
            u = float(targets[j]) - float(theta[i])
            grad[i] -= abs(tau - (1.0 if u < 0 else 0.0)) * min(max(u, -kappa), kappa) / kappa / len(targets)
    return grad


@pytest.mark.parametrize("kappa", [1.0, 0.3])
def test_quantile_huber_loss_and_its_autodiff_gradient_match_numpy(qr_dqn, kappa):
    """quantile_huber_loss is the plain formula, differentiated by jax.grad: its value and gradient
    over a batch (the mean of the rows') equal the NumPy double loops, with |u| on both sides of kappa."""
    rng = np.random.default_rng(7)
    theta, targets = rng.normal(size=(6, QUANTILES)), 2 * rng.normal(size=(6, 5))
    u = targets[:, None, :] - theta[:, :, None]
    assert (np.abs(u) < kappa).any() and (np.abs(u) > kappa).any()
    value, grad = jax.jit(jax.value_and_grad(qr_dqn.quantile_huber_loss))(
        jnp.float32(theta), jnp.float32(targets), jnp.float32(kappa)
    )
    rows = list(zip(theta, targets, strict=True))
    want = np.mean([reference_quantile_huber(t, y, kappa) for t, y in rows])
    assert float(value) == pytest.approx(want, rel=1e-5)
    want_grad = np.stack([reference_quantile_huber_gradient(t, y, kappa) for t, y in rows]) / len(rows)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------------
# Both: acting and options
# --------------------------------------------------------------------------------------
def test_greedy_policies_act_on_the_mean(c51, qr_dqn, c51_setup, qr_setup):
    obs = np.random.default_rng(6).normal(size=(32, OBS_DIM)).astype(np.float32)
    for module, (config, _, online, _, _), width in ((c51, c51_setup, ATOMS), (qr_dqn, qr_setup, QUANTILES)):
        env = types.SimpleNamespace(num_actions=NUM_ACTIONS, obs_shape=(OBS_DIM,))  # all the policy reads of its env
        act = jax.vmap(module.make_act(config, env=env), in_axes=(None, 0, None))
        action = jax.jit(act)({"q": online}, obs, KEY)
        heads = numpy_heads(online, obs, width)
        value = softmax(heads) @ atoms_of(c51, config) if module is c51 else heads.mean(-1)
        np.testing.assert_array_equal(action, value.argmax(-1))


@pytest.mark.parametrize(
    "name, change, option",
    [
        ("c51", dict(num_atoms=1), "--num-atoms"),
        ("c51", dict(v_min=5.0, v_max=5.0), "--v-min"),
        ("c51", dict(v_max=float("inf")), "--v-min"),
        ("qr_dqn", dict(num_quantiles=0), "--num-quantiles"),
        ("qr_dqn", dict(kappa=0.0), "--kappa"),
        ("qr_dqn", dict(kappa=float("nan")), "--kappa"),
    ],
)
def test_new_options_are_validated(name, change, option):
    module = load_algorithm(name)
    with pytest.raises(module.ConfigError, match=option):
        module.validate(module.Config(**change))
