"""PPO (clipped surrogate, GAE, Gaussian policy) for continuous-action gymnax environments, in one file.

    python algorithms/ppo_continuous.py                       # Pendulum-v1, 8 seeds
    python algorithms/ppo_continuous.py --env-name MountainCarContinuous-v0 --num-seeds 16
    python algorithms/ppo_continuous.py --sweep lr=3e-4,1e-3 --sweep gamma=0.9,0.95
    python algorithms/ppo_continuous.py --help                # every option, its meaning and default

The whole run (rollout, GAE, epochs of shuffled minibatch updates) is one jitted
function; seeds and sweep points are vmapped into the same compiled program:

    configure_xla()  # optional: the command line's XLA set-up, before JAX's first computation
    train = make_train(Config(env_name="Pendulum-v1"))
    runner, metrics = jax.jit(jax.vmap(train))(jax.random.split(jax.random.PRNGKey(0), 8))

The policy is a diagonal Gaussian (an MLP gives the mean, a learned state-independent
vector the log std); its samples are clipped to the action bounds (or squashed into
them with tanh, --squash). Observations are normalised by running per-feature
statistics and rewards scaled by a running std of the discounted return (both on by
default); params.msgpack saves those statistics with the networks.

Each run writes config.json, summary.json, metrics.npz, params.msgpack and
learning_curve.png into a new directory under --runs-dir. Depends only on jax, flax,
optax, distrax, gymnax, chex, numpy and matplotlib; copy this file anywhere and it runs. Importing
it defines things and does nothing else.
"""

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import io
import itertools
import json
import math
import os
import pkgutil
import re
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import chex
import distrax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization
from jax.flatten_util import ravel_pytree

# gymnax is imported where an environment is made, not here: it computes with JAX when
# imported, which would start JAX's backend before the command line sets XLA's flags.

ALGORITHM = "ppo_continuous"


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------
def _option(default: Any, doc: str) -> Any:
    return dataclasses.field(default=default, metadata={"doc": doc})


# Defaults tuned on Pendulum-v1: rollouts of one whole 200-step episode per env learned faster
# and more evenly across seeds than ppo.py's 32-step rollouts (benchmarks/README.md).
@dataclasses.dataclass(frozen=True)
class Config:
    env_name: str = _option("Pendulum-v1", "gymnax id or brax/NAME[:BACKEND] (continuous Box actions; see below)")
    total_timesteps: int = _option(160_000, "environment steps per run (all envs together)")
    num_envs: int = _option(8, "parallel environments per run")
    num_steps: int = _option(200, "steps per environment in each rollout")
    update_epochs: int = _option(4, "passes over each rollout batch")
    num_minibatches: int = _option(8, "minibatches per epoch; must divide num_envs * num_steps")
    lr: float = _option(2.5e-3, "Adam learning rate (start value when annealed)")
    anneal_lr: bool = _option(True, "decay the learning rate linearly to 0 over all gradient steps")
    gamma: float = _option(0.97, "discount factor")
    gae_lambda: float = _option(0.95, "GAE lambda (bias/variance trade-off of advantages)")
    clip_eps: float = _option(0.2, "PPO ratio clip range; also clips the value update")
    objective: str = _option("ppo", "policy objective: ppo (clipped surrogate) or dpo (Discovered Policy Optimisation)")
    dpo_alpha: float = _option(2.0, "DPO's drift threshold where the advantage is >= 0 (objective dpo)")
    dpo_beta: float = _option(0.6, "DPO's drift threshold where the advantage is < 0 (objective dpo)")
    ent_coef: float = _option(0.01, "entropy bonus coefficient")
    vf_coef: float = _option(0.5, "value loss coefficient")
    max_grad_norm: float = _option(0.5, "global gradient-norm clip")
    activation: str = _option("tanh", "hidden activation: tanh or relu")
    hidden_size: int = _option(64, "units per hidden layer (actor and critic alike)")
    num_layers: int = _option(2, "hidden layers in actor and critic")
    log_std_init: float = _option(
        0.0, "initial log standard deviation of the Gaussian policy (learned, the same for every state)"
    )
    squash: bool = _option(False, "squash actions into the bounds with tanh (else clip them to the bounds)")
    normalize_obs: bool = _option(True, "normalise observations by a running per-feature mean and variance")
    normalize_reward: bool = _option(True, "divide rewards by a running std of the discounted return")
    eval_episodes: int = _option(16, "greedy evaluation episodes per run after training")
    seed: int = _option(0, "base seed; run i uses jax.random.split(PRNGKey(seed), num_seeds)[i]")
    num_seeds: int = _option(8, "independent runs trained side by side (vmapped)")

    @property
    def steps_per_update(self) -> int:
        """Env steps of one update, all envs together: one rollout batch."""
        return self.num_envs * self.num_steps

    @property
    def num_updates(self) -> int:
        return self.total_timesteps // self.steps_per_update


class HParams(NamedTuple):
    """Float hyperparameters that may differ between the runs of one compiled program (--sweep)."""

    lr: jax.Array
    gamma: jax.Array
    gae_lambda: jax.Array
    clip_eps: jax.Array
    ent_coef: jax.Array
    vf_coef: jax.Array
    max_grad_norm: jax.Array


SWEEPABLE = HParams._fields
ACTIVATIONS = {"tanh": nn.tanh, "relu": nn.relu}
OBJECTIVES = ("ppo", "dpo")


class ConfigError(ValueError):
    """A config value that cannot work; raised before anything is compiled."""


def hparams_from(config: Config) -> HParams:
    return HParams(**{name: jnp.float32(getattr(config, name)) for name in SWEEPABLE})


def validate(config: Config) -> None:
    """Refuse a config that cannot run, naming the option and what is allowed."""
    for name in (
        "total_timesteps",
        "num_envs",
        "num_steps",
        "update_epochs",
        "num_minibatches",
        "hidden_size",
        "num_layers",
        "eval_episodes",
        "num_seeds",
    ):
        if getattr(config, name) <= 0:
            raise ConfigError(f"--{_flag(name)} must be a positive integer, got {getattr(config, name)}")
    validate_hparams({name: getattr(config, name) for name in SWEEPABLE})
    if not math.isfinite(config.log_std_init):
        raise ConfigError(f"--log-std-init must be finite, got {config.log_std_init}")
    if config.objective not in OBJECTIVES:
        raise ConfigError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {config.objective!r}")
    for name in ("dpo_alpha", "dpo_beta"):
        if not (math.isfinite(getattr(config, name)) and getattr(config, name) > 0):
            raise ConfigError(f"--{_flag(name)} must be positive, got {getattr(config, name)}")
    if config.activation not in ACTIVATIONS:
        raise ConfigError(f"--activation must be one of {', '.join(ACTIVATIONS)}, got {config.activation!r}")
    if config.steps_per_update % config.num_minibatches:
        raise ConfigError(
            f"--num-minibatches {config.num_minibatches} must divide num_envs * num_steps = "
            f"{config.num_envs} * {config.num_steps} = {config.steps_per_update}"
        )
    if config.total_timesteps >= 2**31:  # step counts are int32 inside the compiled program
        raise ConfigError(f"--total-timesteps must be below 2**31 per run, got {config.total_timesteps}")
    if config.total_timesteps < config.steps_per_update:
        raise ConfigError(
            f"--total-timesteps {config.total_timesteps} is less than one rollout "
            f"(num_envs * num_steps = {config.steps_per_update})"
        )
    env, env_params = make_env(config.env_name)  # unknown or discrete-action environments
    space = env.action_space(env_params)
    if config.squash and not (np.isfinite(space.low).all() and np.isfinite(space.high).all()):
        raise ConfigError(
            f"--squash needs a bounded action space; --env-name {config.env_name} has bounds "
            f"{space.low} to {space.high}"
        )


def validate_hparams(values: dict) -> None:
    """The checks of the sweepable fields, for the Config and for every sweep point."""
    for name, value in values.items():
        if not math.isfinite(value):
            raise ConfigError(f"--{_flag(name)} must be finite, got {value}")
    if values["lr"] <= 0:
        raise ConfigError(f"--lr must be positive, got {values['lr']}")
    if not 0 <= values["gamma"] <= 1:
        raise ConfigError(f"--gamma must be in [0, 1], got {values['gamma']}")
    if not 0 <= values["gae_lambda"] <= 1:
        raise ConfigError(f"--gae-lambda must be in [0, 1], got {values['gae_lambda']}")
    for name in ("clip_eps", "max_grad_norm"):
        if values[name] <= 0:
            raise ConfigError(f"--{_flag(name)} must be positive, got {values[name]}")
    for name in ("ent_coef", "vf_coef"):
        if values[name] < 0:
            raise ConfigError(f"--{_flag(name)} must be >= 0, got {values[name]}")


def check_resources(config: Config, num_runs: int) -> None:
    """Nothing to check: PPO's memory does not grow with the budget."""


def _flag(name: str) -> str:
    return name.replace("_", "-")


# --------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------
def make_env(env_name: str):
    """gymnax.make, or a suite's env for SUITE/NAME (make_suite_env, in the harness), with errors a
    user can act on; only continuous (Box) action spaces."""
    import gymnax

    if "/" in env_name:
        env, env_params = make_suite_env(env_name, "continuous")
    elif env_name not in gymnax.registered_envs:
        raise ConfigError(
            f"--env-name {env_name!r} is not a gymnax environment or SUITE/NAME; choose one of: "
            + ", ".join(gymnax.registered_envs)
            + f"; or {suite_help()}"
        )
    else:
        try:
            env, env_params = gymnax.make(env_name)
        except Exception as error:  # e.g. MNISTBandit downloads its data set
            raise ConfigError(f"--env-name {env_name}: gymnax could not create it ({error})") from None
    if not isinstance(env.action_space(env_params), gymnax.environments.spaces.Box):
        raise ConfigError(
            f"--env-name {env_name} has a discrete action space; {ALGORITHM}.py needs a continuous (Box) one"
        )
    return env, env_params


class EnvStep(NamedTuple):
    obs: jax.Array  # [num_envs, obs_dim] after auto-reset
    state: Any
    reward: jax.Array  # [num_envs] float32
    terminated: jax.Array  # [num_envs] bool: the episode reached a terminal state
    truncated: jax.Array  # [num_envs] bool: the episode hit its time limit
    final_obs: jax.Array  # [num_envs, obs_dim] the true next observation, before auto-reset


class StepNoise(NamedTuple):
    """Everything random that one env step consumes, drawn ahead for a whole rollout."""

    key: jax.Array  # [num_envs] keys for the transition itself
    reset_obs: Any  # [num_envs, ...] a fresh episode's first observation (None: env resets itself)
    reset_state: Any


class VecEnv:
    """`num_envs` copies of a gymnax env, stepped together, observations and actions as flat float32.

    gymnax's `Environment.step` splits its key and draws a reset state at every step, and on
    CPU each random draw inside a loop is a small rolled threefry loop of its own. For envs
    that use that stock `step`, `presample` draws the keys and reset states of a whole rollout
    in one batched call and `step` does the same auto-reset from them. Envs that override
    `step` (e.g. DeepSea keeps bsuite statistics across resets) are stepped through it.
    """

    def __init__(self, env_name: str, num_envs: int):
        from gymnax.environments.environment import Environment

        self.env, self.params = make_env(env_name)
        self.num_envs = num_envs
        self.obs_shape = tuple(self.env.observation_space(self.params).shape)
        self.obs_dim = int(np.prod(self.obs_shape))
        space = self.env.action_space(self.params)
        self.action_shape = tuple(space.shape)
        self.action_dim = int(np.prod(self.action_shape))
        # Bounds as flat [action_dim] float32 vectors (gymnax gives scalars or arrays).
        self.action_low, self.action_high = (
            np.broadcast_to(np.asarray(b, np.float32), self.action_shape).reshape(-1) for b in (space.low, space.high)
        )
        self.max_episode_steps = int(self.params.max_steps_in_episode)
        self.stock_step = type(self.env).step is Environment.step
        # Fresh episodes drawn: one per env and step for gymnax envs; for a suite whose reset costs
        # more than a step (make_suite_env), one per `envs_per_reset` env steps: `num_resets` of them
        # every `reset_every` steps (with fewer envs than envs_per_reset, one every few steps).
        envs_per_reset = getattr(self.env, "envs_per_reset", 1)
        self.num_resets = -(-num_envs // envs_per_reset)
        self.reset_every = max(1, envs_per_reset // num_envs)

    def _flat(self, obs: jax.Array) -> jax.Array:
        batch_shape = obs.shape[: obs.ndim - len(self.obs_shape)]
        return obs.reshape(*batch_shape, self.obs_dim).astype(jnp.float32)

    def reset(self, key: jax.Array):
        keys = jax.random.split(key, self.num_envs)
        obs, state = jax.vmap(self.env.reset, in_axes=(0, None))(keys, self.params)
        return self._flat(obs), state

    def presample(self, key: jax.Array, num_steps: int, resets: bool = True) -> StepNoise:
        """The randomness of `num_steps` steps; without `resets`, episodes that end are not restarted
        (evaluation scores each env's first episode only, and a Craftax world costs a fifth of a step)."""
        step_keys, reset_keys = jax.random.split(key, (2, num_steps, self.num_envs))
        if not (self.stock_step and resets):
            return StepNoise(key=step_keys, reset_obs=None, reset_state=None)
        reset_env = jax.vmap(jax.vmap(self.env.reset_env, in_axes=(0, None)), in_axes=(0, None))
        reset_obs, reset_state = reset_env(reset_keys[:: self.reset_every, : self.num_resets], self.params)
        fresh = (self._flat(reset_obs), reset_state)
        if self.reset_every > 1:  # step t draws from the episodes made for step t - t % reset_every
            fresh = jax.tree.map(lambda x: jnp.repeat(x, self.reset_every, axis=0)[:num_steps], fresh)
        return StepNoise(key=step_keys, reset_obs=fresh[0], reset_state=fresh[1])

    def step(self, noise: StepNoise, state: Any, action: jax.Array) -> EnvStep:
        action = action.reshape(self.num_envs, *self.action_shape)
        if not self.stock_step:
            obs, state, reward, terminated, truncated, info = jax.vmap(self.env.step, in_axes=(0, 0, 0, None))(
                noise.key, state, action, self.params
            )
            return EnvStep(
                obs=self._flat(obs),
                state=state,
                reward=reward.astype(jnp.float32),
                terminated=terminated,
                truncated=truncated,
                final_obs=self._flat(info["final_observation"]),
            )
        obs, state, reward, terminated, _ = jax.vmap(self.env.step_env, in_axes=(0, 0, 0, None))(
            noise.key, state, action, self.params
        )
        truncated = jax.vmap(self.env.is_truncated, in_axes=(0, None))(state, self.params)
        done = terminated | truncated
        final_obs = self._flat(obs)
        reset_obs, reset_state = noise.reset_obs, noise.reset_state
        if reset_state is None:  # presample(resets=False): an ended episode stays where it ended
            reset_obs, reset_state = final_obs, state
        elif self.num_resets < self.num_envs:  # the k-th env to finish at this step takes fresh episode k
            slot = (jnp.cumsum(done) - 1) % self.num_resets
            reset_obs, reset_state = jax.tree.map(lambda x: x[slot], (reset_obs, reset_state))
        select = jax.vmap(lambda d, reset, stepped: jax.tree.map(lambda r, s: jax.lax.select(d, r, s), reset, stepped))
        return EnvStep(
            obs=select(done, reset_obs, final_obs),
            state=select(done, reset_state, state),
            reward=reward.astype(jnp.float32),
            terminated=terminated,
            truncated=truncated,
            final_obs=final_obs,
        )


class EpisodeStats(NamedTuple):
    """Totals over the episodes that ended during one update; their means are the logged metrics."""

    finished: jax.Array  # int32: episodes that ended
    return_sum: jax.Array  # float32: their returns, summed
    length_sum: jax.Array  # int32: their lengths, summed

    @classmethod
    def zero(cls) -> "EpisodeStats":
        return cls(finished=jnp.int32(0), return_sum=jnp.float32(0), length_sum=jnp.int32(0))

    def add(self, done: jax.Array, episode_return: jax.Array, episode_length: jax.Array) -> "EpisodeStats":
        """Counts the episodes that end where `done`, with their returns and lengths so far."""
        return EpisodeStats(
            finished=self.finished + done.sum(),
            return_sum=self.return_sum + jnp.where(done, episode_return, 0.0).sum(),
            length_sum=self.length_sum + jnp.where(done, episode_length, 0).sum(),
        )

    def metrics(self) -> dict:
        """Mean return and length of the episodes that ended: NaN when none did, never a stale or
        zero-filled value."""
        mean = lambda total: jnp.where(self.finished > 0, total / jnp.maximum(self.finished, 1), jnp.nan)  # noqa: E731
        return {
            "episode_return": mean(self.return_sum),
            "episode_length": mean(self.length_sum),
            "episodes_finished": self.finished,
        }


# --------------------------------------------------------------------------------------
# Networks
# --------------------------------------------------------------------------------------
class MLP(nn.Module):
    """Separate actor and critic towers share this shape; only the output scale differs."""

    out_dim: int
    out_scale: float
    hidden_size: int
    num_layers: int
    activation: str

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        act = ACTIVATIONS[self.activation]
        for _ in range(self.num_layers):
            x = act(nn.Dense(self.hidden_size, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
        return nn.Dense(self.out_dim, kernel_init=nn.initializers.orthogonal(self.out_scale))(x)


class GaussianActor(nn.Module):
    """Mean from an MLP (small initial output: the first policy is centred on 0); the log std is
    one learned vector, the same for every state."""

    action_dim: int
    log_std_init: float
    hidden_size: int
    num_layers: int
    activation: str

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        mean = MLP(self.action_dim, 0.01, self.hidden_size, self.num_layers, self.activation)(x)
        log_std = self.param("log_std", nn.initializers.constant(self.log_std_init), (self.action_dim,))
        return mean, log_std


class Networks(NamedTuple):
    actor: nn.Module  # obs -> (mean, log std) of a Gaussian; its parameters are params["actor"]
    critic: nn.Module  # obs -> [1] value; params["critic"]


def make_networks(config: Config, action_dim: int) -> Networks:
    shape = dict(hidden_size=config.hidden_size, num_layers=config.num_layers, activation=config.activation)
    return Networks(actor=GaussianActor(action_dim, config.log_std_init, **shape), critic=MLP(1, 1.0, **shape))


def policy(mean: jax.Array, log_std: jax.Array) -> distrax.Distribution:
    """The diagonal Gaussian of the sample u; its event is the last (action) axis (mean and
    log_std broadcast against each other, as in jnp)."""
    return distrax.Independent(distrax.Normal(mean, jnp.exp(log_std)), reinterpreted_batch_ndims=1)


class ActionMap(NamedTuple):
    """From the Gaussian's sample u (what the rollout stores) to the action the env executes.

    Clip (default): a = clip(u, low, high), and log-probabilities are those of the unclipped
    sample u, as in CleanRL, Stable-Baselines3 and PureJAXRL: the clip is treated as part of
    the environment, so the importance ratio of two Gaussians at the same u stays exact (the
    clipped action's own distribution has point masses at the bounds, which no density ratio
    of the Gaussian would describe). Squash: a = centre + half_range * tanh(u) (`bijector`), and
    log p(a) = log N(u) - log|det da/du|, the change of variables; that term does not depend on
    the parameters, so it cancels in the ratio, but it makes the stored log-probability the true
    density of the executed action. It is taken at the stored u (forward_log_det_jacobian),
    never through distrax.Transformed.log_prob(a): that inverts tanh, and atanh(a) is inf once
    tanh(u) rounds to 1 (|u| > ~9 in float32) and inaccurate well before.
    """

    low: jax.Array
    high: jax.Array
    squash: bool

    def bijector(self) -> distrax.Bijector:
        rescale = distrax.ScalarAffine(shift=(self.high + self.low) / 2, scale=(self.high - self.low) / 2)
        return distrax.Block(distrax.Chain([rescale, distrax.Tanh()]), ndims=1)

    def __call__(self, u: jax.Array) -> jax.Array:
        if self.squash:
            return self.bijector().forward(u)
        return jnp.clip(u, self.low, self.high)

    def log_prob(self, u: jax.Array, mean: jax.Array, log_std: jax.Array) -> jax.Array:
        log_prob = policy(mean, log_std).log_prob(u)
        if self.squash:
            log_prob = log_prob - self.bijector().forward_log_det_jacobian(u)
        return log_prob


def action_map(config: Config, env: "VecEnv") -> ActionMap:
    return ActionMap(jnp.asarray(env.action_low), jnp.asarray(env.action_high), config.squash)


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------
class Transition(NamedTuple):
    obs: jax.Array  # [T, N, obs_dim] as the env gave it (not normalised)
    action: jax.Array  # [T, N, action_dim] the Gaussian sample, before clipping or tanh
    log_prob: jax.Array  # [T, N] under the policy that acted
    reward: jax.Array  # [T, N] as the env gave it (not scaled)
    terminated: jax.Array  # [T, N]
    done: jax.Array  # [T, N] terminated or truncated: the next obs starts a new episode
    final_obs: jax.Array  # [T, N, obs_dim] true next observation (for bootstrapping)


class Batch(NamedTuple):
    obs: jax.Array
    action: jax.Array
    log_prob: jax.Array
    value: jax.Array
    advantage: jax.Array
    target: jax.Array


class RunningStats(NamedTuple):
    """Mean and (population) variance of every sample seen so far, per feature."""

    mean: jax.Array
    var: jax.Array
    count: jax.Array  # samples seen (float32: exact up to 2**24, a negligible drift beyond)

    @classmethod
    def empty(cls, shape: tuple = ()) -> "RunningStats":
        return cls(jnp.zeros(shape), jnp.ones(shape), jnp.zeros(()))


def update_stats(stats: RunningStats, batch: jax.Array) -> RunningStats:
    """Merges a batch [..., *feature shape] into the statistics: Chan et al.'s parallel
    form of Welford's update, so the result is the mean and variance of the whole stream, not
    a moving average, and a batch's variance is never computed from sums of squares."""
    axes = tuple(range(batch.ndim - stats.mean.ndim))
    batch_count = float(np.prod([batch.shape[a] for a in axes]))
    batch_mean, batch_var = batch.mean(axes), batch.var(axes)
    count = stats.count + batch_count
    delta = batch_mean - stats.mean
    mean = stats.mean + delta * (batch_count / count)
    m2 = stats.var * stats.count + batch_var * batch_count + jnp.square(delta) * (stats.count * batch_count / count)
    return RunningStats(mean, m2 / count, count)


def normalize(stats: RunningStats, x: jax.Array) -> jax.Array:
    # The clip (as Stable-Baselines3's VecNormalize) bounds what a near-constant feature becomes.
    return jnp.clip((x - stats.mean) / jnp.sqrt(stats.var + 1e-8), -10.0, 10.0)


class Runner(NamedTuple):
    """Everything one run carries from update to update."""

    params: Any
    opt_state: Any  # Adam state over the flattened parameter vector
    env_state: Any
    obs: jax.Array
    episode_return: jax.Array  # [num_envs] return so far of each env's current episode
    episode_length: jax.Array  # [num_envs]
    obs_norm: RunningStats  # [obs_dim] statistics of every observation acted on, all envs together
    return_norm: RunningStats  # [] statistics of discounted_return, whose std scales the rewards
    discounted_return: jax.Array  # [num_envs] discounted return so far of each env's current episode
    rng: jax.Array
    hparams: HParams


class Acting(NamedTuple):
    """What the rollout carries from one env step to the next."""

    env_state: Any
    obs: jax.Array
    episode_return: jax.Array
    episode_length: jax.Array
    stats: EpisodeStats


def compute_gae(reward, value, next_value, terminated, done, gamma, gae_lambda):
    """Advantages and value targets for a [T, N] rollout.

    `next_value[t]` is V of the true next observation (before auto-reset), so a time-limit
    truncation bootstraps from the state it cut off; only `terminated` zeroes it. `done`
    (either) stops the recursion from leaking advantages across episodes.
    """
    chex.assert_equal_shape([reward, value, next_value, terminated, done])
    delta = reward + gamma * next_value * (1.0 - terminated) - value

    def backward(next_advantage, step):
        delta_t, done_t = step
        advantage = delta_t + gamma * gae_lambda * (1.0 - done_t) * next_advantage
        return advantage, advantage

    _, advantage = jax.lax.scan(backward, jnp.zeros_like(delta[0]), (delta, done.astype(delta.dtype)), reverse=True)
    return advantage, advantage + value


def discounted_returns(reward, done, gamma, initial):
    """gym's NormalizeReward return per env, G_t = gamma * G_{t-1} + r_t, restarting from 0 after
    every episode end, for a [T, N] rollout; `initial` [N] carries it across rollouts.
    Returns (G [T, N], the carry for the next rollout)."""

    def step(carry, x):
        reward_t, done_t = x
        g = gamma * carry + reward_t
        return jnp.where(done_t, 0.0, g), g

    last, returns = jax.lax.scan(step, initial, (reward, done))
    return returns, last


def policy_objective(config: Config, ratio, log_ratio, advantage, clip_eps):
    """Per sample, the policy loss from the probability ratio r = exp(log_ratio) of the new policy
    to the one that acted and the (normalised) advantage A.

    ppo: -min(r A, clip(r, 1 - clip_eps, 1 + clip_eps) A).
    dpo (Lu et al. 2022, "Discovered Policy Optimisation"): -(r A - drift), where the drift is
    ReLU((r - 1) A - alpha tanh((r - 1) A / alpha)) for A >= 0 and
    ReLU(log(r) A - beta tanh(log(r) A / beta)) for A < 0: zero near r = 1, growing once the
    policy has moved far in the direction the advantage favours.
    """
    if config.objective == "dpo":
        alpha, beta = config.dpo_alpha, config.dpo_beta
        drift_positive = nn.relu((ratio - 1) * advantage - alpha * jnp.tanh((ratio - 1) * advantage / alpha))
        drift_negative = nn.relu(log_ratio * advantage - beta * jnp.tanh(log_ratio * advantage / beta))
        return -(ratio * advantage - jnp.where(advantage >= 0, drift_positive, drift_negative))
    return -jnp.minimum(ratio * advantage, jnp.clip(ratio, 1 - clip_eps, 1 + clip_eps) * advantage)


def ppo_loss(config: Config, networks: Networks, to_env: ActionMap, params, minibatch: Batch, hp: HParams):
    """The policy objective (clipped surrogate or DPO), the clipped value loss and the entropy bonus
    of one minibatch."""
    mean, log_std = networks.actor.apply(params["actor"], minibatch.obs)
    log_prob = to_env.log_prob(minibatch.action, mean, log_std)
    log_ratio = log_prob - minibatch.log_prob
    ratio = jnp.exp(log_ratio)
    advantage = minibatch.advantage
    advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
    policy_loss = policy_objective(config, ratio, log_ratio, advantage, hp.clip_eps).mean()
    value = networks.critic.apply(params["critic"], minibatch.obs)[:, 0]
    value_clipped = minibatch.value + jnp.clip(value - minibatch.value, -hp.clip_eps, hp.clip_eps)
    value_loss = (
        0.5 * jnp.maximum(jnp.square(value - minibatch.target), jnp.square(value_clipped - minibatch.target)).mean()
    )
    # With --squash this is the entropy before tanh: the squashed one has no closed form.
    entropy = policy(mean, log_std).entropy().mean()
    loss = policy_loss + hp.vf_coef * value_loss - hp.ent_coef * entropy
    stats = {
        "loss": loss,
        "policy_loss": policy_loss,
        "value_loss": value_loss,
        "entropy": entropy,
        "approx_kl": ((ratio - 1) - log_ratio).mean(),
        "clip_fraction": (jnp.abs(ratio - 1) > hp.clip_eps).mean(),
    }
    return loss, stats


def make_optimizer(config: Config, hparams: HParams):
    num_grad_steps = config.num_updates * config.update_epochs * config.num_minibatches
    if config.anneal_lr:
        lr = lambda count: hparams.lr * (1.0 - count / num_grad_steps)  # noqa: E731
    else:
        lr = hparams.lr
    return optax.chain(optax.clip_by_global_norm(hparams.max_grad_norm), optax.adam(learning_rate=lr, eps=1e-5))


def make_train(config: Config) -> Callable:
    """Returns `train(rng, hparams=None) -> (runner, metrics)` running the whole config.

    `metrics` maps names to arrays of shape [num_updates]. `train.init(rng, hparams)` and
    `train.run(runner, first_update, num_updates)` are the two halves of `train`, for
    callers (the command line) that run the updates in chunks to report progress.
    """
    validate(config)
    env = VecEnv(config.env_name, config.num_envs)
    networks = make_networks(config, env.action_dim)
    to_env = action_map(config, env)
    T, N, M = config.num_steps, config.num_envs, config.num_minibatches

    def init_params(key: jax.Array):
        actor_key, critic_key = jax.random.split(key)
        dummy_obs = jnp.zeros((1, env.obs_dim))
        return {
            "actor": networks.actor.init(actor_key, dummy_obs),
            "critic": networks.critic.init(critic_key, dummy_obs),
        }

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
        return Runner(
            params=params,
            opt_state=opt_state,
            env_state=env_state,
            obs=obs,
            episode_return=jnp.zeros(N),
            episode_length=jnp.zeros(N, jnp.int32),
            obs_norm=RunningStats.empty((env.obs_dim,)),
            return_norm=RunningStats.empty(),
            discounted_return=jnp.zeros(N),
            rng=rng,
            hparams=hparams,
        )

    def rollout(runner: Runner, key: jax.Array, norm: Callable):
        """T steps of every env under the current policy: (the carry after them, [T, N] transitions)."""

        def env_step(carry: Acting, noise):
            action_noise, env_noise = noise
            mean, log_std = networks.actor.apply(runner.params["actor"], norm(carry.obs))
            action = mean + jnp.exp(log_std) * action_noise
            log_prob = to_env.log_prob(action, mean, log_std)
            step = env.step(env_noise, carry.env_state, to_env(action))
            done = step.terminated | step.truncated
            episode_return, episode_length = carry.episode_return + step.reward, carry.episode_length + 1
            transition = Transition(
                obs=carry.obs,
                action=action,
                log_prob=log_prob,
                reward=step.reward,
                terminated=step.terminated,
                done=done,
                final_obs=step.final_obs,
            )
            return Acting(
                env_state=step.state,
                obs=step.obs,
                episode_return=jnp.where(done, 0.0, episode_return),
                episode_length=jnp.where(done, 0, episode_length),
                stats=carry.stats.add(done, episode_return, episode_length),
            ), transition

        # All randomness of the rollout is drawn here in two batched calls, not step by step.
        action_key, env_key = key
        noise = (jax.random.normal(action_key, (T, N, env.action_dim)), env.presample(env_key, T))
        start = Acting(
            env_state=runner.env_state,
            obs=runner.obs,
            episode_return=runner.episode_return,
            episode_length=runner.episode_length,
            stats=EpisodeStats.zero(),
        )
        return jax.lax.scan(env_step, start, noise)

    def make_batch(params, transitions: Transition, reward: jax.Array, norm: Callable, hp: HParams) -> Batch:
        """The rollout (observations normalised) with its values, GAE advantages and value targets
        for the (scaled) `reward`, flattened to [T * N]."""
        batch_obs = norm(transitions.obs)
        # The critic is not needed to act, so it runs once over the whole rollout instead of
        # once per step; V(final_obs) gives every step's bootstrap value, last step included.
        values = networks.critic.apply(params["critic"], jnp.concatenate([batch_obs, norm(transitions.final_obs)]))[
            ..., 0
        ]
        value, next_value = values[:T], values[T:]
        advantage, target = compute_gae(
            reward,
            value,
            next_value,
            transitions.terminated.astype(jnp.float32),
            transitions.done,
            hp.gamma,
            hp.gae_lambda,
        )
        batch = Batch(
            obs=batch_obs,
            action=transitions.action,
            log_prob=transitions.log_prob,
            value=value,
            advantage=advantage,
            target=target,
        )
        return jax.tree.map(lambda x: x.reshape(T * N, *x.shape[2:]), batch)

    def scale_rewards(runner: Runner, transitions: Transition, hp: HParams):
        """(rewards for the update, return statistics, discounted returns carried on). As gym's
        NormalizeReward: r / std(discounted return), the std over every step and env so far (this
        rollout included), so that returns, and the critic's targets, have a scale of about 1
        whatever the env's reward scale is."""
        if not config.normalize_reward:
            return transitions.reward, runner.return_norm, runner.discounted_return
        returns, discounted_return = discounted_returns(
            transitions.reward, transitions.done, hp.gamma, runner.discounted_return
        )
        return_norm = update_stats(runner.return_norm, returns)
        return transitions.reward / jnp.sqrt(return_norm.var + 1e-8), return_norm, discounted_return

    def learn(flat_params, opt_state, batch: Batch, key: jax.Array, hp: HParams):
        """`update_epochs` passes of shuffled minibatch steps over the batch."""
        optimizer = make_optimizer(config, hp)

        def minibatch_step(train, minibatch: Batch):
            flat_params, opt_state = train
            grads, stats = jax.grad(
                lambda p: ppo_loss(config, networks, to_env, unravel(p), minibatch, hp), has_aux=True
            )(flat_params)
            updates, opt_state = optimizer.update(grads, opt_state)
            stats["grad_norm"] = jnp.linalg.norm(grads)
            return (flat_params + updates, opt_state), stats

        def epoch(train, order):
            minibatches = jax.tree.map(lambda x: x[order].reshape(M, T * N // M, *x.shape[1:]), batch)
            return jax.lax.scan(minibatch_step, train, minibatches)

        # Every epoch's shuffle in one batched sort, not one sort per epoch.
        orders = jax.vmap(jax.random.permutation, in_axes=(0, None))(jax.random.split(key, config.update_epochs), T * N)
        return jax.lax.scan(epoch, (flat_params, opt_state), orders)

    def update(runner: Runner, update_index: jax.Array):
        hp = runner.hparams
        # The statistics stay fixed for the rollout and its update: the update then sees exactly
        # the inputs the policy acted on (its first ratios are 1); this rollout's observations
        # join the statistics for the next one.
        acting_stats = runner.obs_norm
        norm = (lambda x: normalize(acting_stats, x)) if config.normalize_obs else (lambda x: x)
        rng, action_key, env_key = jax.random.split(runner.rng, 3)
        acting, transitions = rollout(runner, (action_key, env_key), norm)
        reward, return_norm, discounted_return = scale_rewards(runner, transitions, hp)
        obs_norm = update_stats(runner.obs_norm, transitions.obs) if config.normalize_obs else runner.obs_norm
        batch = make_batch(runner.params, transitions, reward, norm, hp)
        rng, shuffle_key = jax.random.split(rng)
        (flat_params, opt_state), stats = learn(
            ravel_pytree(runner.params)[0], runner.opt_state, batch, shuffle_key, hp
        )
        metrics = {
            "env_steps": (update_index + 1) * T * N,
            **acting.stats.metrics(),
            **{name: value.mean() for name, value in stats.items()},
            "action_std": jnp.exp(unravel(flat_params)["actor"]["params"]["log_std"]).mean(),
            "return_std": jnp.sqrt(return_norm.var),
            "finite": jnp.isfinite(stats["loss"]).all() & jnp.isfinite(flat_params).all(),
        }
        runner = Runner(
            params=unravel(flat_params),
            opt_state=opt_state,
            env_state=acting.env_state,
            obs=acting.obs,
            episode_return=acting.episode_return,
            episode_length=acting.episode_length,
            obs_norm=obs_norm,
            return_norm=return_norm,
            discounted_return=discounted_return,
            rng=rng,
            hparams=hp,
        )
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


# --------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------
def saved_params(runner: Runner) -> dict:
    """What params.msgpack holds and `make_evaluate` takes: the networks and the normalisation
    statistics (as dicts, so that flax.serialization.msgpack_restore gives back the same tree)."""
    return {**runner.params, "obs_norm": runner.obs_norm._asdict(), "return_norm": runner.return_norm._asdict()}


class GreedyPolicy(NamedTuple):
    """How a trained run acts in evaluation: `init(num_envs)` gives the policy's own carry (none here),
    `act(params, carry, obs, start) -> (carry, action)` the greedy action, where `params` is what
    `saved_params` gives and `start` marks observations that begin an episode."""

    init: Callable
    act: Callable


def make_greedy_policy(config: Config, env: VecEnv) -> GreedyPolicy:
    """The Gaussian's mean, clipped or squashed into the bounds, of observations normalised by
    the saved statistics, frozen."""
    networks = make_networks(config, env.action_dim)
    to_env = action_map(config, env)

    def act(params, carry, obs: jax.Array, start: jax.Array):
        if config.normalize_obs:
            obs = normalize(RunningStats(**params["obs_norm"]), obs)
        return carry, to_env(networks.actor.apply(params["actor"], obs)[0])

    return GreedyPolicy(init=lambda num_envs: (), act=act)


# ======================================================================================
# Run harness: environment suites beyond gymnax, evaluation episodes, the command line, the
# run directory, checkpoints and resume, sharding, progress, tracking and plots.
#
# Everything below this banner is the same, byte for byte, in every file of algorithms/
# (tests/test_harness.py checks it; edit ppo.py's and run `python tests/test_harness.py` to
# copy it into the others). It reaches the algorithm above only through these names:
# ALGORITHM, Config (its fields env_name, total_timesteps, eval_episodes, seed, num_seeds and
# its properties steps_per_update and num_updates), ConfigError, validate, HParams, SWEEPABLE,
# validate_hparams, check_resources, make_env, VecEnv, make_train (train.init, train.run),
# saved_params, make_greedy_policy and GreedyPolicy; a Runner field named `buffer`, if any, is
# the replay buffer; and the metrics env_steps, episode_return, episodes_finished and finite.
# The algorithm's make_env reaches make_suite_env and suite_help here for SUITE/NAME.
# ======================================================================================
# --------------------------------------------------------------------------------------
# Environment suites beyond gymnax: --env-name SUITE/NAME
# --------------------------------------------------------------------------------------
# Each suite's raw environment (none of its own episode or auto-reset wrappers) becomes a gymnax
# Environment: `step_env` reports only the suite's natural termination, the episode's time limit
# is gymnax's `is_truncated` against `max_steps_in_episode`, and VecEnv keeps the true final
# observation. So rollouts, targets and evaluation treat it exactly as a gymnax env, and
# bootstrap through time limits. A suite is imported only when its prefix is used.
class Suite(NamedTuple):
    module: str
    install: str  # the pip line of the version tested here
    actions: str  # "discrete" or "continuous"
    names: str  # where its environment names are listed


SUITES = {
    "brax": Suite("brax", "pip install brax==0.14.2", "continuous", "ant, halfcheetah, hopper, ... in brax.envs"),
    "craftax": Suite("craftax", "pip install craftax==1.6.1", "discrete", "Craftax-Classic-Symbolic-v1, ..."),
    "xminigrid": Suite("xminigrid", "pip install xminigrid==0.9.3", "discrete", "MiniGrid-DoorKey-5x5, ..."),
}


def suite_help() -> str:
    return "; ".join(f"{prefix}/NAME ({suite.actions}: {suite.names})" for prefix, suite in SUITES.items())


@functools.cache
def make_suite_env(env_name: str, actions: str):
    """(env, params) for `SUITE/NAME`: the suite's env as a gymnax Environment, or a ConfigError
    saying what is wrong (unknown suite or name, not the `actions` the algorithm needs, or the pip
    line when the suite is not installed), all before the suite is imported if they can be."""
    prefix, _, name = env_name.partition("/")
    if prefix not in SUITES:
        raise ConfigError(f"--env-name {env_name}: unknown suite {prefix!r}; the suites are {suite_help()}")
    suite = SUITES[prefix]
    if suite.actions != actions:
        raise ConfigError(
            f"--env-name {env_name}: {prefix} has {suite.actions} actions; {ALGORITHM}.py needs {actions} ones"
        )
    if importlib.util.find_spec(suite.module) is None:
        raise ConfigError(f"--env-name {env_name} needs the {suite.module} package: {suite.install}")
    env = {"brax": brax_env, "craftax": craftax_env, "xminigrid": xminigrid_env}[prefix](env_name, name)
    return env, env.default_params


def suite_env(name: str, start: Callable, transition: Callable, spaces: tuple, max_steps: int, envs_per_reset: int):
    """A gymnax Environment around a suite's raw env, given as `start(key) -> (obs, inner)` and
    `transition(key, inner, action) -> (obs, inner, reward, terminated)`; `spaces` are the
    (action, observation) gymnax spaces. VecEnv draws one fresh episode per `envs_per_reset` env
    steps (1: one per env and step, as for gymnax envs) for suites whose reset costs more than a step."""
    from flax import struct
    from gymnax.environments import environment

    @struct.dataclass
    class SuiteState:
        inner: Any  # the suite's own state
        time: jax.Array  # steps taken in this episode
        terminated: jax.Array  # the step that led here ended the episode naturally

    class SuiteEnv(environment.Environment):
        @property
        def default_params(self):
            return environment.EnvParams(max_steps_in_episode=max_steps)

        def step_env(self, key, state, action, params):
            obs, inner, reward, terminated = transition(key, state.inner, action)
            terminated = jnp.asarray(terminated, bool)
            state = SuiteState(inner=inner, time=state.time + 1, terminated=terminated)
            return obs, state, jnp.asarray(reward, jnp.float32), terminated, {}

        def reset_env(self, key, params):
            obs, inner = start(key)
            return obs, SuiteState(inner=inner, time=jnp.int32(0), terminated=jnp.bool_(False))

        def is_truncated(self, state, params):  # the time limit, never on a natural termination
            return (state.time >= params.max_steps_in_episode) & ~state.terminated

        def is_terminated(self, state, params):
            return state.terminated

        @property
        def name(self) -> str:
            return name

        @property
        def num_actions(self) -> int:
            return int(spaces[0].n) if hasattr(spaces[0], "n") else int(np.prod(spaces[0].shape))

        def action_space(self, params=None):
            return spaces[0]

        def observation_space(self, params=None):
            return spaces[1]

    env = SuiteEnv()
    env.envs_per_reset = envs_per_reset
    return env


def brax_env(env_name: str, name: str):
    """`brax/NAME` or `brax/NAME:BACKEND` (generalized, positional, spring or mjx; brax's default
    otherwise): actions in [-1, 1], episodes truncated at 1000 steps as in Brax's training."""
    from gymnax.environments import spaces

    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():  # MJX's and Brax's notices
        warnings.simplefilter("ignore")
        from brax import envs

        base, _, backend = name.partition(":")
        if base not in envs._envs:  # brax lists its envs in no public name
            raise ConfigError(f"--env-name {env_name}: brax has no {base!r}; it has {', '.join(sorted(envs._envs))}")
        try:
            env = envs.get_environment(base, **({"backend": backend} if backend else {}))
        except Exception as error:
            raise ConfigError(f"--env-name {env_name}: brax could not create it ({error})") from None

    def start(key):
        state = env.reset(key)
        return state.obs, state

    def transition(key, state, action):
        state = env.step(state, action)
        return state.obs, state, state.reward, state.done > 0.5

    action_space = spaces.Box(-1.0, 1.0, (env.action_size,), jnp.float32)
    observation_space = spaces.Box(-jnp.inf, jnp.inf, (env.observation_size,), jnp.float32)
    # A reset (the pipeline's initial state) costs a few steps: one fresh episode per 32 env steps,
    # each env finishing at a step taking a different one while they last.
    return suite_env(env_name, start, transition, (action_space, observation_space), 1000, envs_per_reset=32)


def craftax_env(env_name: str, name: str):
    """`craftax/NAME`: Craftax's env without auto-reset. Its own time limit is part of its game-over
    test (a termination, discount 0); here it is gymnax's truncation instead."""
    from craftax.craftax_env import make_craftax_env_from_name
    from gymnax.environments import spaces as gymnax_spaces

    try:
        env = make_craftax_env_from_name(name, auto_reset=False)
    except ValueError:
        raise ConfigError(
            f"--env-name {env_name}: craftax has no {name!r}; it has Craftax-Symbolic-v1, Craftax-Pixels-v1, "
            "Craftax-Classic-Symbolic-v1 and Craftax-Classic-Pixels-v1"
        ) from None
    params = env.default_params
    unlimited = params.replace(max_timesteps=2**30)  # the limit is gymnax's truncation, not a game over

    def start(key):
        return env.reset_env(key, params)

    def transition(key, state, action):
        obs, state, reward, game_over, _ = env.step_env(key, state, action, unlimited)
        return obs, state, reward, game_over

    observation = env.observation_space(params)  # Craftax's own space classes: the same as gymnax spaces
    spaces = (
        gymnax_spaces.Discrete(env.num_actions),
        gymnax_spaces.Box(observation.low, observation.high, observation.shape, observation.dtype),
    )
    # Generating a world costs about a fifth of stepping 256 envs: one fresh world per 256 env steps
    # (Craftax's own optimistic reset idea), each env finishing at a step taking a different one.
    return suite_env(env_name, start, transition, spaces, int(params.max_timesteps), envs_per_reset=256)


def xminigrid_env(env_name: str, name: str):
    """`xminigrid/MiniGrid-*`: XLand-MiniGrid's env without auto-reset. Its last step has discount 0
    when the goal is reached (a termination) and 1 at its step limit (a truncation, here gymnax's)."""
    import xminigrid
    from gymnax.environments import spaces

    if name not in xminigrid.registered_environments() or name.startswith("XLand-"):
        minigrid = [n for n in xminigrid.registered_environments() if n.startswith("MiniGrid-")]
        raise ConfigError(
            f"--env-name {env_name}: choose one of {', '.join(minigrid)} (XLand-* tasks need a ruleset from "
            "a downloaded benchmark, which this adapter does not load)"
        )
    env, params = xminigrid.make(name)

    def start(key):
        timestep = env.reset(params, key)
        return timestep.observation, timestep

    def transition(key, timestep, action):
        timestep = env.step(params, timestep, action)
        return timestep.observation, timestep, timestep.reward, timestep.discount == 0

    action_space = spaces.Discrete(env.num_actions(params))
    observation_space = spaces.Box(0, 255, env.observation_shape(params), jnp.uint8)
    # A reset (a new random layout) costs about two steps: one fresh episode per 32 env steps.
    return suite_env(
        env_name, start, transition, (action_space, observation_space), params.max_steps, envs_per_reset=32
    )


def configure_xla() -> None:
    """Sets, for this process, the XLA flags the command line trains with; a flag already in
    XLA_FLAGS is left as it is. XLA reads XLA_FLAGS once, when JAX starts its backend, so call
    this before the first JAX computation (importing gymnax is one). Library users call it to
    get the command line's CPU set-up; it never runs on import.

    - XLA's concurrency-optimised CPU scheduler (jaxlib 0.10) has deadlocked vmapped PPO here;
      the older scheduler has not. This costs some CPU throughput (benchmarks/README.md).
    - On a CPU-only install, backend optimisation level 1 compiles faster at the same speed,
      and the host is split into one XLA device per core (unless JAX_NUM_CPU_DEVICES says how
      many), over which `main` spreads its runs: XLA:CPU runs one device's small kernels on
      one core.
    """
    try:
        from jax._src import xla_bridge  # JAX has no public way to ask whether its backend started

        started = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):
        started = False
    if started:
        warnings.warn(
            "configure_xla(): JAX's backend has already started, so XLA flags can no longer "
            "take effect; call it before the first JAX computation",
            stacklevel=2,
        )
        return
    flags = {"xla_cpu_enable_concurrency_optimized_scheduler": "false"}
    if cpu_only():
        flags["xla_backend_optimization_level"] = "1"
        if cpu_cores() > 1 and "JAX_NUM_CPU_DEVICES" not in os.environ:
            flags["xla_force_host_platform_device_count"] = str(cpu_cores())
    for name, value in flags.items():
        if name not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{name}={value}".strip()


def cpu_only() -> bool:
    """No accelerator plugin is installed, or JAX_PLATFORMS asks for the CPU; told without
    starting JAX's backend."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return True
    return not any(m.name.startswith(("jax_cuda", "jax_rocm", "libtpu")) for m in pkgutil.iter_modules())


def cpu_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# --------------------------------------------------------------------------------------
# Greedy evaluation and recorded episodes
# --------------------------------------------------------------------------------------
class Evaluating(NamedTuple):
    """What the evaluation loop carries from one env step to the next."""

    env_state: Any
    obs: jax.Array
    policy: Any  # the greedy policy's own carry (e.g. a recurrent state)
    start: jax.Array  # [episodes] bool: obs begins an episode
    total: jax.Array  # [episodes] return so far
    alive: jax.Array  # [episodes] bool: the episode has not ended yet
    rng: jax.Array
    t: jax.Array  # env steps taken


def make_evaluate(config: Config) -> Callable:
    """Returns `evaluate(params, rng) -> mean return` of `eval_episodes` greedy episodes, one per
    env, each scored until it ends; `params` as `saved_params` gives them."""
    validate(config)
    env = VecEnv(config.env_name, config.eval_episodes)
    policy = make_greedy_policy(config, env)

    def evaluate(params, rng: jax.Array) -> jax.Array:
        reset_key, rng = jax.random.split(rng)
        obs, env_state = env.reset(reset_key)

        def running(carry: Evaluating):
            return carry.alive.any() & (carry.t < env.max_episode_steps)

        def env_step(carry: Evaluating):
            rng, key = jax.random.split(carry.rng)
            noise = jax.tree.map(lambda x: x[0], env.presample(key, 1, resets=False))
            policy_carry, action = policy.act(params, carry.policy, carry.obs, carry.start)
            step = env.step(noise, carry.env_state, action)
            done = step.terminated | step.truncated
            return Evaluating(
                env_state=step.state,
                obs=step.obs,
                policy=policy_carry,
                start=done,
                total=carry.total + jnp.where(carry.alive, step.reward, 0.0),
                alive=carry.alive & ~done,
                rng=rng,
                t=carry.t + 1,
            )

        first = Evaluating(
            env_state=env_state,
            obs=obs,
            policy=policy.init(env.num_envs),
            start=jnp.ones(env.num_envs, bool),
            total=jnp.zeros(env.num_envs),
            alive=jnp.ones(env.num_envs, bool),
            rng=rng,
            t=0,
        )
        return jax.lax.while_loop(running, env_step, first).total.mean()

    return evaluate


def make_episode_recorder(config: Config) -> Callable:
    """Returns `record(params, rng) -> (env states, rewards, alive)`, each [max_episode_steps]:
    one greedy episode (the first of `evaluate`'s with the same key), the state each step starts
    from, its reward, and whether the episode was still running."""
    env = VecEnv(config.env_name, 1)
    policy = make_greedy_policy(config, env)

    def record(params, rng: jax.Array):
        reset_key, rng = jax.random.split(rng)
        obs, env_state = env.reset(reset_key)

        def env_step(carry: Evaluating, _):
            rng, key = jax.random.split(carry.rng)
            noise = jax.tree.map(lambda x: x[0], env.presample(key, 1, resets=False))
            policy_carry, action = policy.act(params, carry.policy, carry.obs, carry.start)
            step = env.step(noise, carry.env_state, action)
            done = step.terminated | step.truncated
            after = carry._replace(
                env_state=step.state, obs=step.obs, policy=policy_carry, start=done, alive=carry.alive & ~done, rng=rng
            )
            return after, (carry.env_state, step.reward, carry.alive)

        first = Evaluating(
            env_state=env_state,
            obs=obs,
            policy=policy.init(1),
            start=jnp.ones(1, bool),
            total=jnp.zeros(1),
            alive=jnp.ones(1, bool),
            rng=rng,
            t=0,
        )
        _, (states, rewards, alive) = jax.lax.scan(env_step, first, None, env.max_episode_steps)
        return jax.tree.map(lambda x: x[:, 0], (states, rewards, alive))

    return record


# What gymnax's Visualizer can draw (classic control through gymnasium's pygame renderer).
DRAWABLE = {
    "MinAtar": ("Asterix-MinAtar", "Breakout-MinAtar", "Freeway-MinAtar", "Seaquest-MinAtar", "SpaceInvaders-MinAtar"),
    "pygame": ("Acrobot-v1", "CartPole-v1", "Pendulum-v1", "MountainCar-v0", "MountainCarContinuous-v0"),
    "other": ("Catch-bsuite", "Pong-misc", "PointRobot-misc", "MetaMaze-misc", "FourRooms-misc"),
}


def drawable_env(env_name: str):
    """(env, params) that gymnax can draw for `env_name` (a wrapper's inner env if need be), or a
    ConfigError saying why not."""
    env, env_params = make_env(env_name)
    while env.name not in sum(DRAWABLE.values(), ()) and hasattr(env, "env"):
        env = env.env  # e.g. an observation wrapper: the states are its inner env's
    if env.name not in sum(DRAWABLE.values(), ()):
        raise ConfigError(f"--render: gymnax cannot draw {env_name}; it draws {', '.join(sum(DRAWABLE.values(), ()))}")
    if env.name in DRAWABLE["pygame"] and importlib.util.find_spec("pygame") is None:
        raise ConfigError(f"--render: gymnax draws {env.name} with pygame: pip install pygame")
    return env, env_params


def render_episodes(job: "Job", plan: "RunPlan", params, say: Callable) -> None:
    """One greedy episode per run as an animated GIF, one frame per step, in RUN_DIR/episodes."""
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame draws off screen
    os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
    import matplotlib

    matplotlib.use("Agg")
    from gymnax.visualize import Visualizer

    env, env_params = drawable_env(job.config.env_name)
    record = jax.jit(make_episode_recorder(job.config))
    folder = os.path.join(job.run_dir, "episodes")
    os.makedirs(folder, exist_ok=True)
    for point_index, point in enumerate(plan.points):
        for seed in range(plan.num_seeds):
            run = point_index * plan.num_seeds + seed
            states, rewards, alive = jax.device_get(
                record(jax.tree.map(lambda x: x[point_index, seed], params), plan.eval_keys[run])
            )
            length = int(alive.sum())
            frames = [jax.tree.map(lambda x: x[t], states) for t in range(length)]
            name = "-".join(filter(None, [point_label(point).replace(", ", "-"), f"seed{seed}"])) + ".gif"
            Visualizer(env, env_params, frames, np.cumsum(rewards[:length])).animate(os.path.join(folder, name))
            say(f"{name}: {length} steps, return {float(rewards[:length].sum()):.1f}")


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def program_name() -> str:
    return os.path.basename(sys.argv[0]) or f"{ALGORITHM}.py"


def build_parser(defaults: bool = True) -> _Parser:
    """Every Config field as a flag, and the harness's own options; with `defaults=False`, the
    options not given on the command line are left out (to tell which were given)."""
    default = (lambda value: value) if defaults else (lambda value: argparse.SUPPRESS)
    parser = _Parser(
        prog=program_name(),
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=f"--env-name takes any id in gymnax.registered_envs, or {suite_help()}; a suite is installed "
        "by its pip line (all three: pip install -r requirements-envs.txt).",
    )
    for field in dataclasses.fields(Config):
        flag = "--" + _flag(field.name)
        if field.type is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default(field.default), help=field.metadata["doc"]
            )
        else:
            parser.add_argument(
                flag,
                type=_integer if field.type is int else field.type,
                default=default(field.default),
                metavar=field.type.__name__.upper(),
                help=field.metadata["doc"],
            )
    harness = parser.add_argument_group("run harness")
    harness.add_argument(
        "--sweep",
        action="append",
        default=default([]),
        metavar="FIELD=V1,V2,...",
        help=f"train every value in one compiled program (repeat for a grid); FIELD is one "
        f"of {', '.join(map(_flag, SWEEPABLE))}",
    )
    harness.add_argument("--runs-dir", default=default("runs"), help="results go to a new directory under this one")
    harness.add_argument(
        "--checkpoint",
        action=argparse.BooleanOptionalAction,
        default=default(True),
        help="write the whole training state into RUN_DIR/checkpoint.msgpack when training ends (and on Ctrl-C)",
    )
    harness.add_argument(
        "--checkpoint-every",
        type=_integer,
        default=default(0),
        metavar="CHUNKS",
        help="also write it every CHUNKS chunks of ~10%% of training (0: only at the end)",
    )
    harness.add_argument(
        "--checkpoint-buffer",
        action=argparse.BooleanOptionalAction,
        default=default(True),
        help="keep the replay buffer (if any) in checkpoints; a run resumed without one restarts it empty",
    )
    harness.add_argument(
        "--resume",
        metavar="RUN_DIR",
        default=default(None),
        help="continue the run in RUN_DIR from its checkpoint; only --total-timesteps may change",
    )
    harness.add_argument(
        "--eval-only",
        metavar="RUN_DIR",
        default=default(None),
        help="evaluate the parameters RUN_DIR saved (--eval-episodes may change); write RUN_DIR/evaluation.json",
    )
    harness.add_argument(
        "--render",
        action="store_true",
        default=default(False),
        help="with --eval-only: also draw one greedy episode per run, RUN_DIR/episodes/*.gif",
    )
    harness.add_argument(
        "--track",
        choices=("tensorboard", "wandb"),
        default=default(None),
        help="stream every update's metrics of every run to TensorBoard (RUN_DIR/tensorboard) or to Weights & "
        "Biases (WANDB_MODE=offline works without a network)",
    )
    harness.add_argument("--wandb-project", default=default(ALGORITHM), help="the W&B project of --track wandb")
    harness.add_argument(
        "--compile-cache",
        action=argparse.BooleanOptionalAction,
        default=default(True),
        help="JAX persistent compilation cache (JAX_COMPILATION_CACHE_DIR, else ~/.cache/jax_rl_compile)",
    )
    harness.add_argument(
        "--quiet", action="store_true", default=default(False), help="print only the results directory"
    )
    return parser


def parse_args(argv: Sequence[str] | None = None):
    """(Config, sweep {field: values}, the other options, the names of the options given)."""
    args = build_parser().parse_args(argv)
    given = set(vars(build_parser(defaults=False).parse_args(argv)))
    config = Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)})
    return config, parse_sweep(args.sweep), args, given


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
            raise ConfigError(
                f"--sweep {spec!r}: expected FIELD=V1,V2,... with FIELD one of " + ", ".join(map(_flag, SWEEPABLE))
            )
        try:
            sweep[name] = [float(v) for v in values.split(",")]
        except ValueError:
            raise ConfigError(f"--sweep {spec!r}: values must be numbers separated by commas") from None
    return sweep


def sweep_points(config: Config, sweep: dict) -> list[dict]:
    """The grid of hyperparameter values, one dict per point; [{}] when nothing is swept."""
    points = [dict(zip(sweep, values, strict=True)) for values in itertools.product(*sweep.values())]
    for point in points:
        try:
            validate_hparams({name: point.get(name, getattr(config, name)) for name in SWEEPABLE})
        except ConfigError as error:
            raise ConfigError(f"--sweep value: {error}") from None
    return points


# --------------------------------------------------------------------------------------
# Runs over devices
# --------------------------------------------------------------------------------------
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


class RunPlan(NamedTuple):
    """Every run of one command: [sweep point, seed] flattened into one leading run axis (every
    point trains the same seeds), padded to a multiple of the device count."""

    points: list  # the sweep points, {field: value} each; [{}] without --sweep
    num_seeds: int
    keys: np.ndarray  # [padded runs, 2] training keys
    hparams: HParams  # [padded runs] each run's hyperparameters
    eval_keys: np.ndarray  # [padded runs, 2] evaluation keys
    sharding: jax.sharding.NamedSharding

    @property
    def num_runs(self) -> int:
        return len(self.points) * self.num_seeds

    def to_host(self, tree):
        """Run-axis arrays as host arrays [points, seeds, ...], padding dropped."""
        return gather_runs(tree, (len(self.points), self.num_seeds))


def plan_runs(config: Config, points: list[dict]) -> RunPlan:
    num_runs = len(points) * config.num_seeds
    seed_keys = jax.random.split(jax.random.PRNGKey(config.seed), config.num_seeds)
    eval_keys = jax.random.split(jax.random.PRNGKey(config.seed + 1), config.num_seeds)
    values = np.array([[point.get(name, getattr(config, name)) for name in SWEEPABLE] for point in points], np.float32)
    hparams = HParams(*np.repeat(values, config.num_seeds, axis=0).T)
    every_point = lambda keys: np.tile(keys, (len(points), 1))  # noqa: E731
    return RunPlan(
        points=points,
        num_seeds=config.num_seeds,
        keys=pad_runs(every_point(seed_keys), num_runs),
        hparams=pad_runs(hparams, num_runs),
        eval_keys=pad_runs(every_point(eval_keys), num_runs),
        sharding=runs_sharding(num_runs),
    )


class Programs(NamedTuple):
    run: Callable  # (runners, first update) -> (runners, metrics of `chunk` updates), compiled
    evaluate: Callable  # (saved params, keys) -> mean greedy return of every run
    chunk: int  # updates per call of `run`


def compile_programs(config: Config, plan: RunPlan):
    """The first runners (on the devices) and the compiled programs that train and evaluate them."""
    train = make_train(config)
    # Initialisation runs on one device and is then spread out: flax's orthogonal init (a LAPACK
    # QR) deadlocked XLA:CPU when executed on several devices at once. It is cheap either way.
    runner = jax.device_put(jax.jit(jax.vmap(train.init))(plan.keys, plan.hparams), plan.sharding)
    chunk = max(1, math.ceil(config.num_updates / 10))  # ~10 progress reports
    # The runners are donated: each chunk updates them (replay buffers included) in place.
    run = jax.jit(
        jax.vmap(lambda runner, first: train.run(runner, first, chunk), (0, None)),
        out_shardings=plan.sharding,
        donate_argnums=0,
    )
    evaluate = jax.jit(jax.vmap(make_evaluate(config)), out_shardings=plan.sharding)
    run = run.lower(runner, jnp.int32(0)).compile()
    jax.block_until_ready(runner)
    return runner, Programs(run=run, evaluate=evaluate, chunk=chunk)


# --------------------------------------------------------------------------------------
# Training in chunks, with progress
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class TrainingLog:
    """What has reached the host so far: each finished chunk's metrics ([points, seeds, updates]
    per name) and when it finished (seconds of training, earlier sessions of a resumed run
    included). A resumed run's first chunk is everything trained before, with its wall_seconds."""

    chunks: list = dataclasses.field(default_factory=list)
    chunk_ends: list = dataclasses.field(default_factory=list)

    @property
    def num_updates(self) -> int:
        return sum(chunk["episode_return"].shape[-1] for chunk in self.chunks)

    @property
    def seconds(self) -> float:
        return self.chunk_ends[-1] if self.chunk_ends else 0.0

    def metrics(self) -> dict:
        """Every finished update's metrics, plus `wall_seconds`: when each update had finished,
        measured at chunk ends and interpolated within a chunk (its updates cost alike)."""
        if not self.chunks:
            return {}
        names = [name for name in self.chunks[-1] if name != "wall_seconds"]
        metrics = {name: np.concatenate([chunk[name] for chunk in self.chunks], axis=-1) for name in names}
        walls, previous = [], 0.0
        for chunk, end in zip(self.chunks, self.chunk_ends, strict=True):
            updates = chunk["episode_return"].shape[-1]
            walls.append(chunk.get("wall_seconds", previous + (end - previous) * np.arange(1, updates + 1) / updates))
            previous = end
        metrics["wall_seconds"] = np.concatenate(walls)
        return metrics


def train_in_chunks(job: "Job", plan: RunPlan, programs: Programs, runner, log: TrainingLog, report: Callable):
    """Runs the updates not yet in `log` as calls of one compiled chunk, reporting between them:
    a callback inside the program would keep it out of the persistent compile cache. Each chunk
    is dispatched before the previous one is reported, so reporting costs no training time; the
    pipeline waits only where a checkpoint is due (--checkpoint-every, or Ctrl-C: then training
    stops there). Returns (final runners, whether Ctrl-C stopped it); `log` holds every finished
    chunk, also when this raises."""
    config, every, pending = job.config, job.args.checkpoint_every, None
    start = time.perf_counter() - log.seconds
    with StopRequest() as stop:
        for index, first in enumerate(range(log.num_updates, config.num_updates, programs.chunk)):
            runner, metrics = programs.run(runner, jnp.int32(first))
            if pending is not None:
                report(record_chunk(config, plan, log, *pending, start))
            pending = (first, metrics)
            if first + programs.chunk < config.num_updates and (stop.requested or (every and (index + 1) % every == 0)):
                report(record_chunk(config, plan, log, *pending, start))
                pending = None
                save_checkpoint(job, plan, runner, log)
                if stop.requested:
                    return runner, True
        report(record_chunk(config, plan, log, *pending, start))
    return runner, False


def record_chunk(config: Config, plan: RunPlan, log: TrainingLog, first: int, metrics: dict, start: float) -> dict:
    """Brings a chunk's metrics to the host (waiting for it to finish) and logs them; updates
    past the config's end, which the last chunk skips, are dropped. Returns them."""
    updates = min(config.num_updates - first, metrics["episode_return"].shape[-1])
    metrics = {name: value[..., :updates] for name, value in plan.to_host(metrics).items()}
    log.chunks.append(metrics)
    log.chunk_ends.append(time.perf_counter() - start)
    return metrics


def progress_reporter(config: Config, plan: RunPlan, log: TrainingLog, say: Callable, tracker) -> Callable:
    """What happens to each chunk's metrics once on the host: a progress line, and the tracker."""

    def report(metrics: dict) -> None:
        done, seconds = log.num_updates, log.seconds
        steps = done * config.steps_per_update
        say(
            f"[{100 * done / config.num_updates:5.1f}%] update {done}/{config.num_updates}  env steps {steps:,}  "
            f"return {_nanmean(metrics['episode_return']):8.2f}  {steps * plan.num_runs / seconds:,.0f} steps/s"
        )
        if tracker is not None:
            tracker.log(metrics)

    return report


class StopRequest:
    """Ctrl-C during training: the first asks to stop at the end of the current chunk, after a
    checkpoint; a second one stops at once (KeyboardInterrupt)."""

    def __init__(self):
        self.requested, self.previous = False, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self.previous = signal.signal(signal.SIGINT, self.handle)
        return self

    def handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(
            "Ctrl-C: stopping after this chunk with a checkpoint (Ctrl-C again: stop now)", file=sys.stderr, flush=True
        )

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


# --------------------------------------------------------------------------------------
# Checkpoints, resume and the run's source directory
# --------------------------------------------------------------------------------------
CHECKPOINT = "checkpoint.msgpack"


class Job(NamedTuple):
    """One command: what to train (or evaluate) and where."""

    config: Config
    sweep: dict
    points: list
    args: argparse.Namespace
    run_dir: str | None  # None on every host but host 0
    checkpoint: dict | None  # what --resume continues from
    params: Any  # what --eval-only evaluates


def prepare(argv: Sequence[str] | None, is_host_0: bool) -> Job:
    """Parses and checks the command line, reads what --resume or --eval-only continue from, and
    makes a new run's directory: every ConfigError comes before anything compiles."""
    config, sweep, args, given = parse_args(argv)
    if args.resume and args.eval_only:
        raise ConfigError("--resume and --eval-only: give one of them")
    if args.render and not args.eval_only:
        raise ConfigError("--render draws a trained policy: use it with --eval-only RUN_DIR")
    source = args.resume or args.eval_only
    if source:
        option = "--resume" if args.resume else "--eval-only"
        config, sweep = saved_config(option, source, config, sweep, given)
    validate(config)
    points = sweep_points(config, sweep)
    if not args.eval_only:
        check_resources(config, len(points) * config.num_seeds)
    if args.render:
        drawable_env(config.env_name)
    if args.track:
        module = {"tensorboard": "tensorboardX", "wandb": "wandb"}[args.track]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"--track {args.track} needs {module}: pip install {module}")
    checkpoint = load_checkpoint(source, config) if args.resume else None
    params = load_params(source) if args.eval_only else None
    run_dir = source or (create_run_dir(args.runs_dir, config, sweep) if is_host_0 else None)
    if args.resume and is_host_0:  # the run's config.json says what it now trains for
        write_file(os.path.join(source, "config.json"), config_json(config, sweep))
    return Job(
        config=config,
        sweep=sweep,
        points=points,
        args=args,
        run_dir=run_dir if is_host_0 else None,
        checkpoint=checkpoint,
        params=params,
    )


def saved_config(option: str, run_dir: str, config: Config, sweep: dict, given: set):
    """The Config and sweep a run directory was trained with; of the flags given now, only those
    that cannot change the compiled program or the results so far may differ."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{option} {run_dir}: no readable config.json there ({error})") from None
    fields = {field.name for field in dataclasses.fields(Config)}
    saved_sweep = saved.pop("sweep", {})
    result = Config(**{name: value for name, value in saved.items() if name in fields})
    may_change = {"--resume": {"total_timesteps"}, "--eval-only": {"eval_episodes"}}[option]
    for name in sorted(given & fields):
        if getattr(config, name) != getattr(result, name):
            if name not in may_change:
                raise ConfigError(
                    f"--{_flag(name)} cannot change with {option} (the run has "
                    f"{getattr(result, name)!r}); may change: {', '.join(map(_flag, may_change))}"
                )
            result = dataclasses.replace(result, **{name: getattr(config, name)})
    if "sweep" in given and sweep != saved_sweep:
        raise ConfigError(f"--sweep cannot change with {option} (the run swept {saved_sweep})")
    return result, saved_sweep


def save_checkpoint(job: Job, plan: RunPlan, runner, log: TrainingLog) -> int | None:
    """Writes every run's whole training state (every Runner field: parameters, optimizer, env
    states, observations, episode counters, statistics, random keys, the replay buffer unless
    --no-checkpoint-buffer) with the metrics so far into RUN_DIR/checkpoint.msgpack, atomically:
    a crash while writing leaves the previous checkpoint whole. Returns its size on host 0."""
    if not job.args.checkpoint:
        return None
    state = plan.to_host(runner)  # every host takes part: a gather under jax.distributed
    keep = job.args.checkpoint_buffer
    leaves = {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(state)
        if keep or not is_buffer(path)
    }
    if job.run_dir is None:
        return None
    data = serialization.msgpack_serialize(
        {
            "algorithm": ALGORITHM,
            "updates_done": log.num_updates,
            "train_seconds": log.seconds,
            "metrics": log.metrics(),
            "runner": leaves,
            "buffer_saved": keep or not hasattr(runner, "buffer"),
        }
    )
    write_file(os.path.join(job.run_dir, CHECKPOINT), data)
    return len(data)


def is_buffer(path) -> bool:
    return getattr(path[0], "name", None) == "buffer"


def load_checkpoint(run_dir: str, config: Config) -> dict:
    try:
        with open(os.path.join(run_dir, CHECKPOINT), "rb") as f:
            checkpoint = serialization.msgpack_restore(f.read())
    except (OSError, ValueError) as error:
        raise ConfigError(f"--resume {run_dir}: no readable {CHECKPOINT} there ({error})") from None
    if checkpoint["algorithm"] != ALGORITHM:
        raise ConfigError(f"--resume {run_dir}: a checkpoint of {checkpoint['algorithm']}.py, not {ALGORITHM}.py")
    done = int(checkpoint["updates_done"])
    if done > config.num_updates:
        raise ConfigError(
            f"--total-timesteps {config.total_timesteps:,}: the run has already trained "
            f"{done * config.steps_per_update:,} steps per run"
        )
    return checkpoint


def restore_runner(runner, checkpoint: dict, plan: RunPlan):
    """The fresh runners with every saved field put back; a field the checkpoint left out (the
    replay buffer) stays as `init` made it."""
    saved = checkpoint["runner"]

    def restore(path, leaf):
        key = jax.tree_util.keystr(path)
        if key not in saved:
            return leaf
        value = np.asarray(saved[key])
        value = value.reshape(plan.num_runs, *value.shape[2:])  # [points, seeds, ...] -> [runs, ...]
        if value.shape[1:] != leaf.shape[1:] or value.dtype != leaf.dtype:
            raise ConfigError(
                f"--resume: the checkpoint's {key} is {value.dtype}{list(value.shape[1:])}, "
                f"this program's {leaf.dtype}{list(leaf.shape[1:])}"
            )
        return pad_runs(value, plan.num_runs)

    return jax.device_put(jax.tree_util.tree_map_with_path(restore, runner), plan.sharding)


def resume_log(checkpoint: dict) -> TrainingLog:
    metrics = {name: np.asarray(value) for name, value in checkpoint["metrics"].items()}
    return TrainingLog(chunks=[metrics], chunk_ends=[float(checkpoint["train_seconds"])])


def load_params(run_dir: str):
    try:
        with open(os.path.join(run_dir, "params.msgpack"), "rb") as f:
            return serialization.msgpack_restore(f.read())
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"--eval-only {run_dir}: no readable params.msgpack there ({error}); a stopped "
            "run writes it once --resume has finished it"
        ) from None


# --------------------------------------------------------------------------------------
# Tracking (--track)
# --------------------------------------------------------------------------------------
class Tracker:
    """Every update's metrics of every run, streamed from the host as each chunk arrives, with
    the config first and the summary last. Imported only when asked for."""

    def __init__(self, job: Job, plan: RunPlan):
        self.kind, self.plan = job.args.track, plan
        config = {**dataclasses.asdict(job.config), "sweep": job.sweep}
        if self.kind == "tensorboard":
            from tensorboardX import SummaryWriter

            self.writer = SummaryWriter(os.path.join(job.run_dir, "tensorboard"))
            self.writer.add_text("config", "    " + json.dumps(config, indent=2).replace("\n", "\n    "))
        else:
            import wandb

            self.run = wandb.init(
                project=job.args.wandb_project,
                name=os.path.basename(os.path.normpath(job.run_dir)),
                dir=job.run_dir,
                config=config,
            )
        self.labels = [
            f"{point_label(point) + ' ' if point else ''}seed{seed}"
            for point in plan.points
            for seed in range(plan.num_seeds)
        ]

    def log(self, metrics: dict) -> None:
        """metrics: {name: [points, seeds, updates]}; logged at each update's env steps."""
        names = [name for name in metrics if name not in ("env_steps", "wall_seconds")]
        for update in range(metrics["env_steps"].shape[-1]):
            step = int(metrics["env_steps"][0, 0, update])
            values = {
                f"{name}/{label}": float(metrics[name].reshape(-1, metrics[name].shape[-1])[run, update])
                for name in names
                for run, label in enumerate(self.labels)
            }
            values = {tag: value for tag, value in values.items() if math.isfinite(value)}
            if self.kind == "tensorboard":
                for tag, value in values.items():
                    self.writer.add_scalar(tag, value, step)
            else:
                self.run.log(values, step=step)

    def finish(self, summary: dict) -> None:
        if self.kind == "tensorboard":
            self.writer.add_text("summary", "    " + json.dumps(summary, indent=2).replace("\n", "\n    "))
            self.writer.close()
        else:
            self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, int | float | str)})
            self.run.finish()


# --------------------------------------------------------------------------------------
# Results: summary, run directory, report
# --------------------------------------------------------------------------------------
FINAL_FRACTION = 0.05  # a run's final return: its episodes that ended in this last share of the updates


def final_returns(metrics: dict, fraction: float = FINAL_FRACTION) -> np.ndarray:
    """Per run: mean return of the episodes that ended in the last `fraction` of updates."""
    returns, counts = metrics["episode_return"], metrics["episodes_finished"]
    last = max(1, int(math.ceil(returns.shape[-1] * fraction)))
    returns, counts = returns[..., -last:], counts[..., -last:]
    total = np.where(counts > 0, returns * counts, 0.0).sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return total / counts.sum(-1)


def window_returns(metrics: dict, fraction: float = FINAL_FRACTION) -> np.ndarray:
    """Per run and update: the mean return of the run's episodes that ended in the trailing window
    of `fraction` of all updates, carried on through updates whose window holds none (NaN before
    the first). Where the last window holds episodes, the last value is `final_returns`: the
    learning curves are drawn from this, so they agree with the tables."""
    returns, counts = metrics["episode_return"], metrics["episodes_finished"]
    window = max(1, int(math.ceil(returns.shape[-1] * fraction)))

    def trailing_sum(x):
        total = np.cumsum(x, axis=-1, dtype=np.float64)
        return total - np.concatenate([np.zeros_like(total[..., :window]), total[..., :-window]], axis=-1)

    count = trailing_sum(counts)
    with np.errstate(invalid="ignore", divide="ignore"):
        value = np.where(count > 0, trailing_sum(np.where(counts > 0, returns * counts, 0.0)) / count, np.nan)
    filled = np.maximum.accumulate(np.where(np.isnan(value), -1, np.arange(value.shape[-1])), axis=-1)
    return np.where(filled >= 0, np.take_along_axis(value, np.maximum(filled, 0), axis=-1), np.nan)


def iqm(values: np.ndarray) -> np.ndarray:
    """Interquartile mean over the last axis (Agarwal et al. 2021): the mean of what is left after
    cutting int(n / 4) values from each end, as scipy.stats.trim_mean(values, 0.25)."""
    values = np.sort(values, axis=-1)
    cut = int(values.shape[-1] * 0.25)
    return values[..., cut : values.shape[-1] - cut].mean(-1)


def bootstrap_interval(values: np.ndarray, reps: int = 2000, level: float = 0.95, seed: int = 0) -> tuple:
    """Percentile bootstrap confidence interval of the IQM of `values` (seeds resampled with
    replacement; one task, so stratifying changes nothing)."""
    values = np.asarray(values, np.float64)
    samples = values[np.random.default_rng(seed).integers(0, len(values), (reps, len(values)))]
    low, high = np.percentile(iqm(samples), [50 * (1 - level), 50 * (1 + level)])
    return float(low), float(high)


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
    for name in ("jax", "jaxlib", "flax", "optax", "distrax", "gymnax", "chex", "numpy"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def point_label(point: dict) -> str:
    return ", ".join(f"{name}={value:g}" for name, value in point.items())


def summarise(config: Config, plan: RunPlan, metrics: dict, eval_returns: np.ndarray | None, seconds: dict) -> dict:
    """summary.json: the best sweep point's figures at the top level, every point under `sweep`."""
    finals = final_returns(metrics)  # [points, seeds]
    per_point = []
    for index, point in enumerate(plan.points):
        final = finals[index]
        finite = final[np.isfinite(final)]
        per_point.append(
            {
                "sweep_point": point,
                "final_return_mean": _number(_nanmean(final)),
                "final_return_std": _number(np.sqrt(_nanmean((final - _nanmean(final)) ** 2))),
                "final_return_iqm": _number(iqm(finite)) if len(finite) else None,
                "final_return_iqm_ci95": list(bootstrap_interval(finite)) if len(finite) else None,
                "final_return_per_seed": [_number(x) for x in final],
                "eval_return_mean": None if eval_returns is None else _number(np.mean(eval_returns[index])),
            }
        )
    ranked = [-math.inf if p["final_return_mean"] is None else p["final_return_mean"] for p in per_point]
    best = int(np.argmax(ranked))
    trained = metrics["episode_return"].shape[-1] * config.steps_per_update
    summary = {
        "algorithm": ALGORITHM,
        "env_name": config.env_name,
        "num_seeds": plan.num_seeds,
        "total_timesteps": config.total_timesteps,
        "trained_timesteps": trained,
        **{k: v for k, v in per_point[best].items() if k != "sweep_point"},
        **{f"{name}_seconds": value for name, value in seconds.items()},
        "steps_per_second": trained * plan.num_runs / seconds["train"],
        "backend": jax.default_backend(),
        "devices": [str(d) for d in run_devices(plan.num_runs)],
        "versions": package_versions(),
    }
    if plan.points != [{}]:
        summary.update(best_sweep_point=plan.points[best], sweep=per_point)
    nonfinite = first_nonfinite(config, plan, metrics)
    if nonfinite:
        summary["nonfinite"] = nonfinite
    return summary


def first_nonfinite(config: Config, plan: RunPlan, metrics: dict) -> dict | None:
    """Where NaN or inf first appeared in a loss or the parameters: update, env step, seed, point."""
    nonfinite = ~metrics["finite"]
    if not nonfinite.any():
        return None
    update = int(np.argmax(nonfinite.any(axis=(0, 1))))
    point, seed = map(int, np.argwhere(nonfinite[:, :, update])[0])
    return {
        "first_update": update + 1,
        "env_steps": (update + 1) * config.steps_per_update,
        "seed_index": seed,
        "sweep_point": plan.points[point],
    }


def create_run_dir(runs_dir: str, config: Config, sweep: dict) -> str:
    """A new directory under `runs_dir` holding config.json, made before anything compiles; a
    `runs_dir` that cannot hold it is a ConfigError. Never reuses a directory."""
    try:
        run_dir = new_run_dir(runs_dir, config)
        write_file(os.path.join(run_dir, "config.json"), config_json(config, sweep))
    except OSError as error:
        raise ConfigError(
            f"--runs-dir {runs_dir}: cannot write a run directory there ({error.strerror or error})"
        ) from None
    return run_dir


def config_json(config: Config, sweep: dict) -> bytes:
    return json.dumps({**dataclasses.asdict(config), "sweep": sweep}, indent=2).encode()


def new_run_dir(runs_dir: str, config: Config) -> str:
    """A directory no earlier run has used: created atomically, never reused."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for attempt in itertools.count():
        name = re.sub(r"[^A-Za-z0-9._-]", "-", config.env_name)  # SUITE/NAME[:BACKEND] as one folder name
        path = os.path.join(runs_dir, f"{ALGORITHM}-{name}-{stamp}" + (f"-{attempt}" if attempt else ""))
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            continue


def write_file(path: str, data: bytes) -> None:
    """Writes to a temporary name, then renames: a file is either whole or not there."""
    with open(path + ".partial", "wb") as f:
        f.write(data)
    os.replace(path + ".partial", path)


def write_results(run_dir: str, plan: RunPlan, metrics: dict, eval_returns, params, summary: dict) -> None:
    """metrics.npz, params.msgpack (when training finished) and summary.json, then the plot."""
    arrays = {
        **{f"sweep_{name}": np.array([point[name] for point in plan.points]) for name in plan.points[0]},
        **metrics,
    }
    if eval_returns is not None:
        arrays["eval_return"] = eval_returns
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    write_file(os.path.join(run_dir, "metrics.npz"), buffer.getvalue())
    if params is not None:
        write_file(os.path.join(run_dir, "params.msgpack"), serialization.to_bytes(params))
    write_file(os.path.join(run_dir, "summary.json"), json.dumps(summary, indent=2).encode())
    try:
        plot_learning_curves(os.path.join(run_dir, "learning_curve.png"), metrics, plan)
    except Exception as error:  # everything else is written: a broken plot must not cost the run
        print(f"{program_name()}: warning: could not draw learning_curve.png ({error})", file=sys.stderr)


def plot_learning_curves(path: str, metrics: dict, plan: RunPlan) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    steps = metrics["env_steps"][0, 0]
    for point, returns in zip(plan.points, window_returns(metrics), strict=True):  # returns: [seeds, updates]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mean, low, high = (np.nanmean(returns, 0), np.nanmin(returns, 0), np.nanmax(returns, 0))
        (line,) = ax.plot(steps, mean, label=point_label(point) or f"mean of {plan.num_seeds} seeds")
        ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2)
    ax.set_xlabel("environment steps (per run)")
    ax.set_ylabel(f"return (each seed: episodes ending in the last {FINAL_FRACTION:.0%} of updates)")
    ax.set_title(f"{ALGORITHM}: mean over {plan.num_seeds} seeds, band min to max")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    plt.close(fig)
    write_file(path, buffer.getvalue())


def report(config: Config, plan: RunPlan, summary: dict, say: Callable) -> None:
    show = lambda x: "n/a" if x is None else f"{x:.1f}"  # noqa: E731
    for point in summary.get("sweep", [summary]):
        interval = point["final_return_iqm_ci95"] or [None, None]
        say(
            f"{point_label(point.get('sweep_point', {})) or 'final'}: return {show(point['final_return_mean'])} ± "
            f"{show(point['final_return_std'])}, IQM {show(point['final_return_iqm'])} (95% CI {show(interval[0])} to "
            f"{show(interval[1])}) over {plan.num_seeds} seeds (episodes ending in the last {FINAL_FRACTION:.0%} of "
            f"training), greedy eval {show(point['eval_return_mean'])}"
        )
    say(
        f"compile {summary['compile_seconds']:.1f} s, train {summary['train_seconds']:.1f} s "
        f"({summary['steps_per_second']:,.0f} env steps/s), eval {summary['eval_seconds']:.1f} s"
    )


def enable_compile_cache() -> None:
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser("~/.cache/jax_rl_compile"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


# --------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """The command line. Exit status: 0 done, 2 bad input (nothing compiled or written), 3 NaN or
    inf appeared, 1 training or writing stopped by an error, 130 stopped by Ctrl-C."""
    is_host_0 = jax.process_index() == 0  # under jax.distributed, host 0 reports and writes
    try:
        job = prepare(argv, is_host_0)
    except ConfigError as error:
        print(f"{program_name()}: error: {error}", file=sys.stderr)
        return 2
    say = print_progress if is_host_0 and not job.args.quiet else lambda *_: None
    if job.args.compile_cache:
        enable_compile_cache()
    plan = plan_runs(job.config, job.points)
    if job.args.eval_only:
        return evaluate_saved(job, plan, say)
    announce(job, plan, say)
    start = time.perf_counter()
    runner, programs = compile_programs(job.config, plan)
    seconds = {"compile": time.perf_counter() - start}
    say(f"compiled in {seconds['compile']:.1f} s")
    log = TrainingLog()
    if job.checkpoint:
        runner, log = restore_runner(runner, job.checkpoint, plan), resume_log(job.checkpoint)
    tracker = Tracker(job, plan) if job.args.track and job.run_dir else None
    try:
        runner, interrupted = train_in_chunks(
            job, plan, programs, runner, log, progress_reporter(job.config, plan, log, say, tracker)
        )
    except (Exception, KeyboardInterrupt) as error:
        return stopped_early(job, plan, log, error)
    if interrupted:
        return stopped_early(job, plan, log, KeyboardInterrupt(), checkpointed=True)
    seconds["train"] = log.seconds
    return finish(job, plan, programs, runner, log, seconds, say, tracker)


def announce(job: Job, plan: RunPlan, say: Callable) -> None:
    config = job.config
    say(
        f"{ALGORITHM} on {config.env_name}: {plan.num_runs} run(s) ({plan.num_seeds} seeds x {len(plan.points)} "
        f"sweep points), {config.num_updates} updates of {config.steps_per_update} env steps each, on "
        f"{len(run_devices(plan.num_runs))} {jax.default_backend()} device(s)"
    )
    if job.checkpoint:
        buffer = (
            ""
            if job.checkpoint["buffer_saved"]
            else (
                "; its replay buffer was not saved: it restarts empty and refills as the agent acts, and gradient "
                "steps go on at their schedule, drawing from what it holds"
            )
        )
        say(f"resuming {job.run_dir} after update {int(job.checkpoint['updates_done'])}{buffer}")
    if config.total_timesteps % config.steps_per_update:
        say(
            f"note: total_timesteps {config.total_timesteps:,} is not a multiple of the {config.steps_per_update} "
            f"env steps of an update; training {config.num_updates * config.steps_per_update:,} steps per run"
        )


def finish(
    job: Job, plan: RunPlan, programs: Programs, runner, log: TrainingLog, seconds: dict, say: Callable, tracker
) -> int:
    """Evaluates the trained runs, writes the checkpoint and the run directory, and reports;
    returns the exit status."""
    start = time.perf_counter()
    saved = saved_params(runner)
    eval_keys = jax.device_put(plan.eval_keys, plan.sharding)
    eval_returns, params = plan.to_host((programs.evaluate(saved, eval_keys), saved))
    seconds["eval"] = time.perf_counter() - start
    metrics = log.metrics()
    summary = summarise(job.config, plan, metrics, eval_returns, seconds)
    try:
        summary["checkpoint_bytes"] = save_checkpoint(job, plan, runner, log)
        if job.run_dir is None:  # not host 0
            return 3 if "nonfinite" in summary else 0
        write_results(job.run_dir, plan, metrics, eval_returns, params, summary)
    except OSError as error:
        print(f"{program_name()}: error: could not write the results into {job.run_dir}: {error}", file=sys.stderr)
        return 1
    if tracker is not None:
        tracker.finish(summary)
    report(job.config, plan, summary, say)
    print(f"results: {job.run_dir}", flush=True)
    if "nonfinite" in summary:
        bad = summary["nonfinite"]
        print(
            f"error: non-finite loss or parameters first appeared at update {bad['first_update']} (env step "
            f"{bad['env_steps']:,}, seed index {bad['seed_index']}"
            + (f", sweep point {bad['sweep_point']}" if plan.points != [{}] else "")
            + ")",
            file=sys.stderr,
        )
        return 3
    return 0


def evaluate_saved(job: Job, plan: RunPlan, say: Callable) -> int:
    """--eval-only: the saved parameters of every run, evaluated with the keys training's own
    evaluation used (so the same --eval-episodes give the same returns); --render draws them."""
    params = jax.tree.map(
        lambda x: pad_runs(np.reshape(x, (plan.num_runs, *np.shape(x)[2:])), plan.num_runs), job.params
    )
    evaluate = jax.jit(jax.vmap(make_evaluate(job.config)), out_shardings=plan.sharding)
    returns = plan.to_host(
        evaluate(jax.device_put(params, plan.sharding), jax.device_put(plan.eval_keys, plan.sharding))
    )
    if job.run_dir is None:
        return 0
    result = {
        "eval_episodes": job.config.eval_episodes,
        "points": [
            {
                "sweep_point": point,
                "eval_return_mean": float(np.mean(returns[index])),
                "eval_return_per_seed": [float(x) for x in returns[index]],
            }
            for index, point in enumerate(plan.points)
        ],
    }
    write_file(os.path.join(job.run_dir, "evaluation.json"), json.dumps(result, indent=2).encode())
    for point in result["points"]:
        say(
            f"{point_label(point['sweep_point']) or 'eval'}: greedy return {point['eval_return_mean']:.1f} over "
            f"{plan.num_seeds} seeds x {job.config.eval_episodes} episodes"
        )
    if job.args.render:
        render_episodes(job, plan, job.params, say)
    print(f"results: {job.run_dir}", flush=True)
    return 0


def print_progress(*args) -> None:
    print(*args, flush=True)


def stopped_early(job: Job, plan: RunPlan, log: TrainingLog, error: BaseException, checkpointed: bool = False) -> int:
    """Training stopped (an error, or Ctrl-C): the run directory keeps every update that finished
    and a summary that says why; one line on stderr says so, and how to go on after Ctrl-C."""
    interrupted = isinstance(error, KeyboardInterrupt)
    why = "interrupted (Ctrl-C)" if interrupted else f"{type(error).__name__}: {error}".splitlines()[0]
    config, run_dir = job.config, job.run_dir
    if run_dir is not None:
        summary = {
            "algorithm": ALGORITHM,
            "env_name": config.env_name,
            "num_seeds": plan.num_seeds,
            "stopped": why,
            "completed_updates": log.num_updates,
            "num_updates": config.num_updates,
        }
        try:
            if log.chunks:
                metrics = log.metrics()
                summary = {**summarise(config, plan, metrics, None, {"train": log.seconds}), **summary}
                write_results(run_dir, plan, metrics, None, None, summary)
            else:
                write_file(os.path.join(run_dir, "summary.json"), json.dumps(summary, indent=2).encode())
        except OSError:
            pass  # the error that stopped training is the one to report
        print(f"results: {run_dir}", flush=True)
    how = (
        f"; continue with --resume {run_dir}"
        if checkpointed and job.args.checkpoint
        else f"; the finished updates are in {run_dir}"
        if run_dir
        else ""
    )
    stopped = f"training stopped after {log.num_updates} of {config.num_updates} updates"
    print(f"{program_name()}: error: {stopped}: {why}{how}", file=sys.stderr)
    return 130 if interrupted else 1


if __name__ == "__main__":
    configure_xla()
    sys.exit(main())
