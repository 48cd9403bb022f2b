"""QR-DQN (quantile regression DQN, Dabney et al. 2018) for discrete-action gymnax environments, in one file.

    python qr_dqn.py --env-name Acrobot-v1 --num-seeds 16 --lr 1e-3     # --help: every option

The Q-network gives each action `num_quantiles` quantiles of its return distribution, at the
midpoints tau_i = (2i + 1) / (2N); it learns them by quantile Huber regression towards the target
network's quantiles after the next action, and acts on their mean (replay buffer, target network,
optional double DQN as in dqn.py).
The whole run (epsilon-greedy acting, replay-buffer writes, gradient steps and target updates at
their env-step intervals) is one jitted function, and seeds (and sweep points: the float
hyperparameters in HParams) are vmapped into one program, each run with its own replay buffer:

    train = make_train(Config(env_name="CartPole-v1"))
    runner, metrics = jax.jit(jax.vmap(train))(jax.random.split(jax.random.PRNGKey(0), 8))

Depends only on jax, flax, optax, chex, gymnax and numpy: copy it anywhere and it runs. Importing
it defines things and does nothing else.
"""

import argparse
import dataclasses
import json
import os
import pathlib
import pkgutil
import sys
import tempfile
import time
from collections.abc import Callable
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

HARNESS_PROTOCOL = 1  # the run harness's interface this file follows (algorithms/onefile_harness/protocol.py)
ACTIONS = "discrete"  # the action spaces this algorithm takes


# --------------------------------------------------------------------------------------
# Config helpers (the same in every algorithm file: tests/test_files.py)
# --------------------------------------------------------------------------------------
def option(default: Any, doc: str) -> Any:
    """A Config field with its one line of documentation, which is also its command-line help."""
    return dataclasses.field(default=default, metadata={"doc": doc})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class ConfigError(ValueError):
    """A config value that cannot work, naming the option and what is allowed; raised before anything compiles."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def require_positive(config, names: tuple) -> None:
    for name in names:
        require(getattr(config, name) > 0, f"{flag(name)} must be a positive integer, got {getattr(config, name)}")


def hparams_from(config) -> "HParams":
    """The Config's own values of the sweepable fields, as a run reads them."""
    return HParams(**{name: jnp.float32(getattr(config, name)) for name in HParams._fields})


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Config:
    env_name: str = option("CartPole-v1", "a gymnax environment with discrete actions (gymnax.registered_envs)")
    total_timesteps: int = option(300_000, "environment steps per run (all envs together)")
    num_envs: int = option(10, "parallel environments per run")
    num_steps: int = option(100, "steps per environment in each update (one progress/metrics row)")
    buffer_size: int = option(10_000, "replay buffer capacity in transitions per run (>= num_envs)")
    batch_size: int = option(128, "transitions per gradient step, sampled uniformly from the buffer")
    learning_starts: int = option(10_000, "env steps before the first gradient step")
    train_frequency: int = option(10, "env steps (all envs together) per gradient step")
    target_update_frequency: int = option(250, "env steps (all envs together) per target-network update")
    tau: float = option(1.0, "target update rate: target <- tau * online + (1 - tau) * target (1 = copy)")
    double_dqn: bool = option(True, "double DQN: the online network picks the next action, the target rates it")
    num_quantiles: int = option(25, "quantiles per action (the loss weighs N^2 pairs; SB3's 50 learned CartPole later)")
    kappa: float = option(100.0, "Huber threshold of the quantile loss (1, the paper's, diverged on CartPole)")
    lr: float = option(2.5e-4, "Adam learning rate (start value when annealed)")
    anneal_lr: bool = option(False, "decay the learning rate linearly to 0 over all gradient steps")
    gamma: float = option(0.99, "discount factor")
    max_grad_norm: float = option(1000.0, "global gradient-norm clip")
    eps_start: float = option(1.0, "epsilon-greedy exploration rate at the first step")
    eps_end: float = option(0.01, "exploration rate once the linear decay is over")
    eps_fraction: float = option(0.3, "fraction of training (total_timesteps) over which epsilon decays linearly")
    activation: str = option("relu", "hidden activation: relu or tanh")
    hidden_size: int = option(128, "units per hidden layer of the Q-network")
    num_layers: int = option(2, "hidden layers of the Q-network")
    eval_episodes: int = option(16, "greedy evaluation episodes per run after training")
    seed: int = option(0, "base seed; run i uses jax.random.split(PRNGKey(seed), num_seeds)[i]")
    num_seeds: int = option(8, "independent runs trained side by side (vmapped)")

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
    kappa: jax.Array


ACTIVATIONS = {"relu": nn.relu, "tanh": nn.tanh}


def validate(config: Config) -> None:
    """Refuses a config that cannot run, naming the option and what is allowed."""
    sizes = ("total_timesteps", "num_envs", "num_steps", "buffer_size", "batch_size")
    intervals = ("train_frequency", "target_update_frequency")
    require_positive(config, (*sizes, *intervals, "hidden_size", "num_layers", "eval_episodes", "num_seeds"))
    require(config.learning_starts >= 0, f"--learning-starts must be >= 0, got {config.learning_starts}")
    validate_hparams({name: getattr(config, name) for name in HParams._fields})
    for name, allowed in (("activation", ACTIVATIONS),):
        value = getattr(config, name)
        require(value in allowed, f"{flag(name)} must be one of {', '.join(allowed)}, got {value!r}")
    require(config.num_quantiles >= 1, f"--num-quantiles must be at least 1, got {config.num_quantiles}")
    require(
        config.buffer_size >= config.num_envs,
        f"--buffer-size {config.buffer_size} must be at least num_envs = {config.num_envs} "
        "(every env step writes num_envs transitions at once)",
    )
    per_update = config.steps_per_update
    require(
        per_update <= config.total_timesteps < 2**31,
        f"--total-timesteps must be in [{per_update}, 2**31) (one update of num_envs * num_steps, and int32 step "
        f"counts), got {config.total_timesteps}",
    )
    for name in ("buffer_size", "learning_starts", *intervals):  # int32 inside the compiled program too
        value = getattr(config, name)
        require(value < 2**31, f"{flag(name)} must be below 2**31, got {value}")


def validate_hparams(values: dict) -> None:
    """The checks of the sweepable fields, for the Config and for every sweep point."""
    for name, value in values.items():
        require(np.isfinite(value), f"{flag(name)} must be finite, got {value}")
    for name in ("lr", "max_grad_norm"):
        require(values[name] > 0, f"{flag(name)} must be positive, got {values[name]}")
    require(0 < values["tau"] <= 1, f"--tau must be in (0, 1], got {values['tau']}")
    require(values["kappa"] > 0, f"--kappa must be positive, got {values['kappa']}")
    for name in ("gamma", "eps_start", "eps_end", "eps_fraction"):
        require(0 <= values[name] <= 1, f"{flag(name)} must be in [0, 1], got {values[name]}")


# --------------------------------------------------------------------------------------
# Environment loop (the same in every algorithm file: tests/test_files.py)
# --------------------------------------------------------------------------------------
def make_env(env_name: str):
    """gymnax.make, with errors a user can act on; only the ACTIONS this file's algorithm takes."""
    import gymnax

    if env_name not in gymnax.registered_envs:
        raise ConfigError(
            f"--env-name {env_name!r} is not registered with gymnax; choose one of {', '.join(gymnax.registered_envs)}"
            " (or register one with gymnax.register; the repository's run harness adds brax/, craftax/ and xminigrid/)"
        )
    try:
        env, env_params = gymnax.make(env_name)
    except Exception as error:  # e.g. MNISTBandit downloads its data set
        raise ConfigError(f"--env-name {env_name}: gymnax could not create it ({error})") from None
    kind = "discrete" if isinstance(env.action_space(env_params), gymnax.environments.spaces.Discrete) else "continuous"
    require(kind == ACTIONS, f"--env-name {env_name} has {kind} actions; {os.path.basename(__file__)} takes {ACTIONS}")
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
    reset_obs: Any  # [num_envs or num_resets, ...] fresh episodes' first observations (None: no resets)
    reset_state: Any
    new: jax.Array  # bool: the fresh episodes were drawn for this step, not repeated from an earlier one


class Reserved(NamedTuple):
    """The state of envs that hold a fresh episode in reserve (those whose reset costs more than a step)."""

    env: Any  # [num_envs] the envs' states
    obs: jax.Array  # [num_envs, obs_dim] each env's reserve: the first observation it starts next
    state: Any  # [num_envs] and its env state
    redrawn: jax.Array  # reserves redrawn so far; the next redraw replaces reserve redrawn % num_envs


class VecEnv:
    """`num_envs` copies of a gymnax env, stepped together; observations and continuous actions flat float32.

    gymnax's stock `Environment.step` draws a reset state at every step, and on CPU each random draw
    inside a loop is a small loop of its own: for envs that use it, `presample` draws the keys and
    reset states of a whole rollout in one batched call and `step` auto-resets from them. Envs that
    override `step` (DeepSea) are stepped through it. An env whose reset costs more than a step may
    declare `envs_per_reset`: then each env holds a fresh episode in reserve, starts it when its
    episode ends, and one reserve per `envs_per_reset` env steps is redrawn in turn; envs that finish
    together still start distinct episodes.
    """

    def __init__(self, env_name: str, num_envs: int):
        from gymnax.environments.environment import Environment

        self.env, self.params = make_env(env_name)
        self.num_envs, self.max_episode_steps = num_envs, int(self.params.max_steps_in_episode)
        self.obs_shape = tuple(self.env.observation_space(self.params).shape)
        self.obs_dim = int(np.prod(self.obs_shape))
        space = self.env.action_space(self.params)
        self.num_actions = int(getattr(space, "n", 0))  # discrete actions: how many
        self.action_shape, self.action_dim = tuple(space.shape), int(np.prod(space.shape))  # continuous actions
        self.action_low, self.action_high = (  # their bounds, flat [action_dim] float32
            np.broadcast_to(np.asarray(getattr(space, bound, 0), np.float32), space.shape).reshape(-1)
            for bound in ("low", "high")
        )
        self.stock_step = type(self.env).step is Environment.step
        envs_per_reset = getattr(self.env, "envs_per_reset", 1)
        self.num_resets = -(-num_envs // envs_per_reset)  # fresh episodes drawn every `reset_every` steps
        self.reset_every = max(1, envs_per_reset // num_envs)
        self.reserve = self.stock_step and self.num_resets < num_envs

    def _flat(self, obs: jax.Array) -> jax.Array:
        batch_shape = obs.shape[: obs.ndim - len(self.obs_shape)]
        return obs.reshape(*batch_shape, self.obs_dim).astype(jnp.float32)

    def reset(self, key: jax.Array):
        keys = jax.random.split(key, (2 if self.reserve else 1) * self.num_envs)
        obs, state = jax.vmap(self.env.reset, in_axes=(0, None))(keys, self.params)
        if not self.reserve:
            return self._flat(obs), state
        now, ahead = (
            jax.tree.map(lambda x: x[half], (self._flat(obs), state))
            for half in (slice(None, self.num_envs), slice(self.num_envs, None))
        )
        return now[0], Reserved(env=now[1], obs=ahead[0], state=ahead[1], redrawn=jnp.int32(0))

    def presample(self, key: jax.Array, num_steps: int, resets: bool = True) -> StepNoise:
        """The randomness of `num_steps` steps; without `resets`, episodes that end are not restarted
        (evaluation scores each env's first episode only: no fresh episode need be drawn)."""
        step_keys, reset_keys = jax.random.split(key, (2, num_steps, self.num_envs))
        new = jnp.arange(num_steps) % self.reset_every == 0
        if not (self.stock_step and resets):
            return StepNoise(key=step_keys, reset_obs=None, reset_state=None, new=new)
        reset_env = jax.vmap(jax.vmap(self.env.reset_env, in_axes=(0, None)), in_axes=(0, None))
        reset_obs, reset_state = reset_env(reset_keys[:: self.reset_every, : self.num_resets], self.params)
        fresh = (self._flat(reset_obs), reset_state)
        if self.reset_every > 1:  # step t sees the episodes drawn at step t - t % reset_every
            fresh = jax.tree.map(lambda x: jnp.repeat(x, self.reset_every, axis=0)[:num_steps], fresh)
        return StepNoise(key=step_keys, reset_obs=fresh[0], reset_state=fresh[1], new=new)

    def step(self, noise: StepNoise, state: Any, action: jax.Array) -> EnvStep:
        action = action.reshape(self.num_envs, *self.action_shape)
        if not self.stock_step:
            obs, state, reward, terminated, truncated, info = jax.vmap(self.env.step, in_axes=(0, 0, 0, None))(
                noise.key, state, action, self.params
            )
            final_obs = self._flat(info["final_observation"])
            return EnvStep(self._flat(obs), state, reward.astype(jnp.float32), terminated, truncated, final_obs)
        obs, stepped, reward, terminated, _ = jax.vmap(self.env.step_env, in_axes=(0, 0, 0, None))(
            noise.key, state.env if self.reserve else state, action, self.params
        )
        truncated = jax.vmap(self.env.is_truncated, in_axes=(0, None))(stepped, self.params)
        done = terminated | truncated
        final_obs = self._flat(obs)
        fresh = (noise.reset_obs, noise.reset_state)
        if noise.reset_state is None:  # presample(resets=False): an ended episode stays where it ended
            fresh = (final_obs, stepped)
        elif self.reserve:  # each env starts its reserve; this step's fresh episodes replace the next ones
            fresh, slots = (state.obs, state.state), (state.redrawn + jnp.arange(self.num_resets)) % self.num_envs
            redraw = lambda old, new: old.at[slots].set(jnp.where(noise.new, new, old[slots]))  # noqa: E731
            redrawn = jax.tree.map(redraw, (state.obs, state.state), (noise.reset_obs, noise.reset_state))
            state = Reserved(None, *redrawn, redrawn=state.redrawn + noise.new * self.num_resets)
        select = jax.vmap(lambda d, reset, stepped: jax.tree.map(lambda r, s: jax.lax.select(d, r, s), reset, stepped))
        next_state = select(done, fresh[1], stepped)
        return EnvStep(
            obs=select(done, fresh[0], final_obs),
            state=state._replace(env=next_state) if self.reserve else next_state,
            reward=reward.astype(jnp.float32),
            terminated=terminated,
            truncated=truncated,
            final_obs=final_obs,
        )


class Episodes(NamedTuple):
    """Every env's current episode, as training carries it from step to step, and totals over the
    episodes that ended since `counting()` (at an update's start): their means are the logged metrics."""

    env_state: Any
    obs: jax.Array  # [num_envs, obs_dim]
    episode_return: jax.Array  # [num_envs] return so far
    episode_length: jax.Array  # [num_envs] steps so far
    finished: jax.Array  # int32: episodes that ended since counting began
    return_sum: jax.Array  # float32: their returns, summed
    length_sum: jax.Array  # int32: their lengths, summed

    @classmethod
    def start(cls, obs: jax.Array, env_state: Any) -> "Episodes":
        zeros = jnp.zeros(obs.shape[0], jnp.int32)
        return cls(env_state, obs, zeros.astype(jnp.float32), zeros, jnp.int32(0), jnp.float32(0), jnp.int32(0))

    def counting(self) -> "Episodes":
        return self._replace(finished=jnp.int32(0), return_sum=jnp.float32(0), length_sum=jnp.int32(0))

    def after(self, step: EnvStep) -> "Episodes":
        """The episodes after `step`: those that ended are counted and begin anew."""
        done = step.terminated | step.truncated
        episode_return, episode_length = self.episode_return + step.reward, self.episode_length + 1
        return Episodes(
            env_state=step.state,
            obs=step.obs,
            episode_return=jnp.where(done, 0.0, episode_return),
            episode_length=jnp.where(done, 0, episode_length),
            finished=self.finished + done.sum(),
            return_sum=self.return_sum + jnp.where(done, episode_return, 0.0).sum(),
            length_sum=self.length_sum + jnp.where(done, episode_length, 0).sum(),
        )

    def metrics(self) -> dict:
        """Mean return and length of the episodes counted: NaN when none ended."""
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
    """MLP from a flat observation to each action's return quantiles, [num_actions, num_quantiles]."""

    num_actions: int
    num_quantiles: int
    hidden_size: int
    num_layers: int
    activation: str

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        act = ACTIVATIONS[self.activation]
        for _ in range(self.num_layers):
            x = act(nn.Dense(self.hidden_size)(x))
        quantiles = nn.Dense(self.num_actions * self.num_quantiles)(x)
        return quantiles.reshape(*x.shape[:-1], self.num_actions, self.num_quantiles)


class Networks(NamedTuple):
    q: nn.Module  # obs -> [num_actions, num_quantiles] quantiles; its parameters are params["q"] (and the target's)


def make_networks(config: Config, num_actions: int) -> Networks:
    return Networks(
        q=QNetwork(
            num_actions,
            config.num_quantiles,
            hidden_size=config.hidden_size,
            num_layers=config.num_layers,
            activation=config.activation,
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
    episodes: Episodes
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


class StepInputs(NamedTuple):
    """What one vectorized env step consumes, drawn ahead for a whole update ([num_steps, ...] each)."""

    t: jax.Array  # the step's index within the update
    explore: jax.Array  # [num_envs] uniform in [0, 1): below epsilon, the env acts at random
    random_action: jax.Array  # [num_envs] the random action it then takes
    sample_bits: jax.Array  # [max gradient steps per env step, batch + 1] uint32 (buffer_sample)
    env_noise: StepNoise


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


def quantile_midpoints(num_quantiles: int) -> jax.Array:
    """tau_i = (2i + 1) / (2N), i = 0 .. N-1: the quantile levels the network's outputs estimate."""
    return (2 * jnp.arange(num_quantiles, dtype=jnp.float32) + 1) / (2 * num_quantiles)


@jax.custom_vjp
def quantile_huber_loss(quantiles: jax.Array, targets: jax.Array, kappa: jax.Array) -> jax.Array:
    """Quantile Huber loss of estimates `quantiles` [B, N] at the midpoints tau_i against sampled
    `targets` [B, N']: with u = targets[b, j] - quantiles[b, i],

        loss = mean_b sum_i mean_j |tau_i - 1{u < 0}| * huber_kappa(u) / kappa,

    huber_kappa(u) = u^2 / 2 for |u| <= kappa, else kappa * (|u| - kappa / 2). Its gradient is
    written out (`_quantile_huber_grads`): autodiff keeps several [B, N, N'] arrays and is ~10x
    slower on CPU. kappa gets no gradient (a hyperparameter)."""
    return _quantile_huber_parts(quantiles, targets, kappa)[0]


def _quantile_huber_parts(quantiles: jax.Array, targets: jax.Array, kappa: jax.Array):
    """The loss, and what its gradient needs: |tau_i - 1{u < 0}| * clip(u, -kappa, kappa) [B, N, N'] and the scale."""
    tau = quantile_midpoints(quantiles.shape[-1])[:, None]
    u = targets[:, None, :] - quantiles[:, :, None]  # [B, i, j]
    weight = jnp.where(u < 0, 1.0 - tau, tau)
    clipped = jnp.clip(u, -kappa, kappa)  # huber_kappa(u) = clipped * (u - clipped / 2)
    scale = 1.0 / (kappa * targets.shape[0] * targets.shape[1])
    return (weight * clipped * (u - 0.5 * clipped)).sum() * scale, (weight * clipped, scale)


def _quantile_huber_grads(residuals, g):
    """d huber_kappa(u) / du = clip(u, -kappa, kappa), and du/d quantile = -1, du/d target = 1."""
    quantiles, targets, kappa = residuals
    weighted, scale = _quantile_huber_parts(quantiles, targets, kappa)[1]
    return -g * scale * weighted.sum(-1), g * scale * weighted.sum(-2), jnp.zeros_like(kappa)


quantile_huber_loss.defvjp(lambda q, t, kappa: (quantile_huber_loss(q, t, kappa), (q, t, kappa)), _quantile_huber_grads)


def make_td_loss(config: Config, network: nn.Module) -> Callable:
    """Returns `td_loss(params, target_params, batch, gamma, kappa) -> (loss, aux)` for Q-network params.

    target quantiles = reward + gamma * (1 - terminated) * theta_target(final_obs, a'), where a'
    has the highest mean quantile by the target network, or by the online one (double DQN).
    `final_obs` is the true next observation, so a time-limit truncation bootstraps from the
    state it cut off; only `terminated` zeroes the bootstrap. The loss is `quantile_huber_loss`
    of the taken action's quantiles. aux holds the taken actions' Q-values (mean quantiles) and
    the target quantiles.
    """

    def td_loss(params, target_params, batch: Transition, gamma: jax.Array, kappa: jax.Array):
        next_quantiles_target = network.apply(target_params, batch.final_obs)
        if config.double_dqn:
            chooser = network.apply(jax.lax.stop_gradient(params), batch.final_obs)
        else:
            chooser = next_quantiles_target
        next_action = jnp.argmax(chooser.mean(-1), -1)
        next_quantiles = jnp.take_along_axis(next_quantiles_target, next_action[:, None, None], -2)[:, 0]
        chex.assert_equal_shape([batch.reward, batch.terminated, batch.action, next_action])
        target = batch.reward[:, None] + gamma * (1.0 - batch.terminated[:, None]) * next_quantiles
        target = jax.lax.stop_gradient(target)
        quantiles = jnp.take_along_axis(network.apply(params, batch.obs), batch.action[:, None, None], -2)[:, 0]
        chex.assert_shape([target, quantiles], (batch.action.shape[0], config.num_quantiles))
        loss = quantile_huber_loss(quantiles, target, kappa)
        return loss, {"q": quantiles.mean(-1), "target": target}

    return td_loss


def make_optimizer(config: Config, hparams: HParams):
    num_grad_steps = max(1, total_gradient_steps(config))
    if config.anneal_lr:
        lr = lambda count: hparams.lr * jnp.maximum(1.0 - count / num_grad_steps, 0.0)  # noqa: E731
    else:
        lr = hparams.lr
    return optax.chain(optax.clip_by_global_norm(hparams.max_grad_norm), optax.adam(learning_rate=lr))


def update_metrics(learner: Learner, episodes: Episodes, num_grad, num_target, eps) -> dict:
    """An update's metrics from its sums and its steps' [num_steps] counts and epsilons: NaN where
    no gradient step was taken, never a stale or zero-filled value."""
    grad_steps = num_grad.sum()
    mean = lambda total: jnp.where(grad_steps > 0, total / jnp.maximum(grad_steps, 1), jnp.nan)  # noqa: E731
    return {
        **episodes.metrics(),
        "loss": mean(learner.sums.loss),
        "q_mean": mean(learner.sums.q_mean),
        "grad_norm": mean(learner.sums.grad_norm),
        "epsilon": eps[-1],
        "gradient_steps": grad_steps,
        "target_updates": num_target.sum(),
        "finite": jnp.isfinite(jnp.stack(learner.sums)).all() & jnp.isfinite(learner.params).all(),
    }


def make_train(config: Config) -> Callable:
    """Returns `train(rng, hparams=None) -> (runner, metrics)` running the whole config, where
    `metrics` maps names to arrays of shape [num_updates]: `train.init(rng, hparams)`, then
    `train.update(runner, update_index)` num_updates times in a `lax.scan`."""
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

    def loss_fn(flat_params, flat_target, batch: Transition, gamma, kappa):
        return td_loss(unravel(flat_params)["q"], unravel(flat_target)["q"], batch, gamma, kappa)

    def init(rng: jax.Array, hparams: HParams | None = None) -> Runner:
        hparams = hparams_from(config) if hparams is None else hparams
        rng, params_key, env_key = jax.random.split(rng, 3)
        params = init_params(params_key)
        episodes = Episodes.start(*env.reset(env_key))
        return Runner(
            params=params,
            target_params=params,
            opt_state=make_optimizer(config, hparams).init(ravel_pytree(params)[0]),
            buffer=buffer_init(config.buffer_size, env.obs_dim),
            episodes=episodes,
            rng=rng,
            hparams=hparams,
        )

    def gradient_step(learner: Learner, buffer: ReplayBuffer, bits: jax.Array, hp: HParams) -> Learner:
        """One Adam step on a batch drawn from the buffer with the random `bits`."""
        batch = buffer_sample(buffer, bits)
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            learner.params, learner.target, batch, hp.gamma, hp.kappa
        )
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

    def env_step(carry: tuple, inputs: StepInputs, update_index: jax.Array, hp: HParams):
        """One vectorized epsilon-greedy env step, its transitions written to the buffer, then the
        gradient steps and target updates due; `carry` is (learner, buffer, episodes)."""
        learner, buffer, episodes = carry
        before = (update_index * T + inputs.t) * N  # env steps of this run before this vectorized step
        # Same for every seed and sweep point (not batched under vmap): the conds in learn stay conds.
        eps = epsilon(config, hp, before)
        q = network.apply(unravel(learner.params)["q"], episodes.obs).mean(-1)
        action = jnp.where(inputs.explore < eps, inputs.random_action, jnp.argmax(q, -1))
        step = env.step(inputs.env_noise, episodes.env_state, action)
        transitions = Transition(
            obs=episodes.obs, action=action, reward=step.reward, terminated=step.terminated, final_obs=step.final_obs
        )
        buffer = buffer_add(buffer, transitions)
        learner, num_grad, num_target = learn(learner, buffer, before, inputs.sample_bits, hp)
        return (learner, buffer, episodes.after(step)), (num_grad, num_target, eps)

    def draw_inputs(keys) -> StepInputs:
        """All randomness of an update, drawn in a few batched calls rather than step by step."""
        explore_key, action_key, sample_key, env_key = keys
        return StepInputs(
            t=jnp.arange(T, dtype=jnp.int32),
            explore=jax.random.uniform(explore_key, (T, N)),
            random_action=jax.random.randint(action_key, (T, N), 0, env.num_actions),
            sample_bits=jax.random.bits(sample_key, (T, max_grad_steps, B + 1), jnp.uint32),
            env_noise=env.presample(env_key, T),
        )

    def update(runner: Runner, update_index: jax.Array):
        hp = runner.hparams
        rng, *keys = jax.random.split(runner.rng, 5)
        zero = jnp.float32(0)
        learner = Learner(
            params=ravel_pytree(runner.params)[0],
            target=ravel_pytree(runner.target_params)[0],
            opt_state=runner.opt_state,
            sums=LossSums(loss=zero, q_mean=zero, grad_norm=zero),
        )
        step = lambda carry, inputs: env_step(carry, inputs, update_index, hp)  # noqa: E731
        start = (learner, runner.buffer, runner.episodes.counting())
        (learner, buffer, episodes), (num_grad, num_target, eps) = jax.lax.scan(step, start, draw_inputs(keys))
        metrics = {
            "env_steps": (update_index + 1) * T * N,
            **update_metrics(learner, episodes, num_grad, num_target, eps),
        }
        runner = Runner(
            params=unravel(learner.params),
            target_params=unravel(learner.target),
            opt_state=learner.opt_state,
            buffer=buffer,
            episodes=episodes,
            rng=rng,
            hparams=hp,
        )
        return runner, metrics

    def train(rng: jax.Array, hparams: HParams | None = None):
        return jax.lax.scan(update, init(rng, hparams), jnp.arange(config.num_updates, dtype=jnp.int32))

    train.init, train.update = init, update
    return train


# --------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------
def saved_params(runner: Runner) -> dict:
    """What params.msgpack holds and `make_evaluate` takes: the online Q-network's parameters."""
    return runner.params


def make_greedy_policy(config: Config, env: VecEnv) -> "GreedyPolicy":
    """The action of the highest Q-value (mean quantile) of the online network."""
    networks = make_networks(config, env.num_actions)

    def act(params, carry, obs: jax.Array, start: jax.Array):
        return carry, jnp.argmax(networks.q.apply(params["q"], obs).mean(-1), -1)

    return GreedyPolicy(init=lambda num_envs: (), act=act)


# --------------------------------------------------------------------------------------
# Greedy evaluation (the same in every algorithm file: tests/test_files.py)
# --------------------------------------------------------------------------------------
class GreedyPolicy(NamedTuple):
    init: Callable  # init(num_envs) -> the policy's own carry (e.g. a recurrent state)
    act: Callable  # act(params, carry, obs, start) -> (carry, action); start: obs begins an episode


class Evaluating(NamedTuple):
    """What the evaluation loop carries from one env step to the next."""

    env_state: Any
    obs: jax.Array
    policy: Any  # the greedy policy's own carry
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

    def env_step(params, carry: Evaluating) -> Evaluating:
        rng, key = jax.random.split(carry.rng)
        noise = jax.tree.map(lambda x: x[0], env.presample(key, 1, resets=False))
        start = jnp.full(env.num_envs, carry.t == 0)  # an env that ended is no longer scored: no restart
        policy_carry, action = policy.act(params, carry.policy, carry.obs, start)
        step = env.step(noise, carry.env_state, action)
        return Evaluating(
            env_state=step.state,
            obs=step.obs,
            policy=policy_carry,
            total=carry.total + jnp.where(carry.alive, step.reward, 0.0),
            alive=carry.alive & ~(step.terminated | step.truncated),
            rng=rng,
            t=carry.t + 1,
        )

    def evaluate(params, rng: jax.Array) -> jax.Array:
        reset_key, rng = jax.random.split(rng)
        obs, env_state = env.reset(reset_key)
        carry, alive, total = policy.init(env.num_envs), jnp.ones(env.num_envs, bool), jnp.zeros(env.num_envs)
        first = Evaluating(env_state=env_state, obs=obs, policy=carry, total=total, alive=alive, rng=rng, t=0)
        running = lambda carry: carry.alive.any() & (carry.t < env.max_episode_steps)  # noqa: E731
        return jax.lax.while_loop(running, lambda carry: env_step(params, carry), first).total.mean()

    return evaluate


# --------------------------------------------------------------------------------------
# Command line (the same in every algorithm file: tests/test_files.py). In the repository,
# `python algorithms/<name>.py` hands over to the run harness beside it (algorithms/onefile_harness:
# sweeps, devices, progress, checkpoints, tracking, suites); a copy of this file alone runs `main`.
# --------------------------------------------------------------------------------------
def configure_xla() -> None:
    """Sets XLA's flags for this file alone, before JAX's first computation (importing gymnax is
    one); a flag already in XLA_FLAGS is left as it is. XLA's concurrency-optimised CPU scheduler
    is turned off: it has deadlocked vmapped training (jaxlib 0.10). On a CPU-only install, backend
    optimisation level 1 compiles faster and trains as fast (the run harness sets both too)."""
    flags = {"xla_cpu_enable_concurrency_optimized_scheduler": "false"}
    accelerators = ("jax_cuda", "jax_rocm", "libtpu")
    if os.environ.get("JAX_PLATFORMS", "").lower() == "cpu" or not any(
        module.name.startswith(accelerators) for module in pkgutil.iter_modules()
    ):
        flags["xla_backend_optimization_level"] = "1"
    for name, value in flags.items():
        if name not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{name}={value}".strip()


def main(argv: list[str] | None = None) -> int:
    """This file alone: every Config field a flag, all seeds trained in one jitted call, the greedy
    policies evaluated, and config.json, metrics.npz, params.msgpack and summary.json written as the
    run harness writes them. Exits 2 on bad input (nothing written), 3 when NaN or inf appeared."""
    name = os.path.basename(__file__)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False, exit_on_error=False)
    for field in dataclasses.fields(Config):
        kind = {"action": argparse.BooleanOptionalAction} if field.type is bool else {"type": field.type}
        parser.add_argument(flag(field.name), default=field.default, help=field.metadata["doc"], **kind)
    parser.add_argument("--runs-dir", default="runs", help="results go to a new directory under this one")
    try:
        args, unknown = parser.parse_known_args(argv)
        harness = "(the others, such as --sweep, --resume and --track, need the run harness beside it)"
        require(
            not unknown, f"{' '.join(unknown)}: not an option of {name} alone, whose options --help lists {harness}"
        )
        config = Config(**{field.name: getattr(args, field.name) for field in dataclasses.fields(Config)})
        train, evaluate = make_train(config), make_evaluate(config)
        os.makedirs(args.runs_dir, exist_ok=True)
        prefix = f"{name[:-3]}-{config.env_name.replace('/', '-')}-{time.strftime('%Y%m%d-%H%M%S')}-"
        run_dir = pathlib.Path(tempfile.mkdtemp(prefix=prefix, dir=args.runs_dir))
    except (argparse.ArgumentError, ConfigError, OSError) as error:
        print(f"{name}: error: {error}", file=sys.stderr)
        return 2
    print(f"{name} alone (no run harness beside it): {config.num_seeds} seeds on {config.env_name}", flush=True)
    (run_dir / "config.json").write_text(json.dumps({**dataclasses.asdict(config), "sweep": {}}, indent=2))
    start = time.perf_counter()
    runner, metrics = jax.jit(jax.vmap(train))(jax.random.split(jax.random.PRNGKey(config.seed), config.num_seeds))
    metrics, seconds = jax.device_get(metrics), time.perf_counter() - start  # compilation included
    eval_keys = jax.random.split(jax.random.PRNGKey(config.seed + 1), config.num_seeds)
    eval_return = jax.jit(jax.vmap(evaluate))(saved_params(runner), eval_keys)
    point = lambda tree: jax.tree.map(lambda x: np.asarray(x)[None], tree)  # noqa: E731  (one sweep point)
    wall = seconds * np.arange(1, config.num_updates + 1) / config.num_updates
    np.savez_compressed(run_dir / "metrics.npz", **point(metrics), eval_return=point(eval_return), wall_seconds=wall)
    (run_dir / "params.msgpack").write_bytes(serialization.to_bytes(point(saved_params(runner))))
    return summarise(run_dir, config, metrics, eval_return, seconds)


def summarise(run_dir: pathlib.Path, config: Config, metrics: dict, eval_return, seconds: float) -> int:
    """summary.json and the results on stdout; returns the exit status."""
    last = -(-config.num_updates // 20)  # a run's final return: its episodes ending in the last 5% of updates
    returns, counts = metrics["episode_return"][:, -last:], metrics["episodes_finished"][:, -last:]
    with np.errstate(invalid="ignore", divide="ignore"):  # NaN: no episode ended in that window
        final = np.where(counts > 0, returns * counts, 0.0).sum(-1) / counts.sum(-1)
    summary = {
        "algorithm": os.path.basename(__file__)[:-3],
        "env_name": config.env_name,
        "num_seeds": config.num_seeds,
        "trained_timesteps": config.num_updates * config.steps_per_update,
        "final_return_per_seed": [float(x) if np.isfinite(x) else None for x in final],
        "eval_return_mean": float(np.mean(eval_return)),
        "train_seconds": seconds,
    }
    bad = np.argwhere(~metrics["finite"].T)  # [update, seed] where NaN or inf appeared, earliest first
    if len(bad):
        summary["nonfinite"] = {"first_update": int(bad[0, 0]) + 1, "seed_index": int(bad[0, 1])}
        print(f"error: NaN or inf first appeared at update {bad[0, 0] + 1}, seed index {bad[0, 1]}", file=sys.stderr)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"final return per seed {np.round(final, 1).tolist()}, greedy eval {summary['eval_return_mean']:.1f}")
    print(f"results: {run_dir}", flush=True)
    return 3 if len(bad) else 0


if __name__ == "__main__":
    if os.path.isdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "onefile_harness")):
        from onefile_harness import command_line  # the repository's run harness, beside this file

        sys.exit(command_line(sys.modules[__name__]))
    configure_xla()
    sys.exit(main())
