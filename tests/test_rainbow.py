"""rainbow.py's parts against plain NumPy on hand-made buffers and batches: the n-step returns made at sampling
time (terminations, time-limit truncations and the newest write inside the window, a buffer that wrapped around),
proportional prioritised sampling (frequencies and importance weights against their formulas, the priority update),
factorised noisy layers (the noise's shapes, the layer against its formula, greedy evaluation deterministic), the
dueling head, and the loss with n-step discounts and importance weights. The loss's gradient is JAX's autodiff of
that loss (nothing hand-written), checked only to flow through the online network alone."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from specs import SPECS

from conftest import load_algorithm, numpy_mlp

NUM_ACTIONS, OBS_DIM, NUM_ENVS = 3, 4, 3
V_MIN, V_MAX, ATOMS = -10.0, 10.0, 11  # dz = 2
THREE_ACTIONS = types.SimpleNamespace(num_actions=NUM_ACTIONS, obs_shape=(OBS_DIM,))  # what make_act reads of an env


def bound_td_loss(module, config, network):
    """module.td_loss with the config and network bound, taking the Q-network's own parameters (not {"q": ...})."""
    networks = module.Networks(q=network)
    return lambda online, target, *rest: module.td_loss(config, networks, {"q": online}, {"q": target}, *rest)


@pytest.fixture(scope="module")
def rainbow():
    return load_algorithm("rainbow")


# --------------------------------------------------------------------------------------
# n-step returns
# --------------------------------------------------------------------------------------
def env_steps(steps, seed=0):
    """[steps, NUM_ENVS] one-step transitions, every field random; episode ends on purpose: env 0 terminates at
    t=2 and is truncated at t=6, env 1 is truncated at t=3 and terminates at t=4 (back to back), env 2 terminates
    and is truncated at the same step t=5; the last steps have no end, so windows there reach the newest write."""
    rng = np.random.default_rng(seed)
    terminated, truncated = np.zeros((steps, NUM_ENVS), bool), np.zeros((steps, NUM_ENVS), bool)
    terminated[[2, 4, 5], [0, 1, 2]] = True
    truncated[[6, 3, 5], [0, 1, 2]] = True
    return dict(
        obs=rng.normal(size=(steps, NUM_ENVS, OBS_DIM)).astype(np.float32),
        action=rng.integers(0, NUM_ACTIONS, (steps, NUM_ENVS)).astype(np.int32),
        reward=rng.normal(size=(steps, NUM_ENVS)).astype(np.float32),
        terminated=terminated,
        truncated=truncated,
        final_obs=rng.normal(size=(steps, NUM_ENVS, OBS_DIM)).astype(np.float32),
    )


def filled_buffer(rainbow, data, capacity):
    """The steps written as training writes them: one vectorized step's NUM_ENVS transitions at a time."""
    add, buffer = jax.jit(rainbow.buffer_add), rainbow.buffer_init(capacity, (OBS_DIM,), jnp.float32)
    for t in range(len(data["reward"])):
        buffer = add(buffer, rainbow.Transition(**{name: value[t] for name, value in data.items()}))
    return buffer


def reference_n_step(data, t, e, n, gamma):
    """The n-step transition from env e's step t, one step at a time: rewards summed until the first step that
    terminated or was truncated (included) or the newest step; then (return, gamma^m (1 - terminated), next obs)."""
    total, m, steps = 0.0, 0, len(data["reward"])
    for k in range(n):
        if t + k >= steps:
            break
        total += gamma**k * float(data["reward"][t + k, e])
        m, last = k + 1, t + k
        if data["terminated"][last, e] or data["truncated"][last, e]:
            break
    discount = 0.0 if data["terminated"][last, e] else gamma**m
    return total, discount, data["final_obs"][last, e]


@pytest.mark.parametrize("capacity", [60, 28])  # 28: wrapped around, and not a multiple of num_envs
@pytest.mark.parametrize("n_step", [1, 3, 5])
def test_n_step_batch_matches_reference(rainbow, capacity, n_step):
    steps, gamma = 12, 0.9
    steps_data = env_steps(steps)
    buffer = filled_buffer(rainbow, steps_data, capacity)
    writes = steps * NUM_ENVS
    kept = np.arange(max(0, writes - capacity), writes)  # write number w = t * NUM_ENVS + e sits in slot w % capacity
    slots = jnp.asarray(kept % capacity, jnp.int32)
    batch = jax.jit(rainbow.n_step_batch, static_argnums=(2, 3))(buffer, slots, n_step, NUM_ENVS, jnp.float32(gamma))
    for i, w in enumerate(kept):
        t, e = divmod(int(w), NUM_ENVS)
        want_return, want_discount, want_next = reference_n_step(steps_data, t, e, n_step, gamma)
        np.testing.assert_allclose(batch.reward[i], want_return, rtol=1e-5, atol=1e-6, err_msg=f"t={t}, env {e}")
        np.testing.assert_allclose(batch.discount[i], want_discount, rtol=1e-6, err_msg=f"t={t}, env {e}")
        np.testing.assert_array_equal(batch.next_obs[i], want_next, err_msg=f"t={t}, env {e}")
        np.testing.assert_array_equal(batch.obs[i], steps_data["obs"][t, e])
        assert batch.action[i] == steps_data["action"][t, e]
    if n_step == 3:  # the cases the patterns were made for, spelled out
        index = {(int(w) // NUM_ENVS, int(w) % NUM_ENVS): i for i, w in enumerate(kept)}
        r = steps_data["reward"]
        if (1, 0) in index:  # env 0 terminates at t=2: two rewards, no bootstrap
            i = index[1, 0]
            np.testing.assert_allclose(batch.reward[i], r[1, 0] + gamma * r[2, 0], rtol=1e-5)
            assert batch.discount[i] == 0.0
        i = index[5, 0]  # env 0 truncated at t=6: bootstraps from t=6's final obs with gamma^2
        np.testing.assert_allclose(batch.discount[i], gamma**2, rtol=1e-6)
        np.testing.assert_array_equal(batch.next_obs[i], steps_data["final_obs"][6, 0])
        i = index[steps - 2, 1]  # one newer step written: a 2-step return
        np.testing.assert_allclose(batch.discount[i], gamma**2, rtol=1e-6)
        np.testing.assert_array_equal(batch.next_obs[i], steps_data["final_obs"][steps - 1, 1])


# --------------------------------------------------------------------------------------
# Prioritised replay
# --------------------------------------------------------------------------------------
def prioritized_buffer(rainbow, capacity=64, size=50, seed=0):
    """A buffer of `size` filled slots (of `capacity`) with random priorities."""
    priority = np.zeros(capacity, np.float32)
    priority[:size] = np.random.default_rng(seed).uniform(0.01, 3.0, size)
    buffer = rainbow.buffer_init(capacity, (OBS_DIM,), jnp.float32)
    return buffer._replace(priority=jnp.asarray(priority), size=jnp.int32(size), position=jnp.int32(size))


def test_prioritized_sampling_frequencies_follow_priority_to_the_alpha(rainbow):
    alpha, beta, batch_size, draws = 0.6, 0.5, 32, 4000
    buffer = prioritized_buffer(rainbow)
    sample = jax.jit(jax.vmap(rainbow.prioritized_slots, (None, 0, None, None, None)), static_argnums=2)
    slots, _ = sample(buffer, jax.random.split(jax.random.PRNGKey(0), draws), batch_size, alpha, beta)
    counts = np.bincount(np.asarray(slots).ravel(), minlength=64)
    assert counts[50:].sum() == 0, "an unfilled slot was drawn"
    p = np.asarray(buffer.priority[:50], np.float64) ** alpha
    expected = draws * batch_size * p / p.sum()
    chi2 = ((counts[:50] - expected) ** 2 / expected).sum()
    assert chi2 < 49 + 6 * np.sqrt(2 * 49), chi2  # 49 degrees of freedom: mean 49, sd ~9.9
    wrong = draws * batch_size * np.asarray(buffer.priority[:50]) / float(buffer.priority.sum())  # alpha ignored
    assert ((counts[:50] - wrong) ** 2 / wrong).sum() > 10 * chi2


def test_importance_weights_match_their_formula(rainbow):
    alpha, beta, batch_size = 0.7, 0.4, 16
    buffer = prioritized_buffer(rainbow, seed=1)
    slots, weights = jax.jit(rainbow.prioritized_slots, static_argnums=2)(
        buffer, jax.random.PRNGKey(3), batch_size, alpha, beta
    )
    p = np.asarray(buffer.priority[:50], np.float64) ** alpha
    probs = p[np.asarray(slots)] / p.sum()
    want = (50 * probs) ** -beta
    np.testing.assert_allclose(weights, want / want.max(), rtol=1e-5)
    assert float(np.max(weights)) == 1.0
    # Strata: one draw in each 1/batch of the cumulative mass, so the slots come out in order.
    assert (np.diff(np.asarray(slots)) >= 0).all()


def test_priority_update_and_new_transitions_at_the_max(rainbow):
    buffer = prioritized_buffer(rainbow, capacity=8, size=5)
    buffer = buffer._replace(max_priority=jnp.float32(3.0))
    updated = rainbow.buffer_prioritize(buffer, jnp.array([1, 3]), jnp.array([0.25, 7.5]))
    want = np.asarray(buffer.priority).copy()
    want[[1, 3]] = [0.25, 7.5]
    np.testing.assert_array_equal(updated.priority, want)
    assert float(updated.max_priority) == 7.5
    lowered = rainbow.buffer_prioritize(updated, jnp.array([3]), jnp.array([0.5]))
    assert float(lowered.max_priority) == 7.5  # the max so far, not the current max
    data = rainbow.Transition(
        obs=jnp.zeros((2, OBS_DIM)),
        action=jnp.zeros(2, jnp.int32),
        reward=jnp.zeros(2),
        terminated=jnp.zeros(2, bool),
        truncated=jnp.zeros(2, bool),
        final_obs=jnp.zeros((2, OBS_DIM)),
    )
    added = rainbow.buffer_add(lowered, data)
    np.testing.assert_array_equal(added.priority[5:7], [7.5, 7.5])
    np.testing.assert_array_equal(added.priority[:5], lowered.priority[:5])


# --------------------------------------------------------------------------------------
# Networks: noisy layers and the dueling head
# --------------------------------------------------------------------------------------
def network_and_params(rainbow, **changes):
    config = rainbow.Config(hidden_size=8, num_layers=2, num_atoms=ATOMS, v_min=V_MIN, v_max=V_MAX, **changes)
    network = rainbow.make_networks(config, NUM_ACTIONS, (OBS_DIM,)).q
    params = jax.device_get(network.init(jax.random.PRNGKey(0), jnp.zeros((1, OBS_DIM))))
    return config, network, params


def numpy_noisy(params, noise, x, dueling):
    """The noisy network's forward pass in float64 NumPy, each layer W = mu + sigma * outer(f_in, f_out), b = mu_b +
    sigma_b * f_out (or the means where `noise` is None): [n, NUM_ACTIONS, ATOMS] logits."""
    layers, x = params["params"], np.asarray(x, np.float64)

    def layer(name, y):
        p = {k: np.asarray(v, np.float64) for k, v in layers[name].items()}
        if noise is None:
            return y @ p["kernel"] + p["bias"]
        f_in, f_out = (np.asarray(v, np.float64) for v in noise[name]["noise"][0])
        return y @ (p["kernel"] + p["kernel_sigma"] * np.outer(f_in, f_out)) + p["bias"] + p["bias_sigma"] * f_out

    for i in range(2):
        x = np.maximum(layer(f"NoisyDense_{i}", x), 0.0)
    advantage = layer("NoisyDense_2", x).reshape(len(x), NUM_ACTIONS, ATOMS)
    if not dueling:
        return advantage
    value = layer("NoisyDense_3", x)
    return value[:, None, :] + advantage - advantage.mean(1, keepdims=True)


def test_factorised_noise_has_an_input_and_an_output_vector_per_layer(rainbow):
    config, network, params = network_and_params(rainbow, noisy=True, dueling=True)
    obs = np.random.default_rng(0).normal(size=(5, OBS_DIM)).astype(np.float32)
    logits, state = network.apply(params, obs, True, rngs={"noise": jax.random.PRNGKey(1)}, mutable=["intermediates"])
    noise = jax.device_get(state["intermediates"])
    fan = {"NoisyDense_0": (OBS_DIM, 8), "NoisyDense_1": (8, 8), "NoisyDense_2": (8, 33), "NoisyDense_3": (8, 11)}
    assert set(noise) == set(fan)
    for name, (fan_in, fan_out) in fan.items():
        (f_in, f_out) = noise[name]["noise"][0]
        assert f_in.shape == (fan_in,) and f_out.shape == (fan_out,), name
        assert params["params"][name]["kernel_sigma"].shape == (fan_in, fan_out)
        np.testing.assert_allclose(params["params"][name]["kernel_sigma"], 0.5 / np.sqrt(fan_in), rtol=1e-6)
    np.testing.assert_allclose(logits, numpy_noisy(params, noise, obs, dueling=True), rtol=1e-4, atol=1e-5)
    f = np.asarray(rainbow.factorised_noise(jax.random.PRNGKey(2), 3000, 1)[0], np.float64)
    assert np.all(np.abs(f) > 0) and abs(np.mean(f**2) - np.sqrt(2 / np.pi)) < 0.05  # E|x| of a standard normal


def test_noise_changes_with_the_key_and_greedy_evaluation_is_deterministic(rainbow):
    config, network, params = network_and_params(rainbow, noisy=True, dueling=True)
    obs = np.random.default_rng(1).normal(size=(7, OBS_DIM)).astype(np.float32)
    noisy = [np.asarray(rainbow.logits_of(network, params, obs, jax.random.PRNGKey(k))) for k in (0, 1)]
    assert np.abs(noisy[0] - noisy[1]).max() > 1e-3
    mean = np.asarray(rainbow.logits_of(network, params, obs))
    np.testing.assert_allclose(mean, numpy_noisy(params, None, obs, dueling=True), rtol=1e-4, atol=1e-5)
    # make_act: greedy is the argmax of the mean weights' Q-values, whatever the key.
    greedy = jax.jit(jax.vmap(rainbow.make_act(config, greedy=True, env=THREE_ACTIONS), (None, 0, 0)))
    q = softmax(numpy_noisy(params, None, obs, dueling=True)) @ np.linspace(V_MIN, V_MAX, ATOMS)
    for k in range(3):
        actions = greedy({"q": params}, obs, jax.random.split(jax.random.PRNGKey(k), len(obs)))
        np.testing.assert_array_equal(actions, q.argmax(-1))
    sampling = jax.jit(jax.vmap(rainbow.make_act(config, greedy=False, env=THREE_ACTIONS), (None, None, 0)))
    actions = sampling({"q": params}, obs[0], jax.random.split(jax.random.PRNGKey(0), 64))
    assert len(np.unique(np.asarray(actions))) > 1, "the noise never changed the action"


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_dueling_combination(rainbow):
    rng = np.random.default_rng(0)
    value, advantage = rng.normal(size=(5, ATOMS)), rng.normal(size=(5, NUM_ACTIONS, ATOMS))
    got = np.asarray(rainbow.dueling(jnp.float32(value), jnp.float32(advantage)))
    for b in range(5):
        for a in range(NUM_ACTIONS):
            want = value[b] + advantage[b, a] - sum(advantage[b, c] for c in range(NUM_ACTIONS)) / NUM_ACTIONS
            np.testing.assert_allclose(got[b, a], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.mean(1), value, rtol=1e-5, atol=1e-6)  # the mean over actions is the value
    config, network, params = network_and_params(rainbow, noisy=False, dueling=True)
    obs = rng.normal(size=(4, OBS_DIM)).astype(np.float32)
    layers = params["params"]
    hidden = np.maximum(numpy_mlp({"params": {k: layers[k] for k in ("Dense_0", "Dense_1")}}, obs), 0)
    dense = lambda name: hidden @ np.float64(layers[name]["kernel"]) + np.float64(layers[name]["bias"])  # noqa: E731
    want = dense("Dense_3")[:, None] + dense("Dense_2").reshape(4, NUM_ACTIONS, ATOMS)
    want -= dense("Dense_2").reshape(4, NUM_ACTIONS, ATOMS).mean(1, keepdims=True)
    np.testing.assert_allclose(network.apply(params, obs), want, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------
# The loss
# --------------------------------------------------------------------------------------
def reference_projection(probs, shifted):
    """Bellemare et al. 2017, Algorithm 1, one shifted atom at a time."""
    dz = (V_MAX - V_MIN) / (ATOMS - 1)
    m = np.zeros(ATOMS)
    for j in range(ATOMS):
        b = (min(max(float(shifted[j]), V_MIN), V_MAX) - V_MIN) / dz
        lower, upper = int(np.floor(b)), int(np.ceil(b))
        m[lower] += probs[j] * (upper - b if lower != upper else 1.0)
        if lower != upper:
            m[upper] += probs[j] * (b - lower)
    return m


@pytest.mark.parametrize("double", [False, True])
def test_loss_with_n_step_discounts_and_importance_weights(rainbow, double):
    """Without noise or dueling the network is c51.py's MLP: the target's atoms shift to reward + discount * z
    (the n-step return and gamma^m, 0 after a termination); the loss is the weighted mean cross entropy."""
    config, network, online = network_and_params(rainbow, noisy=False, dueling=False, double_dqn=double)
    target = jax.device_get(network.init(jax.random.PRNGKey(1), jnp.zeros((1, OBS_DIM))))
    rng, n = np.random.default_rng(0), 24
    batch = rainbow.Batch(
        obs=rng.normal(size=(n, OBS_DIM)).astype(np.float32),
        action=rng.integers(0, NUM_ACTIONS, n).astype(np.int32),
        reward=(3 * rng.normal(size=n)).astype(np.float32),
        discount=np.where(np.arange(n) % 4 == 0, 0.0, 0.9 ** (1 + np.arange(n) % 3)).astype(np.float32),
        next_obs=rng.normal(size=(n, OBS_DIM)).astype(np.float32),
        weight=rng.uniform(0.1, 1.0, n).astype(np.float32),
    )
    loss, aux = jax.jit(bound_td_loss(rainbow, config, network))(
        online, target, batch, rainbow.hparams_from(config), jax.random.PRNGKey(0)
    )
    atoms = np.linspace(V_MIN, V_MAX, ATOMS)
    heads = lambda params, x: numpy_mlp(params, x).reshape(len(x), NUM_ACTIONS, ATOMS)  # noqa: E731
    losses = []
    for b in range(n):
        next_probs = softmax(heads(target, batch.next_obs[b : b + 1])[0])
        chooser = softmax(heads(online, batch.next_obs[b : b + 1])[0]) if double else next_probs
        m = reference_projection(next_probs[np.argmax(chooser @ atoms)], batch.reward[b] + batch.discount[b] * atoms)
        np.testing.assert_allclose(aux["target"][b], m, atol=1e-5)
        logits = heads(online, batch.obs[b : b + 1])[0, batch.action[b]]
        losses.append(-(m * (logits - logits.max() - np.log(np.exp(logits - logits.max()).sum()))).sum())
    np.testing.assert_allclose(aux["cross_entropy"], losses, rtol=1e-4, atol=1e-5)
    assert float(loss) == pytest.approx(float(np.mean(batch.weight * np.array(losses))), rel=1e-5)
    td_loss, hp = bound_td_loss(rainbow, config, network), rainbow.hparams_from(config)
    grads = jax.grad(lambda p, t: td_loss(p, t, batch, hp, jax.random.PRNGKey(0))[0], argnums=(0, 1))(online, target)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(grads[1]))


def test_noisy_loss_draws_its_noise_from_the_key(rainbow):
    config, network, online = network_and_params(rainbow, noisy=True, dueling=True)
    rng, n = np.random.default_rng(1), 8
    batch = rainbow.Batch(
        obs=rng.normal(size=(n, OBS_DIM)).astype(np.float32),
        action=rng.integers(0, NUM_ACTIONS, n).astype(np.int32),
        reward=rng.normal(size=n).astype(np.float32),
        discount=np.full(n, 0.9, np.float32),
        next_obs=rng.normal(size=(n, OBS_DIM)).astype(np.float32),
        weight=np.ones(n, np.float32),
    )
    td_loss = jax.jit(bound_td_loss(rainbow, config, network))
    hp = rainbow.hparams_from(config)
    losses = [float(td_loss(online, online, batch, hp, jax.random.PRNGKey(k))[0]) for k in (0, 0, 1)]
    assert losses[0] == losses[1] and losses[0] != losses[2]


def test_training_updates_priorities(rainbow):
    """A short run (the shared tests' small config): sampled slots got their loss + priority_eps in place of the
    max priority they were written with, and the max priority is the largest given."""
    config = rainbow.Config(**SPECS["rainbow"].train_config)
    runner, metrics = jax.jit(rainbow.make_train(config))(jax.random.PRNGKey(0))
    priority = np.asarray(runner.buffer.priority)
    assert np.isfinite(priority).all() and (priority > 0).all()
    assert (priority != float(runner.buffer.max_priority)).any(), "no priority was ever updated"
    assert priority.max() <= float(runner.buffer.max_priority)
