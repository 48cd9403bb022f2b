"""td3.py: the TD target with target policy smoothing and the twin minimum against NumPy on a
hand-made batch with terminations and truncations, the smoothing noise's clip, the policy-delay
schedule (actor steps == critic steps // policy_delay exactly, for a num_envs that does not
divide the train interval), one critic step and one actor step (Adam on the parameter trees, the
Polyak update of both targets) on tests/specs/td3.py's train_config, and the DDPG setting. The small
program is compiled once per session (conftest's `single`), shared with tests/test_train.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from conftest import load_algorithm, numpy_mlp

td3 = load_algorithm("td3")


@pytest.fixture(scope="module")
def name():
    """The algorithm whose small config conftest's config/train/single/batched fixtures build."""
    return "td3"


def numpy_critics(critics, obs, action):
    count = jax.tree.leaves(critics)[0].shape[0]
    x = np.concatenate([obs, action], -1)
    return np.stack([numpy_mlp(jax.tree.map(lambda p: p[i], critics), x)[:, 0] for i in range(count)])


@pytest.fixture(scope="module")
def setup():
    """Small networks, target networks of their own, and 48 transitions: continuing, truncated
    (not terminated; final_obs is the cut-off state) and terminated, in turn."""
    config = td3.Config(hidden_size=16)
    networks = td3.make_networks(config, 1, (3,))
    obs0, action0 = jnp.zeros((1, 3)), jnp.zeros((1, 1))
    init_critics = jax.vmap(networks.critic.init, in_axes=(0, None, None))

    def params(seed):
        actor_key, critic_key = jax.random.split(jax.random.PRNGKey(seed))
        return jax.device_get(
            {
                "actor": networks.actor.init(actor_key, obs0),
                "critic": init_critics(jax.random.split(critic_key, 2), obs0, action0),
            }
        )

    rng = np.random.default_rng(0)
    n = 48
    kind = np.arange(n) % 3  # 0 continuing, 1 truncated, 2 terminated
    batch = td3.Transition(
        obs=rng.normal(size=(n, 3)).astype(np.float32),
        action=rng.uniform(-1, 1, (n, 1)).astype(np.float32),
        reward=rng.normal(size=n).astype(np.float32),
        terminated=kind == 2,
        final_obs=(2 * rng.normal(size=(n, 3))).astype(np.float32),
    )
    key = jax.random.PRNGKey(3)  # the critic loss's: it draws the smoothing noise
    return config, networks, params(0), params(1), batch, key, kind


def test_td_target_with_smoothing_matches_numpy(setup):
    """y = r + gamma * (1 - terminated) * min_i Q_target_i(s', clip(mu_target(s') + clip(sigma * eps,
    -c, c), -1, 1)), eps drawn from the loss's key; the critics regress on it with 0.5 * sum over critics of
    the MSE."""
    config, networks, online, target, batch, key, kind = setup
    gamma, sigma, clip = 0.9, 0.4, 0.5  # a wide sigma: the clip at noise_clip binds often
    hparams = td3.hparams_from(config)._replace(
        gamma=jnp.float32(gamma), policy_noise=jnp.float32(sigma), noise_clip=jnp.float32(clip)
    )
    loss, aux = jax.device_get(td3.critic_loss(config, networks, online["critic"], target, batch, hparams, key))
    smoothing = np.asarray(jax.random.normal(key, (len(batch.reward), 1)))  # what the loss draws
    target_action = np.tanh(numpy_mlp(target["actor"], batch.final_obs))
    smoothed = np.clip(target_action + np.clip(sigma * smoothing, -clip, clip), -1, 1)
    assert (np.abs(sigma * smoothing) > clip).any()
    next_q = numpy_critics(target["critic"], batch.final_obs, smoothed)
    assert len({bool(b) for b in next_q[0] < next_q[1]}) == 2  # the minimum picks either critic
    want = batch.reward + gamma * np.where(batch.terminated, 0.0, next_q.min(0))
    np.testing.assert_allclose(aux["target"], want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(aux["target"][kind == 2], batch.reward[kind == 2])
    q = numpy_critics(online["critic"], batch.obs, batch.action)
    np.testing.assert_allclose(loss, 0.5 * ((q - want) ** 2).mean(-1).sum(), rtol=1e-4)
    # Truncated and continuing transitions bootstrap from final_obs; terminated ones never do.
    moved = batch._replace(final_obs=batch.final_obs + 1.0)
    changed = jax.device_get(td3.critic_loss(config, networks, online["critic"], target, moved, hparams, key))
    np.testing.assert_array_equal(changed[1]["target"][kind == 2], aux["target"][kind == 2])
    assert (changed[1]["target"][kind != 2] != aux["target"][kind != 2]).all()


def test_actor_loss_uses_the_first_critic(setup):
    config, networks, online, _, batch, key, _ = setup
    hparams = td3.hparams_from(config)
    loss = float(td3.actor_loss(config, networks, online["actor"], online["critic"], batch.obs, hparams, key))
    action = np.tanh(numpy_mlp(online["actor"], batch.obs))
    q = numpy_critics(online["critic"], batch.obs, action)
    assert loss == pytest.approx(-q[0].mean(), rel=1e-5)


def test_critic_and_actor_steps_on_the_parameter_trees(setup):
    """A critic step moves the critics only (Adam on their tree, as on their flat vector); an actor
    step then moves the actor only and both targets become tau * online + (1 - tau) * targets."""
    config, networks, online, target, batch, key, _ = setup
    hparams = td3.hparams_from(config)._replace(tau=jnp.float32(0.3))
    adam = td3.make_optimizer(config, hparams)
    opt_state = {name: adam.init(online[name]) for name in ("actor", "critic")}
    runner = td3.Runner(online, target, opt_state, buffer=None, episodes=None, rng=None, hparams=hparams)
    sums = dict.fromkeys(td3.LOGGED, jnp.float32(0))
    critic_key, actor_key = jax.random.split(key)
    after_critic, sums = jax.jit(td3.critic_step, static_argnums=(0, 1))(
        config, networks, runner, sums, batch, critic_key
    )
    flat, unravel = ravel_pytree(online["critic"])
    loss = lambda flat: td3.critic_loss(config, networks, unravel(flat), target, batch, hparams, critic_key)[0]  # noqa: E731
    grads = jax.grad(loss)(flat)
    want = unravel(flat + adam.update(grads, adam.init(flat))[0])
    close = lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)  # noqa: E731
    jax.tree.map(close, after_critic.params["critic"], want)
    jax.tree.map(np.testing.assert_array_equal, after_critic.params["actor"], online["actor"])
    jax.tree.map(np.testing.assert_array_equal, after_critic.target_params, target)
    assert float(sums["loss"]) == pytest.approx(float(loss(flat)), rel=1e-6) and float(sums["actor_loss"]) == 0
    assert float(sums["grad_norm"]) == pytest.approx(float(np.linalg.norm(grads)), rel=1e-5)

    after_actor, sums = jax.jit(td3.actor_step, static_argnums=(0, 1))(
        config, networks, after_critic, sums, batch.obs, actor_key
    )
    jax.tree.map(np.testing.assert_array_equal, after_actor.params["critic"], after_critic.params["critic"])
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), after_actor.params["actor"], online["actor"])
    assert all(jax.tree.leaves(moved))
    polyak = lambda online, old: 0.3 * np.float64(online) + 0.7 * np.float64(old)  # noqa: E731
    jax.tree.map(close, after_actor.target_params, jax.tree.map(polyak, after_actor.params, target))
    actor_loss = td3.actor_loss(
        config, networks, after_critic.params["actor"], after_critic.params["critic"], batch.obs, hparams, actor_key
    )
    assert float(sums["actor_loss"]) == pytest.approx(float(actor_loss), rel=1e-6)


def test_smoothing_noise_never_exceeds_the_clip():
    """Whatever the noise, the smoothed action stays within noise_clip (a fraction of the half range)
    of the target actor's action, and within [-1, 1]; in env units within 0.5 half ranges."""
    hparams = td3.hparams_from(td3.Config())
    assert float(hparams.policy_noise) == pytest.approx(0.2) and float(hparams.noise_clip) == pytest.approx(0.5)
    noise = jnp.asarray(np.random.default_rng(0).normal(size=(10_000, 2)) * 10, jnp.float32)
    target = jnp.zeros((10_000, 2))
    smoothed = np.asarray(td3.smoothed_target_action(target, noise, hparams))
    assert np.abs(smoothed).max() == pytest.approx(0.5) and (np.abs(smoothed) <= 0.5).all()
    np.testing.assert_allclose(smoothed, np.clip(0.2 * np.asarray(noise), -0.5, 0.5), rtol=1e-6)
    scale = td3.ActionScale(centre=jnp.array([0.0, 1.0]), half_range=jnp.array([2.0, 2.0]))  # [-2, 2] and [-1, 3]
    gap = np.abs(np.asarray(scale(jnp.asarray(smoothed))) - np.asarray(scale(target)))
    assert (gap <= 0.5 * np.asarray(scale.half_range) + 1e-6).all()
    # Near the bounds the sum is clipped back into [-1, 1]; no noise: the target action itself.
    near = np.asarray(td3.smoothed_target_action(jnp.full((10_000, 2), 0.9), noise, hparams))
    assert near.max() == 1.0 and near.min() >= 0.4 - 1e-6
    none = td3.smoothed_target_action(target + 0.3, noise, hparams._replace(policy_noise=jnp.float32(0.0)))
    np.testing.assert_array_equal(np.asarray(none), np.float32(0.3))


def reference_schedule(config):
    """Per update, counted one env step at a time: critic steps (gradient_steps at every multiple of
    train_frequency after learning_starts) and actor steps (after every policy_delay-th critic step)."""
    per_update = config.num_envs * config.num_steps
    critic, actor = np.zeros(config.num_updates, int), np.zeros(config.num_updates, int)
    taken = 0
    for s in range(1, config.num_updates * per_update + 1):
        if s % config.train_frequency == 0 and s > config.learning_starts:
            for _ in range(config.gradient_steps):
                taken += 1
                critic[(s - 1) // per_update] += 1
                actor[(s - 1) // per_update] += taken % config.policy_delay == 0
    return critic, actor


def adam_count(opt_state):
    counts = [
        leaf for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state) if "count" in jax.tree_util.keystr(path)
    ]
    return np.asarray(counts[0])


def test_policy_delay_schedule_for_any_num_envs(config, single):
    runner, metrics = single[0]
    assert config.num_envs % config.train_frequency and config.train_frequency % config.num_envs
    critic, actor = reference_schedule(config)
    assert critic[0] % config.policy_delay  # an actor step falls across the first update's boundary
    assert critic.sum() == td3.total_gradient_steps(config)
    assert actor.sum() == critic.sum() // config.policy_delay
    np.testing.assert_array_equal(metrics["gradient_steps"], critic)
    np.testing.assert_array_equal(metrics["actor_steps"], actor)
    # Each optimizer really took that many steps (Adam's own counters).
    np.testing.assert_array_equal(adam_count(runner.opt_state["critic"]), critic.sum())
    np.testing.assert_array_equal(adam_count(runner.opt_state["actor"]), actor.sum())
    np.testing.assert_array_equal(np.isnan(metrics["actor_loss"]), actor == 0)


def test_ddpg_setting_runs(config):
    """--num-critics 1 --policy-delay 1 --policy-noise 0: one critic, an actor step and target
    update after every critic step, no target smoothing; it trains without NaN."""
    ddpg = dataclasses.replace(config, num_critics=1, policy_delay=1, policy_noise=0.0)
    runner, metrics = jax.device_get(jax.jit(td3.make_train(ddpg))(jax.random.PRNGKey(0)))
    assert metrics["finite"].all()
    np.testing.assert_array_equal(metrics["actor_steps"], metrics["gradient_steps"])
    assert metrics["gradient_steps"].sum() == td3.total_gradient_steps(ddpg) > 0
    assert all(leaf.shape[0] == 1 for leaf in jax.tree.leaves(runner.params["critic"]))
    assert np.isfinite(metrics["loss"][metrics["gradient_steps"] > 0]).all()
