"""PQN (Parallelised Q-Network, Q(lambda)) for discrete-action gymnax environments, in one file.

    python algorithms/pqn.py                                  # CartPole-v1, 8 seeds
    python algorithms/pqn.py --env-name Acrobot-v1 --num-seeds 16 --lr 1e-3
    python algorithms/pqn.py --sweep lr=3e-4,1e-3 --sweep q-lambda=0.5,0.8
    python algorithms/pqn.py --help                           # every option, its meaning and default

PQN (Gallici et al., "Simplifying Deep Temporal Difference Learning", 2024) is Q-learning
without a replay buffer or a target network: many parallel envs act epsilon-greedily, the
rollout's Q(lambda) returns are computed once with the current network, and a LayerNorm
Q-network regresses onto them for a few epochs of shuffled minibatches, as PPO does.
The whole run (rollout, Q(lambda) returns, epochs of minibatch updates) is one jitted
function; seeds and sweep points are vmapped into the same compiled program:

    train = make_train(Config(env_name="CartPole-v1"))
    runner, metrics = jax.jit(jax.vmap(train))(jax.random.split(jax.random.PRNGKey(0), 8))

Each run writes config.json, summary.json, metrics.npz, params.msgpack and
learning_curve.png into a new directory under --runs-dir. Depends only on jax, flax,
optax, gymnax, chex, numpy and matplotlib; copy this file anywhere and it runs.
"""
import os

import pkgutil

# XLA flags, set before jax is imported; any flag already in XLA_FLAGS is left as it is.
# - XLA's CPU backend (jaxlib 0.10) can deadlock on these programs when several seeds are
#   vmapped; its older thread scheduler never did (it costs ~10-15% CPU throughput).
# - On CPU-only installs, backend optimisation level 1 compiles ~1 s faster at the same speed.
# - On CPU-only installs, one XLA device per core: the command line spreads its runs over the
#   devices and each trains its share on its own core (2.3-2.5x the env steps/s of a single
#   device for 8 seeds on 2 cores). One unsharded jitted call runs on one device, as fast as before.
_CPU_ONLY = not any(m.name.startswith(("jax_cuda", "jax_rocm", "libtpu")) for m in pkgutil.iter_modules())
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
_ONE_DEVICE_PER_CORE = _CPU_ONLY and _CORES > 1 and "JAX_NUM_CPU_DEVICES" not in os.environ
for _flag_name, _value in (("xla_cpu_enable_concurrency_optimized_scheduler", "false"),
                           ("xla_backend_optimization_level", "1" if _CPU_ONLY else None),
                           ("xla_force_host_platform_device_count", str(_CORES) if _ONE_DEVICE_PER_CORE else None)):
    if _value and _flag_name not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_flag_name}={_value}".strip()

import argparse
import dataclasses
import itertools
import json
import math
import sys
import time
import warnings
from typing import Any, Callable, NamedTuple, Sequence

import chex
import flax.linen as nn
import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization
from jax.flatten_util import ravel_pytree

ALGORITHM = "pqn"


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------
def _option(default: Any, doc: str) -> Any:
    return dataclasses.field(default=default, metadata={"doc": doc})


@dataclasses.dataclass(frozen=True)
class Config:
    env_name: str = _option("CartPole-v1", "gymnax environment id (discrete action space)")
    total_timesteps: int = _option(307_200, "environment steps per run (all envs together)")
    num_envs: int = _option(16, "parallel environments per run")
    num_steps: int = _option(32, "steps per environment in each rollout")
    update_epochs: int = _option(4, "passes over each rollout batch")
    num_minibatches: int = _option(4, "minibatches per epoch; must divide num_envs * num_steps")
    lr: float = _option(1e-3, "Adam learning rate (start value when annealed)")
    anneal_lr: bool = _option(True, "decay the learning rate linearly to 0 over all gradient steps")
    gamma: float = _option(0.99, "discount factor")
    q_lambda: float = _option(0.65, "Q(lambda) lambda: 0 is one-step Q-learning, 1 Monte Carlo + bootstrap")
    eps_start: float = _option(1.0, "epsilon-greedy exploration: epsilon at the first update")
    eps_end: float = _option(0.01, "epsilon after the decay, to the end of training")
    eps_decay: float = _option(0.2, "fraction of the updates over which epsilon falls linearly to eps_end")
    reward_scale: float = _option(0.1, "rewards are multiplied by this in the Q targets (not in logged returns)")
    max_grad_norm: float = _option(10.0, "global gradient-norm clip")
    activation: str = _option("relu", "hidden activation: tanh or relu")
    hidden_size: int = _option(64, "units per hidden layer of the Q-network")
    num_layers: int = _option(2, "hidden layers (Dense -> LayerNorm -> activation) of the Q-network")
    layer_norm: bool = _option(True, "LayerNorm after every hidden Dense layer (PQN's stabiliser)")
    eval_episodes: int = _option(16, "greedy evaluation episodes per run after training")
    seed: int = _option(0, "base seed; run i uses jax.random.split(PRNGKey(seed), num_seeds)[i]")
    num_seeds: int = _option(8, "independent runs trained side by side (vmapped)")

    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def minibatch_size(self) -> int:
        return self.batch_size // self.num_minibatches

    @property
    def num_updates(self) -> int:
        return self.total_timesteps // self.batch_size


# Float hyperparameters that may differ between runs of one compiled program (--sweep).
class HParams(NamedTuple):
    lr: jax.Array
    gamma: jax.Array
    q_lambda: jax.Array
    eps_start: jax.Array
    eps_end: jax.Array
    eps_decay: jax.Array
    reward_scale: jax.Array
    max_grad_norm: jax.Array


SWEEPABLE = HParams._fields
ACTIVATIONS = {"tanh": nn.tanh, "relu": nn.relu}


class ConfigError(ValueError):
    """A config value that cannot work; raised before anything is compiled."""


def hparams_from(config: Config) -> HParams:
    return HParams(*(jnp.float32(getattr(config, name)) for name in SWEEPABLE))


def validate(config: Config) -> None:
    """Refuse a config that cannot run, naming the option and what is allowed."""
    for name in ("total_timesteps", "num_envs", "num_steps", "update_epochs", "num_minibatches",
                 "hidden_size", "num_layers", "eval_episodes", "num_seeds"):
        if getattr(config, name) <= 0:
            raise ConfigError(f"--{_flag(name)} must be a positive integer, got {getattr(config, name)}")
    _validate_hparams({name: getattr(config, name) for name in SWEEPABLE})
    if config.activation not in ACTIVATIONS:
        raise ConfigError(f"--activation must be one of {', '.join(ACTIVATIONS)}, got {config.activation!r}")
    if config.batch_size % config.num_minibatches:
        raise ConfigError(
            f"--num-minibatches {config.num_minibatches} must divide num_envs * num_steps = "
            f"{config.num_envs} * {config.num_steps} = {config.batch_size}")
    if config.total_timesteps >= 2**31:  # step counts are int32 inside the compiled program
        raise ConfigError(f"--total-timesteps must be below 2**31 per run, got {config.total_timesteps}")
    if config.total_timesteps < config.batch_size:
        raise ConfigError(
            f"--total-timesteps {config.total_timesteps} is less than one rollout "
            f"(num_envs * num_steps = {config.batch_size})")
    make_env(config.env_name)  # unknown or continuous-action environments


def _validate_hparams(values: dict) -> None:
    for name, value in values.items():
        if not math.isfinite(value):
            raise ConfigError(f"--{_flag(name)} must be finite, got {value}")
    if values["lr"] <= 0:
        raise ConfigError(f"--lr must be positive, got {values['lr']}")
    if not 0 <= values["gamma"] <= 1:
        raise ConfigError(f"--gamma must be in [0, 1], got {values['gamma']}")
    for name in ("q_lambda", "eps_start", "eps_end", "eps_decay"):
        if not 0 <= values[name] <= 1:
            raise ConfigError(f"--{_flag(name)} must be in [0, 1], got {values[name]}")
    for name in ("reward_scale", "max_grad_norm"):
        if values[name] <= 0:
            raise ConfigError(f"--{_flag(name)} must be positive, got {values[name]}")


def _flag(name: str) -> str:
    return name.replace("_", "-")


# --------------------------------------------------------------------------------------
# Environment wrapper
# --------------------------------------------------------------------------------------
def make_env(env_name: str):
    """gymnax.make with errors a user can act on; only discrete action spaces."""
    if env_name not in gymnax.registered_envs:
        raise ConfigError(f"--env-name {env_name!r} is not a gymnax environment; choose one of: "
                          + ", ".join(gymnax.registered_envs))
    try:
        env, env_params = gymnax.make(env_name)
    except Exception as error:  # e.g. MNISTBandit downloads its data set
        raise ConfigError(f"--env-name {env_name}: gymnax could not create it ({error})") from None
    if not isinstance(env.action_space(env_params), gymnax.environments.spaces.Discrete):
        raise ConfigError(f"--env-name {env_name} has a continuous (Box) action space; pqn.py "
                          "needs a discrete one")
    return env, env_params


class EnvStep(NamedTuple):
    obs: jax.Array          # [num_envs, obs_dim] after auto-reset
    state: Any
    reward: jax.Array       # [num_envs] float32
    terminated: jax.Array   # [num_envs] bool: the episode reached a terminal state
    truncated: jax.Array    # [num_envs] bool: the episode hit its time limit
    final_obs: jax.Array    # [num_envs, obs_dim] the true next observation, before auto-reset


class StepNoise(NamedTuple):
    """Everything random that one env step consumes, drawn ahead for a whole rollout."""
    key: jax.Array          # [num_envs] keys for the transition itself
    reset_obs: Any          # [num_envs, ...] a fresh episode's first observation (None: env resets itself)
    reset_state: Any


class VecEnv:
    """`num_envs` copies of a gymnax env, stepped together, observations as flat float32.

    gymnax's `Environment.step` splits its key and draws a reset state at every step, and on
    CPU each random draw inside a loop is a small rolled threefry loop of its own. For envs
    that use that stock `step`, `presample` draws the keys and reset states of a whole rollout
    in one batched call and `step` does the same auto-reset from them. Envs that override
    `step` (e.g. DeepSea keeps bsuite statistics across resets) are stepped through it.
    """

    def __init__(self, env_name: str, num_envs: int):
        self.env, self.params = make_env(env_name)
        self.num_envs = num_envs
        self.obs_shape = tuple(self.env.observation_space(self.params).shape)
        self.obs_dim = int(np.prod(self.obs_shape))
        self.num_actions = int(self.env.action_space(self.params).n)
        self.max_episode_steps = int(self.params.max_steps_in_episode)
        self.stock_step = type(self.env).step is gymnax.environments.environment.Environment.step

    def _flat(self, obs: jax.Array) -> jax.Array:
        batch_shape = obs.shape[:obs.ndim - len(self.obs_shape)]
        return obs.reshape(*batch_shape, self.obs_dim).astype(jnp.float32)

    def reset(self, key: jax.Array):
        keys = jax.random.split(key, self.num_envs)
        obs, state = jax.vmap(self.env.reset, in_axes=(0, None))(keys, self.params)
        return self._flat(obs), state

    def presample(self, key: jax.Array, num_steps: int) -> StepNoise:
        step_keys, reset_keys = jax.random.split(key, (2, num_steps, self.num_envs))
        if not self.stock_step:
            return StepNoise(step_keys, None, None)
        reset_env = jax.vmap(jax.vmap(self.env.reset_env, in_axes=(0, None)), in_axes=(0, None))
        reset_obs, reset_state = reset_env(reset_keys, self.params)
        return StepNoise(step_keys, self._flat(reset_obs), reset_state)

    def step(self, noise: StepNoise, state: Any, action: jax.Array) -> EnvStep:
        if not self.stock_step:
            obs, state, reward, terminated, truncated, info = jax.vmap(
                self.env.step, in_axes=(0, 0, 0, None))(noise.key, state, action, self.params)
            return EnvStep(self._flat(obs), state, reward.astype(jnp.float32), terminated, truncated,
                           self._flat(info["final_observation"]))
        obs, state, reward, terminated, _ = jax.vmap(
            self.env.step_env, in_axes=(0, 0, 0, None))(noise.key, state, action, self.params)
        truncated = jax.vmap(self.env.is_truncated, in_axes=(0, None))(state, self.params)
        done = terminated | truncated
        final_obs = self._flat(obs)
        select = jax.vmap(lambda d, reset, stepped: jax.tree.map(lambda r, s: jax.lax.select(d, r, s), reset, stepped))
        return EnvStep(select(done, noise.reset_obs, final_obs), select(done, noise.reset_state, state),
                       reward.astype(jnp.float32), terminated, truncated, final_obs)


# --------------------------------------------------------------------------------------
# Networks
# --------------------------------------------------------------------------------------
class QNetwork(nn.Module):
    """obs -> one Q-value per action, through (Dense -> LayerNorm -> activation) blocks.

    LayerNorm is what lets PQN drop the target network: it keeps the bootstrapped
    regression onto the network's own Q-values from diverging (Gallici et al., 2024).
    """
    num_actions: int
    hidden_size: int
    num_layers: int
    activation: str
    layer_norm: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        act = ACTIVATIONS[self.activation]
        for _ in range(self.num_layers):
            x = nn.Dense(self.hidden_size, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x)
            x = act(nn.LayerNorm()(x) if self.layer_norm else x)
        return nn.Dense(self.num_actions, kernel_init=nn.initializers.orthogonal(1.0))(x)


def make_networks(config: Config, num_actions: int):
    """The Q-network: obs -> [num_actions] Q-values."""
    return QNetwork(num_actions, hidden_size=config.hidden_size, num_layers=config.num_layers,
                    activation=config.activation, layer_norm=config.layer_norm)


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------
class Transition(NamedTuple):
    obs: jax.Array          # [T, N, obs_dim]
    action: jax.Array       # [T, N]
    reward: jax.Array       # [T, N]
    terminated: jax.Array   # [T, N]
    done: jax.Array         # [T, N] terminated or truncated: the next obs starts a new episode
    final_obs: jax.Array    # [T, N, obs_dim] true next observation (for bootstrapping)


class Batch(NamedTuple):
    obs: jax.Array
    action: jax.Array
    target: jax.Array


class Runner(NamedTuple):
    """Everything one run carries from update to update."""
    params: Any
    opt_state: Any             # Adam state over the flattened parameter vector
    env_state: Any
    obs: jax.Array
    episode_return: jax.Array  # [num_envs] return so far of each env's current episode
    episode_length: jax.Array  # [num_envs]
    rng: jax.Array
    hparams: HParams


def compute_q_lambda(reward, next_q, terminated, done, gamma, q_lambda):
    """Q(lambda) returns for a [T, N] rollout.

    `next_q[t]` is max_a Q(s'_t, a) of the true next observation (before auto-reset):

        G_t = r_t + gamma * (1 - terminated_t) * [lambda * G_{t+1} + (1 - lambda) * next_q_t]

    where G_{t+1} is replaced by next_q_t when the episode ended at t (`done`: terminated
    or truncated) and at the last step of the rollout. So a time-limit truncation
    bootstraps from the state it cut off, and only `terminated` zeroes the bootstrap.
    """
    chex.assert_equal_shape([reward, next_q, terminated, done])

    def backward(next_return, step):
        reward_t, next_q_t, terminated_t, done_t = step
        next_return = jnp.where(done_t, next_q_t, next_return)
        g = reward_t + gamma * (1.0 - terminated_t) * (q_lambda * next_return + (1.0 - q_lambda) * next_q_t)
        return g, g

    _, returns = jax.lax.scan(backward, next_q[-1], (reward, next_q, terminated, done), reverse=True)
    return returns


def epsilon_at(update_index, num_updates: int, eps_start, eps_end, eps_decay):
    """Exploration rate of an update: linear from eps_start (update 0) to eps_end (update
    eps_decay * num_updates), then constant."""
    decay_updates = eps_decay * num_updates
    progress = jnp.where(decay_updates > 0, jnp.clip(update_index / jnp.maximum(decay_updates, 1e-9), 0.0, 1.0), 1.0)
    return eps_start + (eps_end - eps_start) * progress


def make_optimizer(config: Config, hparams: HParams):
    num_grad_steps = config.num_updates * config.update_epochs * config.num_minibatches
    if config.anneal_lr:
        lr = lambda count: hparams.lr * (1.0 - count / num_grad_steps)  # noqa: E731
    else:
        lr = hparams.lr
    return optax.chain(optax.clip_by_global_norm(hparams.max_grad_norm),
                       optax.adam(learning_rate=lr, eps=1e-5))


def make_train(config: Config) -> Callable:
    """Returns `train(rng, hparams=None) -> (runner, metrics)` running the whole config.

    `metrics` maps names to arrays of shape [num_updates]. `train.init(rng, hparams)` and
    `train.run(runner, first_update, num_updates)` are the two halves of `train`, for
    callers (the command line) that run the updates in chunks to report progress.
    """
    validate(config)
    env = VecEnv(config.env_name, config.num_envs)
    q_network = make_networks(config, env.num_actions)
    T, N, M, A = config.num_steps, config.num_envs, config.num_minibatches, env.num_actions

    def init_params(key: jax.Array):
        dummy_obs = jnp.zeros((1, env.obs_dim))
        return {"q": q_network.init(key, dummy_obs)}

    # The optimizer sees one flat vector instead of a dozen small arrays: on CPU every array is a
    # separate kernel launch in Adam and in the gradient-norm clip, which dominated a step.
    shapes = jax.eval_shape(init_params, jax.random.PRNGKey(0))
    _, unravel = ravel_pytree(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes))

    def init(rng: jax.Array, hparams: HParams | None = None) -> Runner:
        hparams = hparams_from(config) if hparams is None else hparams
        rng, params_key, env_key = jax.random.split(rng, 3)
        params = init_params(params_key)
        obs, env_state = env.reset(env_key)
        opt_state = make_optimizer(config, hparams).init(ravel_pytree(params)[0])
        return Runner(params, opt_state, env_state, obs, jnp.zeros(N), jnp.zeros(N, jnp.int32), rng, hparams)

    def update(runner: Runner, update_index: jax.Array):
        params, hp = runner.params, runner.hparams
        optimizer = make_optimizer(config, hp)
        epsilon = epsilon_at(update_index, config.num_updates, hp.eps_start, hp.eps_end, hp.eps_decay)

        def env_step(carry, noise):
            env_state, obs, episode_return, episode_length, finished = carry
            (explore, random_action), env_noise = noise
            greedy = jnp.argmax(q_network.apply(params["q"], obs), -1)
            action = jnp.where(explore, random_action, greedy)  # epsilon-greedy
            step = env.step(env_noise, env_state, action)
            done = step.terminated | step.truncated
            episode_return = episode_return + step.reward
            episode_length = episode_length + 1
            # Sums over the episodes that end in this update: their mean is the logged return.
            finished = (finished[0] + done.sum(), finished[1] + jnp.where(done, episode_return, 0.0).sum(),
                        finished[2] + jnp.where(done, episode_length, 0).sum())
            transition = Transition(obs, action, step.reward, step.terminated, done, step.final_obs)
            carry = (step.state, step.obs, jnp.where(done, 0.0, episode_return),
                     jnp.where(done, 0, episode_length), finished)
            return carry, transition

        # All randomness of the rollout is drawn here in two batched calls, not step by step:
        # which env explores at which step, and the uniformly random action it then takes.
        rng, action_key, env_key = jax.random.split(runner.rng, 3)
        explore_u, action_u = jax.random.uniform(action_key, (2, T, N))
        random_action = jnp.minimum((action_u * A).astype(jnp.int32), A - 1)
        noise = ((explore_u < epsilon, random_action), env.presample(env_key, T))
        no_episodes = (jnp.int32(0), jnp.float32(0), jnp.int32(0))
        carry = (runner.env_state, runner.obs, runner.episode_return, runner.episode_length, no_episodes)
        carry, transitions = jax.lax.scan(env_step, carry, noise)
        env_state, obs, episode_return, episode_length, finished = carry

        # Bootstrap values run once over the whole rollout with the params that acted, and stay
        # fixed during the epochs: max_a Q(final_obs) gives every step's, last step included.
        next_q = jax.lax.stop_gradient(q_network.apply(params["q"], transitions.final_obs).max(-1))
        target = compute_q_lambda(transitions.reward * hp.reward_scale, next_q,
                                  transitions.terminated.astype(jnp.float32), transitions.done,
                                  hp.gamma, hp.q_lambda)
        batch = Batch(transitions.obs, transitions.action, target)
        batch = jax.tree.map(lambda x: x.reshape(T * N, *x.shape[2:]), batch)

        def loss_fn(flat_params, minibatch: Batch):
            params = unravel(flat_params)
            q = q_network.apply(params["q"], minibatch.obs)
            q_taken = jnp.take_along_axis(q, minibatch.action[:, None], -1)[:, 0]
            loss = 0.5 * jnp.square(q_taken - minibatch.target).mean()
            return loss, {"loss": loss, "q_mean": q_taken.mean()}

        def minibatch_step(train, minibatch: Batch):
            flat_params, opt_state = train
            grads, stats = jax.grad(loss_fn, has_aux=True)(flat_params, minibatch)
            updates, opt_state = optimizer.update(grads, opt_state)
            stats["grad_norm"] = jnp.linalg.norm(grads)
            return (flat_params + updates, opt_state), stats

        def epoch(train, order):
            minibatches = jax.tree.map(lambda x: x[order].reshape(M, T * N // M, *x.shape[1:]), batch)
            return jax.lax.scan(minibatch_step, train, minibatches)

        # Every epoch's shuffle in one batched sort: one at a time they cost ~10% of an update.
        rng, shuffle_key = jax.random.split(rng)
        orders = jax.vmap(jax.random.permutation, in_axes=(0, None))(
            jax.random.split(shuffle_key, config.update_epochs), T * N)
        (flat_params, opt_state), stats = jax.lax.scan(epoch, (ravel_pytree(params)[0], runner.opt_state), orders)
        params = unravel(flat_params)

        num_finished, return_sum, length_sum = finished
        any_finished = num_finished > 0
        metrics = {
            "env_steps": (update_index + 1) * T * N,
            # NaN when no episode ended during this update: never a stale or zero-filled value.
            "episode_return": jnp.where(any_finished, return_sum / jnp.maximum(num_finished, 1), jnp.nan),
            "episode_length": jnp.where(any_finished, length_sum / jnp.maximum(num_finished, 1), jnp.nan),
            "episodes_finished": num_finished,
            **{name: value.mean() for name, value in stats.items()},
            "epsilon": epsilon,
            "finite": jnp.isfinite(stats["loss"]).all() & jnp.isfinite(flat_params).all(),
        }
        runner = Runner(params, opt_state, env_state, obs, episode_return, episode_length, rng, hp)
        return runner, metrics

    def run(runner: Runner, first_update: jax.Array, num_updates: int):
        """`num_updates` updates from `first_update` on; those past the config's end are skipped."""
        metrics_shape = jax.eval_shape(update, runner, jnp.int32(0))[1]

        def step(runner, index):
            def skip(runner, index):
                return runner, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metrics_shape)
            return jax.lax.cond(index < config.num_updates, update, skip, runner, index)

        return jax.lax.scan(step, runner, first_update + jnp.arange(num_updates, dtype=jnp.int32))

    def train(rng: jax.Array, hparams: HParams | None = None):
        return run(init(rng, hparams), jnp.int32(0), config.num_updates)

    train.init, train.run = init, run
    return train


def make_evaluate(config: Config) -> Callable:
    """Returns `evaluate(q_params, rng) -> mean return` of `eval_episodes` greedy episodes."""
    validate(config)
    env = VecEnv(config.env_name, config.eval_episodes)
    q_network = make_networks(config, env.num_actions)

    def evaluate(q_params, rng: jax.Array) -> jax.Array:
        reset_key, rng = jax.random.split(rng)
        obs, env_state = env.reset(reset_key)

        def running(carry):
            return carry[3].any() & (carry[5] < env.max_episode_steps)

        def env_step(carry):
            env_state, obs, total, alive, rng, t = carry
            rng, key = jax.random.split(rng)
            noise = jax.tree.map(lambda x: x[0], env.presample(key, 1))
            step = env.step(noise, env_state, jnp.argmax(q_network.apply(q_params, obs), -1))
            total = total + jnp.where(alive, step.reward, 0.0)
            alive = alive & ~(step.terminated | step.truncated)
            return step.state, step.obs, total, alive, rng, t + 1

        carry = (env_state, obs, jnp.zeros(env.num_envs), jnp.ones(env.num_envs, bool), rng, 0)
        return jax.lax.while_loop(running, env_step, carry)[2].mean()

    return evaluate


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv: Sequence[str] | None = None):
    parser = _Parser(prog=os.path.basename(sys.argv[0]) or "pqn.py",
                     description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for field in dataclasses.fields(Config):
        flag = "--" + _flag(field.name)
        if field.type is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default,
                                help=field.metadata["doc"])
        else:
            parser.add_argument(flag, type=_integer if field.type is int else field.type, default=field.default,
                                metavar=field.type.__name__.upper(),
                                help=field.metadata["doc"])
    parser.add_argument("--sweep", action="append", default=[], metavar="FIELD=V1,V2,...",
                        help=f"train every value in one compiled program (repeat for a grid); FIELD is one "
                             f"of {', '.join(map(_flag, SWEEPABLE))}")
    parser.add_argument("--runs-dir", default="runs", help="results go to a new directory under this one")
    parser.add_argument("--compile-cache", action=argparse.BooleanOptionalAction, default=True,
                        help="JAX persistent compilation cache (JAX_COMPILATION_CACHE_DIR, else "
                             "~/.cache/jax_rl_compile)")
    parser.add_argument("--quiet", action="store_true", help="print only the results directory")
    args = parser.parse_args(argv)
    config = Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)})
    return config, parse_sweep(args.sweep), args


def _integer(text: str) -> int:
    """An int flag that also takes 3e5 or 1_000_000."""
    value = float(text)
    if not value.is_integer():
        raise ValueError(text)
    return int(value)


_integer.__name__ = "int"  # argparse names the type in its error message


def parse_sweep(specs: Sequence[str]) -> dict:
    """['lr=1e-4,3e-4', 'gamma=0.9,0.99'] -> {'lr': [1e-4, 3e-4], 'gamma': [0.9, 0.99]}."""
    sweep = {}
    for spec in specs:
        name, sep, values = spec.partition("=")
        name = name.strip().lstrip("-").replace("-", "_")
        if name in sweep:
            raise ConfigError(f"--sweep {spec!r}: {_flag(name)} is swept twice; give all its values in one flag")
        if not sep or name not in SWEEPABLE:
            raise ConfigError(f"--sweep {spec!r}: expected FIELD=V1,V2,... with FIELD one of "
                              + ", ".join(map(_flag, SWEEPABLE)))
        try:
            sweep[name] = [float(v) for v in values.split(",")]
        except ValueError:
            raise ConfigError(f"--sweep {spec!r}: values must be numbers separated by commas") from None
    return sweep


def sweep_points(config: Config, sweep: dict) -> list[dict]:
    """The grid of hyperparameter values, one dict per point; [{}] when nothing is swept."""
    points = [dict(zip(sweep, values)) for values in itertools.product(*sweep.values())]
    for point in points:
        try:
            _validate_hparams({name: point.get(name, getattr(config, name)) for name in SWEEPABLE})
        except ConfigError as error:
            raise ConfigError(f"--sweep value: {error}") from None
    return points


def run_devices(num_runs: int) -> list:
    """The devices the runs are spread over: every device of every host under jax.distributed;
    on one host at most one device per run, so that no device trains padding only."""
    return jax.devices() if jax.process_count() > 1 else jax.devices()[:num_runs]


def runs_sharding(num_runs: int) -> jax.sharding.NamedSharding:
    """A 1-D mesh over `run_devices(num_runs)` that splits the leading run axis."""
    mesh = jax.sharding.Mesh(np.array(run_devices(num_runs)), ("runs",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("runs"))


def pad_runs(tree, num_runs: int):
    """Pads the leading run axis to a multiple of the device count by repeating the last run;
    the repeats train like any run and `gather_runs` drops them."""
    num_devices = len(run_devices(num_runs))
    index = np.minimum(np.arange(-(-num_runs // num_devices) * num_devices), num_runs - 1)
    return jax.tree.map(lambda x: np.asarray(x)[index], tree)


def gather_runs(tree, shape: tuple):
    """Host copies of run-axis arrays, padding dropped, runs laid out as `shape` ([points, seeds])."""
    if jax.process_count() > 1:  # every host holds only its devices' runs
        from jax.experimental import multihost_utils
        tree = multihost_utils.process_allgather(tree, tiled=True)
    size = int(np.prod(shape))
    return jax.tree.map(lambda x: np.asarray(x)[:size].reshape(*shape, *np.shape(x)[1:]), tree)


def enable_compile_cache() -> None:
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser("~/.cache/jax_rl_compile"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def new_run_dir(runs_dir: str, config: Config) -> str:
    """A directory no earlier run has used: created atomically, never reused."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for attempt in itertools.count():
        path = os.path.join(runs_dir, f"{ALGORITHM}-{config.env_name}-{stamp}" + (f"-{attempt}" if attempt else ""))
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            continue


def final_returns(metrics: dict, fraction: float = 0.05) -> np.ndarray:
    """Per run: mean return of the episodes that ended in the last `fraction` of updates."""
    returns, counts = metrics["episode_return"], metrics["episodes_finished"]
    last = max(1, int(math.ceil(returns.shape[-1] * fraction)))
    returns, counts = returns[..., -last:], counts[..., -last:]
    total = np.where(counts > 0, returns * counts, 0.0).sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return total / counts.sum(-1)


def _nanmean(x, axis=None):
    """np.nanmean that stays quiet (NaN) where every value is NaN: updates with no finished episode."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(x, axis=axis)


def _number(x) -> float | None:
    """A float for JSON, which has no NaN: None where no value exists (no finished episode)."""
    return float(x) if math.isfinite(x) else None


def package_versions() -> dict:
    from importlib import metadata
    versions = {"python": sys.version.split()[0]}
    for name in ("jax", "jaxlib", "flax", "optax", "gymnax", "chex", "numpy"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def plot_learning_curves(path: str, metrics: dict, labels: list[str], config: Config) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    steps = metrics["env_steps"][0, 0]
    for point, label in enumerate(labels):
        returns = metrics["episode_return"][point]  # [seeds, updates]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mean, low, high = (np.nanmean(returns, 0), np.nanmin(returns, 0), np.nanmax(returns, 0))
        line, = ax.plot(steps, mean, label=label or f"mean of {returns.shape[0]} seeds")
        ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2)
    ax.set_xlabel("environment steps (per run)")
    ax.set_ylabel("episode return")
    ax.set_title(f"{ALGORITHM} on {config.env_name}: mean, min-max band over {config.num_seeds} seeds")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config, sweep, args = parse_args(argv)
        validate(config)
        points = sweep_points(config, sweep)
    except ConfigError as error:
        print(f"{os.path.basename(sys.argv[0]) or 'pqn.py'}: error: {error}", file=sys.stderr)
        return 2
    quiet = args.quiet or jax.process_index() != 0  # under jax.distributed, host 0 reports and writes
    say = (lambda *a, **k: None) if quiet else (lambda *a, **k: print(*a, **k, flush=True))
    if args.compile_cache:
        enable_compile_cache()

    # Runs are [sweep point, seed] flattened into one run axis (every point sees the same seeds),
    # which is sharded over all devices: nothing crosses runs, so each device trains its share.
    G, S = len(points), config.num_seeds
    seed_keys = jax.random.split(jax.random.PRNGKey(config.seed), S)
    values = np.array([[p.get(n, getattr(config, n)) for n in SWEEPABLE] for p in points], np.float32)
    keys, hparams = pad_runs((np.tile(seed_keys, (G, 1)), HParams(*np.repeat(values, S, axis=0).T)), G * S)
    sharded = runs_sharding(G * S)  # every output below has the run axis first
    eval_keys = jax.device_put(pad_runs(np.tile(jax.random.split(jax.random.PRNGKey(config.seed + 1), S), (G, 1)),
                                        G * S), sharded)
    train = make_train(config)
    # Initialisation runs on one device and is then spread out: flax's orthogonal init (a LAPACK
    # QR) deadlocked XLA:CPU when executed on several devices at once. It is cheap either way.
    init = jax.jit(jax.vmap(train.init))
    chunk = max(1, math.ceil(config.num_updates / 10))  # ~10 progress reports
    run = jax.jit(jax.vmap(lambda runner, first: train.run(runner, first, chunk), (0, None)), out_shardings=sharded)
    evaluate = jax.jit(jax.vmap(make_evaluate(config)), out_shardings=sharded)
    runs_to_host = lambda tree: gather_runs(tree, (G, S))  # noqa: E731

    say(f"{ALGORITHM} on {config.env_name}: {G * S} run(s) ({S} seeds x {G} sweep points), "
        f"{config.num_updates} updates of {config.batch_size} env steps each, on {len(run_devices(G * S))} "
        f"{jax.default_backend()} device(s)")
    if config.total_timesteps % config.batch_size:
        say(f"note: total_timesteps {config.total_timesteps:,} is not a multiple of num_envs * num_steps "
            f"= {config.batch_size}; training {config.num_updates * config.batch_size:,} steps per run")
    start = time.perf_counter()
    runner = jax.device_put(init(keys, hparams), sharded)
    run_compiled = run.lower(runner, jnp.int32(0)).compile()
    jax.block_until_ready(runner)
    compile_seconds = time.perf_counter() - start
    say(f"compiled in {compile_seconds:.1f} s")

    # The updates run as ~10 calls of one compiled chunk, so that the host can report between
    # them: a callback inside the program would keep it out of the persistent compile cache.
    # Each chunk is dispatched before the previous one is reported, so reporting costs no time.
    chunks, chunk_ends, start = [], [], time.perf_counter()
    firsts = list(range(0, config.num_updates, chunk))
    for i, first in enumerate(firsts):
        runner, metrics = run_compiled(runner, jnp.int32(first))
        chunks.append(metrics)
        for j in ([i - 1] if i else []) + ([i] if i == len(firsts) - 1 else []):
            done_updates = min(firsts[j] + chunk, config.num_updates)
            returns = runs_to_host(chunks[j]["episode_return"])[..., : done_updates - firsts[j]]
            seconds = time.perf_counter() - start  # chunk j has just reached the host: it is done
            chunk_ends.append(seconds)
            say(f"[{100 * done_updates / config.num_updates:5.1f}%] update {done_updates}/{config.num_updates}"
                f"  env steps {done_updates * config.batch_size:,}  return {_nanmean(returns):8.2f}"
                f"  {done_updates * config.batch_size * G * S / seconds:,.0f} steps/s")
    metrics = runs_to_host(jax.tree.map(lambda *c: jnp.concatenate(c, axis=-1), *chunks))
    metrics = {k: v[..., : config.num_updates] for k, v in metrics.items()}
    train_seconds = time.perf_counter() - start
    # Seconds since training began at which each update had finished: measured at chunk ends,
    # interpolated within a chunk (its updates cost alike), for return-against-wall-clock curves.
    done_at = [min(first + chunk, config.num_updates) for first in firsts]
    metrics["wall_seconds"] = np.interp(np.arange(1, config.num_updates + 1), [0, *done_at], [0.0, *chunk_ends])

    eval_start = time.perf_counter()
    eval_returns = runs_to_host(evaluate(runner.params["q"], eval_keys))
    params = runs_to_host(runner.params)
    eval_seconds = time.perf_counter() - eval_start

    nonfinite = ~metrics["finite"]
    if jax.process_index() != 0:
        return 3 if nonfinite.any() else 0
    run_dir = new_run_dir(args.runs_dir, config)
    labels = [", ".join(f"{k}={v:g}" for k, v in p.items()) for p in points]
    finals = final_returns(metrics)  # [G, S]
    per_point = [{"sweep_point": p, "final_return_mean": _number(_nanmean(f)),
                  "final_return_std": _number(np.sqrt(_nanmean((f - _nanmean(f)) ** 2))),
                  "final_return_per_seed": [_number(x) for x in f], "eval_return_mean": _number(np.mean(e))}
                 for p, f, e in zip(points, finals, eval_returns)]
    best = max(range(G), key=lambda g: -math.inf if per_point[g]["final_return_mean"] is None
               else per_point[g]["final_return_mean"])
    summary = {
        "algorithm": ALGORITHM, "env_name": config.env_name, "num_seeds": S, "total_timesteps": config.total_timesteps,
        "trained_timesteps": config.num_updates * config.batch_size,
        **{k: v for k, v in per_point[best].items() if k != "sweep_point"},
        "compile_seconds": compile_seconds, "train_seconds": train_seconds, "eval_seconds": eval_seconds,
        "steps_per_second": config.num_updates * config.batch_size * G * S / train_seconds,
        "backend": jax.default_backend(), "devices": [str(d) for d in run_devices(G * S)],
        "versions": package_versions(),
    }
    if sweep:
        summary.update(best_sweep_point=points[best], sweep=per_point)
    if nonfinite.any():
        first_bad = int(np.argmax(nonfinite.any(axis=(0, 1))))
        g, s = map(int, np.argwhere(nonfinite[:, :, first_bad])[0])
        summary["nonfinite"] = {"first_update": first_bad + 1, "env_steps": (first_bad + 1) * config.batch_size,
                                "seed_index": s, "sweep_point": points[g]}
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump({**dataclasses.asdict(config), "sweep": sweep}, f, indent=2)
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    np.savez_compressed(os.path.join(run_dir, "metrics.npz"), eval_return=eval_returns,
                        **{f"sweep_{k}": np.array([p[k] for p in points]) for k in sweep}, **metrics)
    with open(os.path.join(run_dir, "params.msgpack"), "wb") as f:
        f.write(serialization.to_bytes(params))
    plot_learning_curves(os.path.join(run_dir, "learning_curve.png"), metrics, labels, config)

    for p, label in zip(per_point, labels):
        show = lambda x: "n/a" if x is None else f"{x:.1f}"  # noqa: E731
        say(f"{label or 'final'}: return {show(p['final_return_mean'])} ± {show(p['final_return_std'])} over "
            f"{S} seeds (episodes ending in the last 5% of training), greedy eval {show(p['eval_return_mean'])}")
    say(f"compile {compile_seconds:.1f} s, train {train_seconds:.1f} s "
        f"({summary['steps_per_second']:,.0f} env steps/s), eval {eval_seconds:.1f} s")
    print(f"results: {run_dir}", flush=True)
    if nonfinite.any():
        bad = summary["nonfinite"]
        print(f"error: non-finite loss or parameters first appeared at update {bad['first_update']} "
              f"(env step {bad['env_steps']:,}, seed index {bad['seed_index']}"
              + (f", sweep point {bad['sweep_point']}" if sweep else "") + ")", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
