"""sac.py's losses against NumPy references on hand-made batches: the soft TD target (entropy term,
minimum over the twin target critics, bootstrapping through time-limit truncations but never
through terminations), the tanh-squashed and rescaled log-density (closed form and a Monte-Carlo
histogram of sampled actions), the temperature loss's sign and fixed point, one gradient step (Adam
on the parameter tree, the Polyak update of the target critics) against references, and the replay
buffer's uniform sampling."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

from conftest import load_algorithm, numpy_mlp

sac = load_algorithm("sac")


def numpy_policy(config, actor, obs, noise, centre, half):
    """(action in [-1, 1], log-density of the executed action) of the squashed Gaussian, in float64."""
    out = numpy_mlp(actor, obs)
    mean, raw = np.split(out, 2, axis=-1)
    log_std = config.log_std_min + 0.5 * (config.log_std_max - config.log_std_min) * (np.tanh(raw) + 1)
    u = mean + np.exp(log_std) * noise
    log_normal = -0.5 * ((u - mean) / np.exp(log_std)) ** 2 - log_std - 0.5 * math.log(2 * math.pi)
    log_det = np.log(half) + np.log(1 - np.tanh(u) ** 2)
    return np.tanh(u), (log_normal - log_det).sum(-1)


def numpy_critics(critics, obs, action):
    """[num_critics, batch] Q-values of the stacked critics."""
    count = jax.tree.leaves(critics)[0].shape[0]
    x = np.concatenate([obs, action], -1)
    return np.stack([numpy_mlp(jax.tree.map(lambda p: p[i], critics), x)[:, 0] for i in range(count)])


@pytest.fixture(scope="module")
def setup():
    """Small networks (relu, 16 units), a Pendulum-shaped batch of 48 transitions: continuing,
    truncated at the time limit (not terminated: final_obs is the state the limit cut off) and
    terminated, in turn."""
    config = sac.Config(hidden_size=16, num_layers=2)
    networks = sac.make_networks(config, 1, (3,))
    obs0, action0 = jnp.zeros((1, 3)), jnp.zeros((1, 1))
    init_critics = jax.vmap(networks.critic.init, in_axes=(0, None, None))
    params = jax.device_get(
        {
            "actor": networks.actor.init(jax.random.PRNGKey(0), obs0),
            "critic": init_critics(jax.random.split(jax.random.PRNGKey(1), 2), obs0, action0),
            "log_alpha": jnp.float32(math.log(0.3)),
        }
    )
    target = jax.device_get({"critic": init_critics(jax.random.split(jax.random.PRNGKey(2), 2), obs0, action0)})
    rng = np.random.default_rng(0)
    n = 48
    kind = np.arange(n) % 3  # 0 continuing, 1 truncated, 2 terminated
    batch = sac.Transition(
        obs=rng.normal(size=(n, 3)).astype(np.float32),
        action=rng.uniform(-1, 1, (n, 1)).astype(np.float32),
        reward=rng.normal(size=n).astype(np.float32),
        terminated=kind == 2,
        final_obs=(2 * rng.normal(size=(n, 3))).astype(np.float32),
    )
    key = jax.random.PRNGKey(3)  # the loss's: it draws a' ~ pi(s') and a ~ pi(s) from its two halves
    scale = sac.ActionScale(centre=jnp.zeros(1), half_range=jnp.full(1, 2.0))  # Pendulum's [-2, 2]
    return config, networks, params, target, batch, key, scale, kind


def loss_noise(key, n):
    """The standard normal noise the loss draws from `key`: (for a', for a)."""
    return tuple(np.asarray(jax.random.normal(k, (n, 1))) for k in jax.random.split(key))


def loss_and_aux(setup, hparams, batch=None):
    config, networks, params, target, default_batch, key, scale, _ = setup
    batch = default_batch if batch is None else batch
    return sac.sac_loss(config, networks, params, target["critic"], batch, scale, hparams, key)


@pytest.mark.parametrize("fixed_alpha", [0.0, 0.2])
def test_soft_td_target_matches_numpy(setup, fixed_alpha):
    """y = r + gamma * (1 - terminated) * (min_i Q_target_i(s', a') - alpha * log pi(a'|s')), a' drawn
    from the loss's key; the critics regress on it with 0.5 * sum over critics of the MSE."""
    config, _, params, target, batch, key, _, kind = setup
    gamma = 0.9
    hparams = sac.hparams_from(config)._replace(gamma=jnp.float32(gamma), alpha=jnp.float32(fixed_alpha))
    loss, aux = jax.device_get(loss_and_aux(setup, hparams))
    alpha = fixed_alpha if fixed_alpha > 0 else 0.3  # learned: exp(log_alpha)
    next_noise, _ = loss_noise(key, len(batch.reward))
    next_action, next_log_prob = numpy_policy(config, params["actor"], batch.final_obs, next_noise, 0.0, 2.0)
    next_q = numpy_critics(target["critic"], batch.final_obs, next_action)
    assert (next_q[0] != next_q[1]).all()  # the minimum picks a different critic in different rows
    assert len({bool(b) for b in next_q[0] < next_q[1]}) == 2
    soft_value = next_q.min(0) - alpha * next_log_prob
    want = batch.reward + gamma * np.where(batch.terminated, 0.0, soft_value)
    np.testing.assert_allclose(aux["target"], want, rtol=2e-5, atol=2e-5)
    # A terminal transition's target is its reward alone; a truncated one bootstraps like a continuing one.
    np.testing.assert_array_equal(aux["target"][kind == 2], batch.reward[kind == 2])
    assert not np.allclose(aux["target"][kind == 1], batch.reward[kind == 1])
    q = numpy_critics(params["critic"], batch.obs, batch.action)
    np.testing.assert_allclose(aux["q"], q, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(aux["critic_loss"], 0.5 * ((q - want) ** 2).mean(-1).sum(), rtol=1e-4)
    # The actor's loss rates a ~ pi(s) drawn from the key's other half: alpha log pi(a|s) - min_i Q_i(s, a).
    _, noise = loss_noise(key, len(batch.reward))
    action, log_prob = numpy_policy(config, params["actor"], batch.obs, noise, 0.0, 2.0)
    actor_loss = (alpha * log_prob - numpy_critics(params["critic"], batch.obs, action).min(0)).mean()
    np.testing.assert_allclose(aux["actor_loss"], actor_loss, rtol=1e-4, atol=1e-5)


def test_only_terminations_stop_the_bootstrap(setup):
    """Moving every final_obs changes the targets of continuing and truncated transitions (they
    bootstrap from the state the time limit cut off), never those of terminated ones."""
    config, _, _, _, batch, _, _, kind = setup
    hparams = sac.hparams_from(config)
    base = jax.device_get(loss_and_aux(setup, hparams)[1]["target"])
    moved = batch._replace(final_obs=batch.final_obs + 1.0)
    changed = jax.device_get(loss_and_aux(setup, hparams, moved)[1]["target"])
    np.testing.assert_array_equal(changed[kind == 2], base[kind == 2])
    assert (changed[kind != 2] != base[kind != 2]).all()


def reference_log_density(action, mean, log_std, low, high):
    """log p(a) for a = centre + half * tanh(u), u ~ N(mean, exp(log_std)^2), per dimension, in
    float64: the Gaussian density at u = atanh((a - centre) / half) over |da/du| = half * (1 - x^2)."""
    centre, half = (high + low) / 2, (high - low) / 2
    x = (np.asarray(action, np.float64) - centre) / half
    u = np.arctanh(x)
    s = np.exp(log_std)
    return -0.5 * ((u - mean) / s) ** 2 - np.log(s) - 0.5 * math.log(2 * math.pi) - np.log(half * (1 - x**2))


def test_squashed_log_prob_matches_the_closed_form():
    """Two action dimensions with different bounds: the log-density of the executed action is the
    sum over dimensions of the change of variables through tanh and the rescale."""
    low, high = np.array([-2.0, -1.0]), np.array([2.0, 3.0])
    scale = sac.ActionScale(centre=jnp.asarray((high + low) / 2), half_range=jnp.asarray((high - low) / 2))
    mean = np.array([[0.4, -0.2], [-1.0, 0.8], [0.0, 0.0]], np.float32)
    log_std = np.array([[-0.3, 0.2], [-1.5, -0.5], [0.5, -2.0]], np.float32)
    key = jax.random.PRNGKey(0)
    squashed, log_prob = map(np.asarray, sac.squashed_sample(mean, log_std, key, scale))
    noise = np.asarray(jax.random.normal(key, mean.shape), np.float64)  # what squashed_sample draws
    u = mean.astype(np.float64) + np.exp(log_std.astype(np.float64)) * noise
    np.testing.assert_allclose(squashed, np.tanh(u), rtol=1e-6)
    action = (high + low) / 2 + (high - low) / 2 * np.tanh(u)
    want = reference_log_density(action, mean, log_std, low, high).sum(-1)
    np.testing.assert_allclose(log_prob, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sac.squashed_log_prob(u.astype(np.float32), mean, log_std, scale), want, rtol=1e-5)


def test_saturated_samples_keep_a_finite_log_prob():
    """tanh(u) rounds to +-1 in float32 for |u| > ~9: the log-density is taken from u, never from an
    inverted action, so it stays finite (and equals the closed form in u)."""
    scale = sac.ActionScale(centre=jnp.zeros(1), half_range=jnp.full(1, 2.0))
    mean, log_std = np.array([[30.0], [-30.0], [14.0]], np.float32), np.zeros((3, 1), np.float32)
    key = jax.random.PRNGKey(0)
    squashed, log_prob = map(np.asarray, sac.squashed_sample(mean, log_std, key, scale))
    np.testing.assert_array_equal(np.abs(squashed[:2, 0]), 1.0)
    assert np.isfinite(log_prob).all()
    # log(1 - tanh(u)^2) = 2 (log 2 - |u| - log(1 + exp(-2|u|))): no cancellation in float64.
    noise = np.asarray(jax.random.normal(key, mean.shape), np.float64)[:, 0]  # what squashed_sample draws
    u = (mean[:, 0] + noise.astype(np.float32)).astype(np.float64)
    assert (np.abs(u) > 9).all()
    log_det = math.log(2.0) + 2 * (math.log(2) - np.abs(u) - np.log1p(np.exp(-2 * np.abs(u))))
    want = -0.5 * noise**2 - 0.5 * math.log(2 * math.pi) - log_det
    np.testing.assert_allclose(log_prob, want, rtol=1e-5)


def test_squashed_density_matches_a_histogram_of_sampled_actions():
    """400k actions drawn through squashed_sample (bounds [-1, 3]): each histogram bin holds the
    share of them that exp(log_prob), integrated over the bin, predicts, within sampling error."""
    low, high, mean, log_std, bins = -1.0, 3.0, 0.3, -0.2, 40
    centre, half = (high + low) / 2, (high - low) / 2
    scale = sac.ActionScale(centre=jnp.full(1, centre), half_range=jnp.full(1, half))
    n = 400_000
    squashed, _ = sac.squashed_sample(jnp.full((n, 1), mean), jnp.full((n, 1), log_std), jax.random.PRNGKey(0), scale)
    action = np.asarray(scale(squashed))[:, 0].astype(np.float64)
    assert action.min() > low and action.max() < high
    counts, edges = np.histogram(action, bins=bins, range=(low, high))

    def density(a):
        """exp(log_prob) at actions `a`: squashed_log_prob at the u that lands exactly there."""
        u = np.arctanh((a - centre) / half).astype(np.float32)[:, None]
        ones = jnp.ones((len(a), 1))
        return np.exp(np.asarray(sac.squashed_log_prob(u, mean * ones, log_std * ones, scale), np.float64))

    # Midpoint rule with 200 points per bin, away from the bounds where the density vanishes.
    width = (high - low) / bins
    points = low + (np.arange(bins * 200) + 0.5) * width / 200
    expected = n * density(points).reshape(bins, 200).mean(-1) * width
    np.testing.assert_allclose(expected.sum(), n, rtol=1e-3)
    assert np.all(np.abs(counts - expected) <= 4 * np.sqrt(expected) + 1), np.round(
        (counts - expected) / np.sqrt(expected), 1
    )


def test_temperature_loss_sign_and_fixed_point():
    """d loss / d log_alpha = entropy estimate - target entropy: negative (so gradient descent raises
    alpha) when the policy's entropy is below the target, positive above it, zero at the target."""
    key = jax.random.PRNGKey(0)  # unused by the temperature's loss

    def grad(log_alpha, log_prob, target_entropy):
        return jax.grad(sac.temperature_loss)(log_alpha, log_prob, target_entropy, key)

    log_alpha = jnp.float32(0.3)
    target_entropy = jnp.float32(-1.0)
    low_entropy = jnp.full(64, 2.0)  # log_prob 2: entropy estimate -2 < -1
    high_entropy = jnp.full(64, -0.5)  # entropy 0.5 > -1
    assert float(grad(log_alpha, low_entropy, target_entropy)) == pytest.approx(-2.0 - (-1.0))
    assert float(grad(log_alpha, high_entropy, target_entropy)) == pytest.approx(0.5 - (-1.0))
    at_target = jnp.full(64, 1.0)  # entropy exactly -1
    assert float(grad(log_alpha, at_target, target_entropy)) == 0.0
    # One Adam step from the low-entropy gradient raises alpha, from the high one lowers it.
    adam = sac.make_optimizer(sac.Config(), sac.hparams_from(sac.Config()))
    for log_prob, direction in ((low_entropy, 1), (high_entropy, -1)):
        update, _ = adam.update(grad(log_alpha, log_prob, target_entropy), adam.init(log_alpha))
        assert np.sign(float(update)) == direction


@pytest.mark.parametrize("fixed_alpha", [0.0, 0.2])
def test_temperature_gradient_inside_the_sac_loss(setup, fixed_alpha):
    """Through the whole loss, log_alpha's gradient is entropy - target entropy when alpha is
    learned (target entropy = -action_dim * target_entropy_scale) and zero when --alpha fixes it;
    the temperature's loss never moves actor or critics."""
    config, networks, params, target, batch, key, scale, _ = setup
    hparams = sac.hparams_from(config)._replace(alpha=jnp.float32(fixed_alpha), target_entropy_scale=jnp.float32(0.7))
    loss = lambda params, hparams: sac.sac_loss(config, networks, params, target["critic"], batch, scale, hparams, key)  # noqa: E731
    grads, aux = jax.grad(loss, has_aux=True)(params, hparams)
    want = 0.0 if fixed_alpha > 0 else float(aux["entropy"]) - (-1 * 0.7)
    assert float(grads["log_alpha"]) == pytest.approx(want, abs=1e-6)
    # The actor's and critics' gradients do not depend on the target entropy.
    other = jax.grad(loss, has_aux=True)(params, hparams._replace(target_entropy_scale=jnp.float32(3.0)))[0]
    for name in ("actor", "critic"):
        jax.tree.map(np.testing.assert_array_equal, grads[name], other[name])


@pytest.mark.parametrize("tau", [0.005, 0.3, 1.0])
def test_gradient_step_is_adam_on_the_loss_then_polyak(setup, tau):
    """One gradient step: Adam on the parameter tree equals Adam on the flat vector of all parameters
    (what the file used to do); the target critics become tau * critics + (1 - tau) * target (tau = 1
    copies); the logged sums are the loss's values and the gradient's global norm."""
    config, networks, params, target, batch, key, scale, _ = setup
    hparams = sac.hparams_from(config)._replace(tau=jnp.float32(tau))
    adam = sac.make_optimizer(config, hparams)
    runner = sac.Runner(params, target, adam.init(params), buffer=None, episodes=None, rng=None, hparams=hparams)
    sums = dict.fromkeys(sac.LOGGED, jnp.float32(1.0))  # a step adds to what the update summed so far
    stepped, stepped_sums = jax.device_get(
        jax.jit(sac.gradient_step, static_argnums=(0, 1))(config, networks, scale, runner, sums, batch, key)
    )

    flat, unravel = ravel_pytree(params)
    loss = lambda flat: sac.sac_loss(config, networks, unravel(flat), target["critic"], batch, scale, hparams, key)  # noqa: E731
    grads, aux = jax.grad(loss, has_aux=True)(flat)
    updates, _ = adam.update(grads, adam.init(flat))
    jax.tree.map(
        lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7),
        stepped.params,
        unravel(flat + updates),
    )
    assert int(optax.tree_utils.tree_get(stepped.opt_state, "count")) == 1
    want = jax.tree.map(
        lambda online, old: tau * np.float64(online) + (1 - tau) * np.float64(old),
        stepped.params["critic"],
        target["critic"],
    )
    jax.tree.map(
        lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7),
        stepped.target_params["critic"],
        want,
    )
    if tau == 1.0:
        jax.tree.map(np.testing.assert_array_equal, stepped.target_params["critic"], stepped.params["critic"])
    logged = dict(loss=aux["critic_loss"], actor_loss=aux["actor_loss"], q_mean=aux["q"].mean(), entropy=aux["entropy"])
    logged["grad_norm"] = np.linalg.norm(np.asarray(grads, np.float64))
    for name, value in logged.items():
        np.testing.assert_allclose(stepped_sums[name], 1.0 + value, rtol=1e-5, err_msg=name)


def test_buffer_sample_draws_filled_slots_uniformly():
    """With replacement, from slots [0, size) only: each of 40 filled slots (of 64) about equally often."""
    capacity, size, batch = 64, 40, 128
    buffer = sac.buffer_init(capacity, (3,), jnp.float32, 1)
    ids = jnp.arange(size, dtype=jnp.float32)
    fields = dict(obs=jnp.repeat(ids[:, None], 3, 1), action=ids[:, None] / size, reward=ids)
    buffer = sac.buffer_add(buffer, sac.Transition(**fields, terminated=ids % 2 == 0, final_obs=fields["obs"] + 1000))
    assert int(buffer.size) == size and int(buffer.position) == size
    keys = jax.random.split(jax.random.PRNGKey(0), 500)
    draws = jax.device_get(jax.jit(jax.vmap(lambda key: sac.buffer_sample(buffer, key, batch)))(keys))
    slots = draws.reward.astype(int).ravel()
    np.testing.assert_array_equal(draws.obs[..., 0], draws.reward)  # whole transitions, fields together
    counts = np.bincount(slots, minlength=capacity)
    assert counts[size:].sum() == 0  # never an empty slot
    expected = len(slots) / size
    chi2 = ((counts[:size] - expected) ** 2 / expected).sum()
    assert chi2 < 39 + 5 * math.sqrt(2 * 39), chi2  # 39 degrees of freedom: mean 39, sd 8.8
    assert (np.asarray([len(set(row)) for row in draws.reward]) < batch).all()  # with replacement
