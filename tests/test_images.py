"""Images: observations keep their shape and dtype through VecEnv, each file's runner (episodes, rollout
transitions, replay buffer), its evaluation and `make_act`, on an image env (MinAtar's Breakout: 10x10x4
channels); a network reads them through its Torso, which flattens them (a vector env reshaped trains
exactly as the vector) or convolves them first (--network cnn, nature_cnn: the discrete-action files),
with convolutions that equal nn.Conv's, reading uint8 images as pixels in [0, 1]."""

import flax.linen as nn
import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from specs import SPECS

from conftest import load_algorithm

IMAGE_ENV = "Breakout-MinAtar"
# The single-agent files with discrete actions (a multi-agent file takes JaxMARL's envs only).
DISCRETE = [name for name, spec in SPECS.items() if load_algorithm(name).ACTIONS == "discrete" and not spec.multi_agent]


def test_vecenv_keeps_an_image_observation(ppo):
    venv, (env, params) = ppo.VecEnv(IMAGE_ENV, 3), gymnax.make(IMAGE_ENV)
    own = env.reset(jax.random.PRNGKey(0), params)[0]
    assert venv.obs_shape == own.shape == (10, 10, 4) and venv.obs_dtype == own.dtype
    obs, state = venv.reset(jax.random.PRNGKey(0))
    step = venv.step(jax.random.PRNGKey(1), state, jnp.zeros(3, jnp.int32))
    for x in (obs, step.obs, step.final_obs):
        assert x.shape == (3, 10, 10, 4) and x.dtype == own.dtype


@pytest.mark.parametrize("name", DISCRETE)
def test_an_image_env_keeps_its_shape_through_the_run(name):
    """Every observation array a run holds is [..., 10, 10, 4] in the env's dtype (traced only: nothing compiles)."""
    algo = load_algorithm(name)
    config = algo.Config(**{**SPECS[name].train_config, "env_name": IMAGE_ENV})
    train = algo.make_train(config)
    runner, _ = jax.eval_shape(train, jax.random.PRNGKey(0))
    found = [
        leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(runner)
        if jax.tree_util.keystr(path).endswith(("obs", "obs']", ".obs"))
    ]
    assert found, "the runner holds observations"
    for leaf in found:
        assert leaf.shape[-3:] == (10, 10, 4) and leaf.dtype == algo.VecEnv(IMAGE_ENV, 1).obs_dtype, leaf
    params = algo.saved_params(runner)
    obs = jnp.zeros((10, 10, 4), algo.VecEnv(IMAGE_ENV, 1).obs_dtype)
    act = algo.make_act(config)
    memory = getattr(act, "memory", None)
    if getattr(act, "reads_state", False):  # a planner's act searches from the env's state
        env = algo.VecEnv(IMAGE_ENV, 1)
        obs = (obs, jax.tree.map(lambda x: x[0], env.reset(jax.random.PRNGKey(0))[1]))
    args = (params, obs, jax.random.PRNGKey(1)) + ((memory,) if memory is not None else ())
    action = jax.eval_shape(act, *args)
    assert (action[0] if memory is not None else action).shape == ()
    assert jax.eval_shape(algo.make_evaluate(config), params, jax.random.PRNGKey(2)).shape == ()


class Reshaped(gymnax.environments.environment.Environment):
    """CartPole whose observation is its 4 numbers as a [2, 2] array."""

    def __init__(self):
        super().__init__()
        self.inner, _ = gymnax.make("CartPole-v1")

    @property
    def default_params(self):
        return self.inner.default_params

    def step_env(self, key, state, action, params):
        obs, state, reward, done, info = self.inner.step_env(key, state, action, params)
        return obs.reshape(2, 2), state, reward, done, info

    def reset_env(self, key, params):
        obs, state = self.inner.reset_env(key, params)
        return obs.reshape(2, 2), state

    def get_obs(self, state, params=None, key=None):
        return self.inner.get_obs(state, params, key).reshape(2, 2)

    def is_terminal(self, state, params):
        return self.inner.is_terminal(state, params)

    def action_space(self, params=None):
        return self.inner.action_space(params)

    def observation_space(self, params):
        space = self.inner.observation_space(params)
        return gymnax.environments.spaces.Box(space.low, space.high, (2, 2), space.dtype)


@pytest.mark.parametrize("name", ["ppo", "dqn"])
def test_a_reshaped_vector_env_trains_exactly_as_the_vector(name):
    """The network's Torso flattens [2, 2] to the 4 numbers the vector env gives: same run, bit for bit."""
    if "CartPole-2x2" not in gymnax.registered_envs:
        gymnax.register("CartPole-2x2", lambda **kwargs: Reshaped())
    algo = load_algorithm(name)
    runs = {}
    for env_name in ("CartPole-v1", "CartPole-2x2"):
        config = algo.Config(**{**SPECS[name].train_config, "env_name": env_name})
        runs[env_name] = jax.device_get(jax.jit(algo.make_train(config))(jax.random.PRNGKey(5)))
    (vector_runner, vector_metrics), (image_runner, image_metrics) = runs.values()
    assert algo.VecEnv("CartPole-2x2", 1).obs_shape == (2, 2)
    for key, value in vector_metrics.items():
        np.testing.assert_array_equal(image_metrics[key], value, err_msg=key)
    for got, want in zip(jax.tree.leaves(image_runner.params), jax.tree.leaves(vector_runner.params), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("patches", [True, False], ids=["patches", "lax.conv"])
@pytest.mark.parametrize("features, size, stride, image", [(16, 3, 1, (10, 10, 4)), (32, 8, 4, (84, 84, 4))])
def test_conv_equals_flax_conv(ppo, patches, features, size, stride, image):
    """The torso's convolution (a matmul on patches on CPU: docs/speed-tricks.md) equals nn.Conv without
    padding on the same parameters, and has its parameters' shapes."""
    x = jax.random.normal(jax.random.PRNGKey(0), (3, *image))
    flax_conv = nn.Conv(features, (size, size), (stride, stride), padding="VALID")
    params = flax_conv.init(jax.random.PRNGKey(1), x)
    ours = ppo.Conv(features, size, stride, patches=patches)
    assert jax.tree.map(jnp.shape, ours.init(jax.random.PRNGKey(1), x)) == jax.tree.map(jnp.shape, params)
    np.testing.assert_allclose(ours.apply(params, x), flax_conv.apply(params, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("network", ["mlp", "cnn"])
def test_a_torso_reads_bytes_as_pixels_only_when_it_convolves(ppo, network):
    """uint8 observations (Atari's frames) enter a convolutional torso scaled to [0, 1]; the MLP's torso reads
    them as numbers (XLand-MiniGrid's grids are tile ids, not brightness)."""
    image = jax.random.randint(jax.random.PRNGKey(0), (2, 10, 10, 4), 0, 256).astype(jnp.uint8)
    torso = ppo.Torso(network, (10, 10, 4))
    params = torso.init(jax.random.PRNGKey(1), image)
    scale = 255.0 if network == "cnn" else 1.0
    want = torso.apply(params, image.astype(jnp.float32) / scale)
    np.testing.assert_allclose(torso.apply(params, image), want, rtol=1e-6, atol=1e-6)


def test_a_cnn_run_equals_that_seed_alone():
    """ppo.py --network cnn on MinAtar's Breakout: a seed in a batch of two equals it alone (tests/test_train.py
    shows the same seed twice is identical, for every file's MLP)."""
    algo = load_algorithm("ppo")
    config = algo.Config(**{**SPECS["ppo"].train_config, "env_name": IMAGE_ENV, "network": "cnn"})
    train, keys = algo.make_train(config), jax.random.split(jax.random.PRNGKey(6), 2)
    alone, batch = jax.device_get((jax.jit(train)(keys[0]), jax.jit(jax.vmap(train))(keys)))
    assert "Conv_0" in str(jax.tree_util.tree_structure(algo.saved_params(alone[0])))
    for got, want in zip(jax.tree.leaves(batch), jax.tree.leaves(alone), strict=True):
        np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-6)
