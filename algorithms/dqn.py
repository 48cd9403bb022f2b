"""DQN (replay buffer, target network, optional double DQN) for discrete-action gymnax environments, in one file.

    python algorithms/dqn.py                                  # CartPole-v1, 8 seeds
    python algorithms/dqn.py --env-name Acrobot-v1 --num-seeds 16 --lr 1e-3
    python algorithms/dqn.py --sweep lr=1e-4,3e-4,1e-3 --sweep gamma=0.95,0.99
    python algorithms/dqn.py --help                           # every option, its meaning and default

The whole run (epsilon-greedy acting, replay-buffer writes, gradient steps and target
updates at their env-step intervals) is one jitted function; seeds and sweep points are
vmapped into the same compiled program, each run with its own replay buffer:

    configure_xla()  # optional: the command line's XLA set-up, before JAX's first computation
    train = make_train(Config(env_name="CartPole-v1"))
    runner, metrics = jax.jit(jax.vmap(train))(jax.random.split(jax.random.PRNGKey(0), 8))

Each run writes config.json, summary.json, metrics.npz, params.msgpack and
learning_curve.png into a new directory under --runs-dir. Depends only on jax, flax,
optax, gymnax, chex, numpy and matplotlib; copy this file anywhere and it runs. Importing
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
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization
from jax.flatten_util import ravel_pytree

# gymnax is imported where an environment is made, not here: it computes with JAX when
# imported, which would start JAX's backend before the command line sets XLA's flags.

ALGORITHM = "dqn"


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------
def _option(default: Any, doc: str) -> Any:
    return dataclasses.field(default=default, metadata={"doc": doc})


@dataclasses.dataclass(frozen=True)
class Config:
    env_name: str = _option("CartPole-v1", "gymnax id, craftax/NAME or xminigrid/NAME (discrete actions; see below)")
    total_timesteps: int = _option(300_000, "environment steps per run (all envs together)")
    num_envs: int = _option(10, "parallel environments per run")
    num_steps: int = _option(100, "steps per environment in each update (one progress/metrics row)")
    buffer_size: int = _option(10_000, "replay buffer capacity in transitions per run (>= num_envs)")
    batch_size: int = _option(128, "transitions per gradient step, sampled uniformly from the buffer")
    learning_starts: int = _option(10_000, "env steps before the first gradient step")
    train_frequency: int = _option(10, "env steps (all envs together) per gradient step")
    target_update_frequency: int = _option(250, "env steps (all envs together) per target-network update")
    tau: float = _option(1.0, "target update rate: target <- tau * online + (1 - tau) * target (1 = copy)")
    double_dqn: bool = _option(True, "double DQN: the online network picks the next action, the target rates it")
    loss: str = _option("mse", "TD loss: huber (delta 1) or mse")
    lr: float = _option(2.5e-4, "Adam learning rate (start value when annealed)")
    anneal_lr: bool = _option(False, "decay the learning rate linearly to 0 over all gradient steps")
    gamma: float = _option(0.99, "discount factor")
    max_grad_norm: float = _option(1000.0, "global gradient-norm clip (10 slowed learning with the mse loss)")
    eps_start: float = _option(1.0, "epsilon-greedy exploration rate at the first step")
    eps_end: float = _option(0.01, "exploration rate once the linear decay is over")
    eps_fraction: float = _option(0.3, "fraction of training (total_timesteps) over which epsilon decays linearly")
    activation: str = _option("relu", "hidden activation: relu or tanh")
    hidden_size: int = _option(128, "units per hidden layer of the Q-network")
    num_layers: int = _option(2, "hidden layers of the Q-network")
    eval_episodes: int = _option(16, "greedy evaluation episodes per run after training")
    seed: int = _option(0, "base seed; run i uses jax.random.split(PRNGKey(seed), num_seeds)[i]")
    num_seeds: int = _option(8, "independent runs trained side by side (vmapped)")

    @property
    def steps_per_update(self) -> int:
        """Env steps of one update, all envs together (one progress and metrics row)."""
        return self.num_envs * self.num_steps

    @property
    def num_updates(self) -> int:
        return self.total_timesteps // self.steps_per_update


class HParams(NamedTuple):
    """Float hyperparameters that may differ between the runs of one compiled program (--sweep)."""

    lr: jax.Array
    gamma: jax.Array
    tau: jax.Array
    max_grad_norm: jax.Array
    eps_start: jax.Array
    eps_end: jax.Array
    eps_fraction: jax.Array


SWEEPABLE = HParams._fields
ACTIVATIONS = {"relu": nn.relu, "tanh": nn.tanh}
LOSSES = ("huber", "mse")


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
        "buffer_size",
        "batch_size",
        "train_frequency",
        "target_update_frequency",
        "hidden_size",
        "num_layers",
        "eval_episodes",
        "num_seeds",
    ):
        if getattr(config, name) <= 0:
            raise ConfigError(f"--{_flag(name)} must be a positive integer, got {getattr(config, name)}")
    if config.learning_starts < 0:
        raise ConfigError(f"--learning-starts must be >= 0, got {config.learning_starts}")
    validate_hparams({name: getattr(config, name) for name in SWEEPABLE})
    if config.activation not in ACTIVATIONS:
        raise ConfigError(f"--activation must be one of {', '.join(ACTIVATIONS)}, got {config.activation!r}")
    if config.loss not in LOSSES:
        raise ConfigError(f"--loss must be one of {', '.join(LOSSES)}, got {config.loss!r}")
    if config.buffer_size < config.num_envs:
        raise ConfigError(
            f"--buffer-size {config.buffer_size} must be at least num_envs = {config.num_envs} "
            "(every env step writes num_envs transitions at once)"
        )
    if config.total_timesteps < config.steps_per_update:
        raise ConfigError(
            f"--total-timesteps {config.total_timesteps} is less than one update "
            f"(num_envs * num_steps = {config.steps_per_update})"
        )
    make_env(config.env_name)  # unknown or continuous-action environments
    check_resources(config, config.num_seeds)
    for name in ("total_timesteps", "buffer_size", "learning_starts", "train_frequency", "target_update_frequency"):
        if getattr(config, name) >= 2**31:  # step counts and buffer slots are int32 inside the compiled program
            raise ConfigError(f"--{_flag(name)} must be below 2**31, got {getattr(config, name)}")


def validate_hparams(values: dict) -> None:
    """The checks of the sweepable fields, for the Config and for every sweep point."""
    for name, value in values.items():
        if not math.isfinite(value):
            raise ConfigError(f"--{_flag(name)} must be finite, got {value}")
    if values["lr"] <= 0:
        raise ConfigError(f"--lr must be positive, got {values['lr']}")
    if values["max_grad_norm"] <= 0:
        raise ConfigError(f"--max-grad-norm must be positive, got {values['max_grad_norm']}")
    if not 0 < values["tau"] <= 1:
        raise ConfigError(f"--tau must be in (0, 1], got {values['tau']}")
    for name in ("gamma", "eps_start", "eps_end", "eps_fraction"):
        if not 0 <= values[name] <= 1:
            raise ConfigError(f"--{_flag(name)} must be in [0, 1], got {values[name]}")


def _flag(name: str) -> str:
    return name.replace("_", "-")


def transition_bytes(obs_dim: int) -> int:
    """Bytes one stored transition takes: obs and final_obs (float32), action, reward, terminated."""
    return 2 * 4 * obs_dim + 4 + 4 + 1


def available_memory() -> tuple[int, str]:
    """Bytes the replay buffers may take, and where: the accelerator's free memory, else the host's."""
    device = jax.devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            return stats["bytes_limit"] - stats.get("bytes_in_use", 0), f"{device.platform} device"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "host"
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), "host"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.3g} {unit}"
        n /= 1000


def check_resources(config: Config, num_runs: int) -> None:
    """Refuse replay buffers that cannot fit, before anything is allocated or compiled."""
    env, env_params = make_env(config.env_name)
    per_transition = transition_bytes(int(np.prod(env.observation_space(env_params).shape)))
    needed = num_runs * config.buffer_size * per_transition
    available, where = available_memory()
    if needed > available:
        raise ConfigError(
            f"--buffer-size {config.buffer_size}: the replay buffers need {_bytes(needed)} ({num_runs} run(s) x "
            f"{config.buffer_size:,} transitions x {per_transition} B) but only {_bytes(available)} of {where} "
            "memory is available; use a smaller --buffer-size or fewer seeds / sweep points"
        )


# --------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------
def make_env(env_name: str):
    """gymnax.make, or a suite's env for SUITE/NAME (make_suite_env, in the harness), with errors a
    user can act on; only discrete action spaces."""
    import gymnax

    if "/" in env_name:
        env, env_params = make_suite_env(env_name, "discrete")
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
    if not isinstance(env.action_space(env_params), gymnax.environments.spaces.Discrete):
        raise ConfigError(
            f"--env-name {env_name} has a continuous (Box) action space; {ALGORITHM}.py needs a discrete one"
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
    """`num_envs` copies of a gymnax env, stepped together, observations as flat float32.

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
        self.num_actions = int(self.env.action_space(self.params).n)
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
class QNetwork(nn.Module):
    """MLP from a flat observation to one Q-value per action."""

    num_actions: int
    hidden_size: int
    num_layers: int
    activation: str

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        act = ACTIVATIONS[self.activation]
        for _ in range(self.num_layers):
            x = act(nn.Dense(self.hidden_size)(x))
        return nn.Dense(self.num_actions)(x)


class Networks(NamedTuple):
    q: nn.Module  # obs -> [num_actions] Q-values; its parameters are params["q"] (and the target's)


def make_networks(config: Config, num_actions: int) -> Networks:
    return Networks(
        q=QNetwork(
            num_actions, hidden_size=config.hidden_size, num_layers=config.num_layers, activation=config.activation
        )
    )


# --------------------------------------------------------------------------------------
# Replay buffer
# --------------------------------------------------------------------------------------
class Transition(NamedTuple):
    obs: jax.Array  # [..., obs_dim]
    action: jax.Array  # [...] int32
    reward: jax.Array  # [...] float32
    terminated: jax.Array  # [...] bool: a terminal state; a time-limit truncation is not one
    final_obs: jax.Array  # [..., obs_dim] the true next observation (before auto-reset)


class ReplayBuffer(NamedTuple):
    """A circular store of one run's transitions. Slots [0, size) are filled; `position` is
    where the next transition goes. Under vmap every seed has its own buffer."""

    data: Transition  # every field [capacity, ...]
    position: jax.Array  # int32
    size: jax.Array  # int32, at most capacity


def buffer_init(capacity: int, obs_dim: int) -> ReplayBuffer:
    data = Transition(
        obs=jnp.zeros((capacity, obs_dim), jnp.float32),
        action=jnp.zeros(capacity, jnp.int32),
        reward=jnp.zeros(capacity, jnp.float32),
        terminated=jnp.zeros(capacity, bool),
        final_obs=jnp.zeros((capacity, obs_dim), jnp.float32),
    )
    return ReplayBuffer(data=data, position=jnp.int32(0), size=jnp.int32(0))


def buffer_add(buffer: ReplayBuffer, batch: Transition) -> ReplayBuffer:
    """Writes a batch of n <= capacity transitions at `position`, wrapping around the end."""
    capacity, n = buffer.data.action.shape[0], batch.action.shape[0]
    slots = (buffer.position + jnp.arange(n, dtype=jnp.int32)) % capacity
    data = jax.tree.map(
        lambda store, x: store.at[slots].set(x.astype(store.dtype), unique_indices=True, mode="promise_in_bounds"),
        buffer.data,
        batch,
    )
    return ReplayBuffer(
        data=data, position=(buffer.position + n) % capacity, size=jnp.minimum(buffer.size + n, capacity)
    )


def buffer_sample(buffer: ReplayBuffer, bits: jax.Array) -> Transition:
    """A batch of len(bits) - 1 transitions from the filled slots, from uniform random uint32 `bits`.

    Every filled slot is equally likely to be in the batch (probability batch / size) and, once
    the buffer holds at least a batch, no slot is drawn twice: the filled range is cut into
    `batch` strata of nearly equal length, one slot is drawn from each, and the whole pattern
    is rotated by a uniform random offset (the last word of `bits`).
    """
    batch = bits.shape[0] - 1
    n = buffer.size
    j = jnp.arange(batch + 1, dtype=jnp.int32)
    bounds = j * (n // batch) + (j * (n % batch)) // batch  # floor(j * n / batch) without int32 overflow
    start, length = bounds[:-1], jnp.diff(bounds)
    offset = (bits[:-1] % jnp.maximum(length, 1).astype(jnp.uint32)).astype(jnp.int32)
    slot = start + offset  # in [0, n)
    shift = (bits[-1] % n.astype(jnp.uint32)).astype(jnp.int32)
    slot = jnp.where(slot >= n - shift, slot - (n - shift), slot + shift)  # (slot + shift) % n, no overflow
    return jax.tree.map(lambda store: store.at[slot].get(mode="promise_in_bounds"), buffer.data)


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------
class Runner(NamedTuple):
    """Everything one run carries from update to update."""

    params: Any  # {"q": online Q-network parameters}
    target_params: Any  # {"q": target network parameters}
    opt_state: Any  # Adam state over the flattened parameter vector
    buffer: ReplayBuffer
    env_state: Any
    obs: jax.Array
    episode_return: jax.Array  # [num_envs] return so far of each env's current episode
    episode_length: jax.Array  # [num_envs]
    rng: jax.Array
    hparams: HParams


class LossSums(NamedTuple):
    """Sums over the gradient steps of one update; divided by their count, the logged metrics."""

    loss: jax.Array
    q_mean: jax.Array
    grad_norm: jax.Array


class Learner(NamedTuple):
    """What gradient steps change, as flat parameter vectors (see make_train)."""

    params: jax.Array  # online Q-network
    target: jax.Array  # target network
    opt_state: Any
    sums: LossSums


class Acting(NamedTuple):
    """What an update carries from one vectorized env step to the next."""

    learner: Learner
    buffer: ReplayBuffer
    env_state: Any
    obs: jax.Array
    episode_return: jax.Array
    episode_length: jax.Array
    stats: EpisodeStats


def interval_crossings(before, steps: int, interval: int, learning_starts: int):
    """How many multiples of `interval` lie in (max(before, learning_starts), before + steps]:
    the gradient steps (or target updates) that a vectorized step from `before` to
    `before + steps` env steps owes. Summed over a run, that is exactly
    max(0, total // interval - learning_starts // interval), whatever num_envs is."""
    return jnp.maximum(0, (before + steps) // interval - jnp.maximum(before, learning_starts) // interval)


def total_gradient_steps(config: Config) -> int:
    trained = config.num_updates * config.steps_per_update
    return max(0, trained // config.train_frequency - config.learning_starts // config.train_frequency)


def polyak_update(online: jax.Array, target: jax.Array, tau: jax.Array, count: jax.Array) -> jax.Array:
    """`count` Polyak updates target <- tau * online + (1 - tau) * target in a row with the same
    online parameters, in closed form: online + (1 - tau)^count * (target - online). tau = 1 copies."""
    return online + (1.0 - tau) ** jnp.asarray(count, jnp.float32) * (target - online)


def epsilon(config: Config, hparams: HParams, env_steps: jax.Array) -> jax.Array:
    """Linear decay from eps_start to eps_end over eps_fraction of total_timesteps, then flat."""
    decay_steps = jnp.maximum(hparams.eps_fraction * config.total_timesteps, 1.0)
    progress = jnp.minimum(env_steps / decay_steps, 1.0)
    return hparams.eps_start + (hparams.eps_end - hparams.eps_start) * progress


def make_td_loss(config: Config, network: nn.Module) -> Callable:
    """Returns `td_loss(params, target_params, batch, gamma) -> (loss, aux)` for Q-network params.

    target = reward + gamma * (1 - terminated) * Q_target(final_obs, a'), where a' is the
    target network's own argmax, or the online network's (double DQN). `final_obs` is the
    true next observation, so a time-limit truncation bootstraps from the state it cut off;
    only `terminated` zeroes the bootstrap. aux holds the taken actions' Q-values and targets.
    """

    def td_loss(params, target_params, batch: Transition, gamma: jax.Array):
        next_q_target = network.apply(target_params, batch.final_obs)
        if config.double_dqn:
            next_action = jnp.argmax(network.apply(jax.lax.stop_gradient(params), batch.final_obs), -1)
        else:
            next_action = jnp.argmax(next_q_target, -1)
        next_q = jnp.take_along_axis(next_q_target, next_action[:, None], -1)[:, 0]
        chex.assert_equal_shape([batch.reward, batch.terminated, batch.action, next_q])
        target = jax.lax.stop_gradient(batch.reward + gamma * (1.0 - batch.terminated) * next_q)
        q = jnp.take_along_axis(network.apply(params, batch.obs), batch.action[:, None], -1)[:, 0]
        if config.loss == "huber":
            loss = optax.huber_loss(q, target, delta=1.0).mean()
        else:
            loss = jnp.square(q - target).mean()
        return loss, {"q": q, "target": target}

    return td_loss


def make_optimizer(config: Config, hparams: HParams):
    num_grad_steps = max(1, total_gradient_steps(config))
    if config.anneal_lr:
        lr = lambda count: hparams.lr * jnp.maximum(1.0 - count / num_grad_steps, 0.0)  # noqa: E731
    else:
        lr = hparams.lr
    return optax.chain(optax.clip_by_global_norm(hparams.max_grad_norm), optax.adam(learning_rate=lr))


def make_train(config: Config) -> Callable:
    """Returns `train(rng, hparams=None) -> (runner, metrics)` running the whole config.

    `metrics` maps names to arrays of shape [num_updates]. `train.init(rng, hparams)` and
    `train.run(runner, first_update, num_updates)` are the two halves of `train`, for
    callers (the command line) that run the updates in chunks to report progress.
    """
    validate(config)
    env = VecEnv(config.env_name, config.num_envs)
    network = make_networks(config, env.num_actions).q
    td_loss = make_td_loss(config, network)
    T, N, B = config.num_steps, config.num_envs, config.batch_size
    # The most gradient steps one vectorized step can owe (usually 0 or 1 are due).
    max_grad_steps = -(-N // config.train_frequency)

    def init_params(key: jax.Array):
        return {"q": network.init(key, jnp.zeros((1, env.obs_dim)))}

    # The optimizer sees one flat vector instead of a handful of small arrays: on CPU every
    # array is a separate kernel launch in Adam and in the gradient-norm clip.
    shapes = jax.eval_shape(init_params, jax.random.PRNGKey(0))
    _, unravel = ravel_pytree(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes))

    def loss_fn(flat_params, flat_target, batch: Transition, gamma):
        return td_loss(unravel(flat_params)["q"], unravel(flat_target)["q"], batch, gamma)

    def init(rng: jax.Array, hparams: HParams | None = None) -> Runner:
        hparams = hparams_from(config) if hparams is None else hparams
        rng, params_key, env_key = jax.random.split(rng, 3)
        params = init_params(params_key)
        obs, env_state = env.reset(env_key)
        opt_state = make_optimizer(config, hparams).init(ravel_pytree(params)[0])
        return Runner(
            params=params,
            target_params=params,
            opt_state=opt_state,
            buffer=buffer_init(config.buffer_size, env.obs_dim),
            env_state=env_state,
            obs=obs,
            episode_return=jnp.zeros(N),
            episode_length=jnp.zeros(N, jnp.int32),
            rng=rng,
            hparams=hparams,
        )

    def gradient_step(learner: Learner, buffer: ReplayBuffer, bits: jax.Array, hp: HParams) -> Learner:
        """One Adam step on a batch drawn from the buffer with the random `bits`."""
        batch = buffer_sample(buffer, bits)
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(learner.params, learner.target, batch, hp.gamma)
        updates, opt_state = make_optimizer(config, hp).update(grads, learner.opt_state)
        sums = LossSums(
            loss=learner.sums.loss + loss,
            q_mean=learner.sums.q_mean + aux["q"].mean(),
            grad_norm=learner.sums.grad_norm + jnp.linalg.norm(grads),
        )
        return Learner(params=learner.params + updates, target=learner.target, opt_state=opt_state, sums=sums)

    def learn(learner: Learner, buffer: ReplayBuffer, before: jax.Array, sample_bits: jax.Array, hp: HParams):
        """The gradient steps and target updates due in a vectorized step from `before` env steps:
        one per multiple of its interval that the env-step count crossed, so any num_envs keeps
        the schedule. Returns (learner, gradient steps taken, target updates made)."""
        num_grad = interval_crossings(before, N, config.train_frequency, config.learning_starts)
        if max_grad_steps == 1:
            learner = jax.lax.cond(
                num_grad > 0, lambda c: gradient_step(c, buffer, sample_bits[0], hp), lambda c: c, learner
            )
        else:
            learner = jax.lax.fori_loop(0, num_grad, lambda i, c: gradient_step(c, buffer, sample_bits[i], hp), learner)
        num_target = interval_crossings(before, N, config.target_update_frequency, config.learning_starts)
        target = jax.lax.cond(
            num_target > 0,
            lambda: polyak_update(learner.params, learner.target, hp.tau, num_target),
            lambda: learner.target,
        )
        return learner._replace(target=target), num_grad, num_target

    def update(runner: Runner, update_index: jax.Array):
        hp = runner.hparams

        def env_step(carry: Acting, inputs):
            t, explore, random_action, sample_bits, env_noise = inputs
            before = (update_index * T + t) * N  # env steps of this run before this vectorized step
            # Same for every seed and sweep point (not batched under vmap): the conds in learn stay conds.
            eps = epsilon(config, hp, before)
            q = network.apply(unravel(carry.learner.params)["q"], carry.obs)
            action = jnp.where(explore < eps, random_action, jnp.argmax(q, -1))
            step = env.step(env_noise, carry.env_state, action)
            buffer = buffer_add(
                carry.buffer,
                Transition(
                    obs=carry.obs,
                    action=action,
                    reward=step.reward,
                    terminated=step.terminated,
                    final_obs=step.final_obs,
                ),
            )
            done = step.terminated | step.truncated
            episode_return, episode_length = carry.episode_return + step.reward, carry.episode_length + 1
            learner, num_grad, num_target = learn(carry.learner, buffer, before, sample_bits, hp)
            return Acting(
                learner=learner,
                buffer=buffer,
                env_state=step.state,
                obs=step.obs,
                episode_return=jnp.where(done, 0.0, episode_return),
                episode_length=jnp.where(done, 0, episode_length),
                stats=carry.stats.add(done, episode_return, episode_length),
            ), (num_grad, num_target, eps)

        # All randomness of the update is drawn here in a few batched calls, not step by step.
        rng, explore_key, action_key, sample_key, env_key = jax.random.split(runner.rng, 5)
        inputs = (
            jnp.arange(T, dtype=jnp.int32),
            jax.random.uniform(explore_key, (T, N)),
            jax.random.randint(action_key, (T, N), 0, env.num_actions),
            jax.random.bits(sample_key, (T, max_grad_steps, B + 1), jnp.uint32),
            env.presample(env_key, T),
        )
        no_sums = LossSums(loss=jnp.float32(0), q_mean=jnp.float32(0), grad_norm=jnp.float32(0))
        learner = Learner(
            params=ravel_pytree(runner.params)[0],
            target=ravel_pytree(runner.target_params)[0],
            opt_state=runner.opt_state,
            sums=no_sums,
        )
        start = Acting(
            learner=learner,
            buffer=runner.buffer,
            env_state=runner.env_state,
            obs=runner.obs,
            episode_return=runner.episode_return,
            episode_length=runner.episode_length,
            stats=EpisodeStats.zero(),
        )
        acting, (num_grad, num_target, eps) = jax.lax.scan(env_step, start, inputs)
        learner = acting.learner

        grad_steps = num_grad.sum()
        # NaN when no gradient step was taken during this update: never a stale or zero-filled value.
        mean = lambda total: jnp.where(grad_steps > 0, total / jnp.maximum(grad_steps, 1), jnp.nan)
        metrics = {
            "env_steps": (update_index + 1) * T * N,
            **acting.stats.metrics(),
            "loss": mean(learner.sums.loss),
            "q_mean": mean(learner.sums.q_mean),
            "grad_norm": mean(learner.sums.grad_norm),
            "epsilon": eps[-1],
            "gradient_steps": grad_steps,
            "target_updates": num_target.sum(),
            "finite": (jnp.isfinite(jnp.stack(learner.sums)).all() & jnp.isfinite(learner.params).all()),
        }
        runner = Runner(
            params=unravel(learner.params),
            target_params=unravel(learner.target),
            opt_state=learner.opt_state,
            buffer=acting.buffer,
            env_state=acting.env_state,
            obs=acting.obs,
            episode_return=acting.episode_return,
            episode_length=acting.episode_length,
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
    """What params.msgpack holds and `make_evaluate` takes: the online Q-network's parameters."""
    return runner.params


class GreedyPolicy(NamedTuple):
    """How a trained run acts in evaluation: `init(num_envs)` gives the policy's own carry (none here),
    `act(params, carry, obs, start) -> (carry, action)` the greedy action, where `params` is what
    `saved_params` gives and `start` marks observations that begin an episode."""

    init: Callable
    act: Callable


def make_greedy_policy(config: Config, env: VecEnv) -> GreedyPolicy:
    """The action of the highest Q-value of the online network."""
    networks = make_networks(config, env.num_actions)

    def act(params, carry, obs: jax.Array, start: jax.Array):
        return carry, jnp.argmax(networks.q.apply(params["q"], obs), -1)

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
