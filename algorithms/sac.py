"""SAC (twin critics, tanh-squashed Gaussian, learned temperature) for continuous-action gymnax envs, in one file.

    python sac.py --env-name MountainCarContinuous-v0 --total-timesteps 50000   # --help: every option
    python sac.py --alpha 0.1                                                   # a fixed temperature

The whole run (acting, replay-buffer writes, gradient steps and Polyak target updates at their
env-step intervals) is one jitted function, and seeds (and sweep points: the float hyperparameters
in HParams) are vmapped into one program, each run with its own replay buffer:

    train = make_train(Config(env_name="Pendulum-v1"))
    runner, metrics = jax.jit(jax.vmap(train))(jax.random.split(jax.random.PRNGKey(0), 8))

The policy samples u ~ N(mean, std) and acts a = centre + half_range * tanh(u); its log-probability
is the density of the executed action, computed from u itself (a saturated tanh is never inverted)
with distrax's Tanh and ScalarAffine bijectors (no slower than by hand: benchmarks/README.md). The
temperature alpha is learned so that the policy's entropy tracks -action_dim * target_entropy_scale,
unless --alpha fixes it. The replay buffer stores actions in [-1, 1] (before the rescale), which is
what the critics see; greedy evaluation acts with the squashed mean.

Depends only on jax, flax, optax, chex, distrax, gymnax and numpy: copy it anywhere and it runs.
Importing it defines things and does nothing else.
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

HARNESS_PROTOCOL = 1  # the run harness's interface this file follows (algorithms/onefile_harness/protocol.py)
ACTIONS = "continuous"  # the action spaces this algorithm takes (bounded: the policy squashes into them)


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
# Defaults tuned on Pendulum-v1 for 8 seeds on a 2-core CPU (benchmarks/README.md). An update (20
# envs x 200 steps) is one whole episode of every env, so the final return (the last 5% of updates)
# averages 20 episodes of start states that vary a lot. One gradient step per 2 env steps, batches
# of 128 and 64-unit layers learn Pendulum well before 20k steps, at a fraction of the CPU time.
@dataclasses.dataclass(frozen=True)
class Config:
    env_name: str = option("Pendulum-v1", "a gymnax env with bounded continuous actions (gymnax.registered_envs)")
    total_timesteps: int = option(20_000, "environment steps per run (all envs together)")
    num_envs: int = option(20, "parallel environments per run")
    num_steps: int = option(200, "steps per environment in each update (one progress/metrics row)")
    buffer_size: int = option(100_000, "replay buffer capacity in transitions per run (>= num_envs)")
    batch_size: int = option(128, "transitions per gradient step, sampled uniformly from the buffer")
    learning_starts: int = option(1_000, "env steps of uniformly random actions before the first gradient step")
    train_frequency: int = option(2, "env steps (all envs together) per round of gradient steps")
    gradient_steps: int = option(1, "gradient steps per round (update-to-data ratio = this / train_frequency)")
    lr: float = option(1e-3, "Adam learning rate of actor, critics and temperature")
    gamma: float = option(0.99, "discount factor")
    tau: float = option(0.01, "target critics <- tau * critics + (1 - tau) * target critics, every gradient step")
    alpha: float = option(0.0, "entropy temperature: a value > 0 fixes it; 0 learns it against the target entropy")
    target_entropy_scale: float = option(1.0, "learned temperature: target entropy = -action_dim * this")
    num_critics: int = option(2, "Q-networks; targets and the actor use their minimum (2 = twin critics)")
    log_std_min: float = option(-5.0, "lower bound of the policy's log std (tanh-rescaled, not clipped)")
    log_std_max: float = option(2.0, "upper bound of the policy's log std")
    activation: str = option("relu", "hidden activation: relu, tanh or swish")
    hidden_size: int = option(64, "units per hidden layer (actor and critics alike)")
    num_layers: int = option(2, "hidden layers of the actor and of each critic")
    eval_episodes: int = option(100, "greedy evaluation episodes per run after training (start states vary)")
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
    alpha: jax.Array
    target_entropy_scale: jax.Array


ACTIVATIONS = {"relu": nn.relu, "tanh": nn.tanh, "swish": nn.swish}


def validate(config: Config) -> None:
    """Refuses a config that cannot run, naming the option and what is allowed."""
    integers = ("total_timesteps", "num_envs", "num_steps", "buffer_size", "batch_size", "train_frequency")
    networks = ("num_critics", "hidden_size", "num_layers")
    require_positive(config, (*integers, "gradient_steps", *networks, "eval_episodes", "num_seeds"))
    require(config.learning_starts >= 0, f"--learning-starts must be >= 0, got {config.learning_starts}")
    validate_hparams({name: getattr(config, name) for name in HParams._fields})
    for name in ("log_std_min", "log_std_max"):
        require(np.isfinite(getattr(config, name)), f"{flag(name)} must be finite, got {getattr(config, name)}")
    require(
        config.log_std_min < config.log_std_max,
        f"--log-std-min {config.log_std_min} must be below --log-std-max {config.log_std_max}",
    )
    require(
        config.activation in ACTIVATIONS,
        f"--activation must be one of {', '.join(ACTIVATIONS)}, got {config.activation!r}",
    )
    require(
        config.buffer_size >= config.num_envs,
        f"--buffer-size {config.buffer_size} must be at least num_envs = {config.num_envs} "
        "(every env step writes num_envs transitions at once)",
    )
    require(
        config.total_timesteps >= config.steps_per_update,
        f"--total-timesteps {config.total_timesteps} is less than one update "
        f"(num_envs * num_steps = {config.steps_per_update})",
    )
    for name in ("total_timesteps", "buffer_size", "learning_starts", "train_frequency"):
        # Step counts and buffer slots are int32 inside the compiled program.
        require(getattr(config, name) < 2**31, f"{flag(name)} must be below 2**31, got {getattr(config, name)}")


def validate_hparams(values: dict) -> None:
    """The checks of the sweepable fields, for the Config and for every sweep point."""
    for name, value in values.items():
        require(np.isfinite(value), f"{flag(name)} must be finite, got {value}")
    require(values["lr"] > 0, f"--lr must be positive, got {values['lr']}")
    require(0 <= values["gamma"] <= 1, f"--gamma must be in [0, 1], got {values['gamma']}")
    require(0 < values["tau"] <= 1, f"--tau must be in (0, 1], got {values['tau']}")
    require(values["alpha"] >= 0, f"--alpha must be >= 0 (0 learns the temperature), got {values['alpha']}")


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
class SquashedGaussianActor(nn.Module):
    """obs -> (mean, log std) of the Gaussian whose tanh, rescaled to the bounds, is the action.

    The log std is a tanh rescaled into [log_std_min, log_std_max], not a clip (rejax issue #4): a
    clipped head has no gradient past its bound and can stay stuck there, while the tanh keeps one
    everywhere and still caps exp(log std), all the bound is for (the first, noisy updates must not
    make the std degenerate or infinite). As in CleanRL and Yarats et al.; Stable-Baselines3 clips.
    """

    action_dim: int
    log_std_min: float
    log_std_max: float
    hidden_size: int
    num_layers: int
    activation: str

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        act = ACTIVATIONS[self.activation]
        for _ in range(self.num_layers):
            x = act(nn.Dense(self.hidden_size)(x))
        mean, raw_log_std = jnp.split(nn.Dense(2 * self.action_dim)(x), 2, axis=-1)
        log_std = self.log_std_min + 0.5 * (self.log_std_max - self.log_std_min) * (jnp.tanh(raw_log_std) + 1)
        return mean, log_std


class Critic(nn.Module):
    """(obs, action in [-1, 1]) -> Q-value."""

    hidden_size: int
    num_layers: int
    activation: str

    @nn.compact
    def __call__(self, obs: jax.Array, action: jax.Array) -> jax.Array:
        act = ACTIVATIONS[self.activation]
        x = jnp.concatenate([obs, action], axis=-1)
        for _ in range(self.num_layers):
            x = act(nn.Dense(self.hidden_size)(x))
        return nn.Dense(1)(x)[..., 0]


class Networks(NamedTuple):
    actor: nn.Module  # obs -> (mean, log std); its parameters are params["actor"]
    critic: nn.Module  # one Q-network; params["critic"] stacks num_critics of them on a leading axis


def make_networks(config: Config, action_dim: int) -> Networks:
    shape = dict(hidden_size=config.hidden_size, num_layers=config.num_layers, activation=config.activation)
    return Networks(
        actor=SquashedGaussianActor(action_dim, config.log_std_min, config.log_std_max, **shape),
        critic=Critic(**shape),
    )


def critic_values(critic: nn.Module, params, obs: jax.Array, action: jax.Array) -> jax.Array:
    """Every critic's Q(obs, action): [num_critics, batch]. The critics are one network vmapped
    over their stacked parameters, so all of them run as one batched matmul per layer."""
    return jax.vmap(critic.apply, in_axes=(0, None, None))(params, obs, action)


class ActionScale(NamedTuple):
    """The affine map from the tanh's range [-1, 1] onto the env's action bounds."""

    centre: jax.Array  # [action_dim]
    half_range: jax.Array  # [action_dim]

    def __call__(self, squashed: jax.Array) -> jax.Array:
        return self.centre + self.half_range * squashed


def action_scale(env: VecEnv) -> ActionScale:
    low, high = jnp.asarray(env.action_low), jnp.asarray(env.action_high)
    return ActionScale(centre=(high + low) / 2, half_range=(high - low) / 2)


def squashed_sample(mean: jax.Array, log_std: jax.Array, noise: jax.Array, scale: ActionScale):
    """A reparameterised sample of the policy, N(mean, std) pushed through tanh and the rescale onto
    the bounds, from standard normal `noise` [..., action_dim]: (the action in [-1, 1] before the
    rescale, the log-density of the executed action summed over actions).

    The log-density is taken at the pre-tanh sample u, log p(a) = log N(u) - log |da/du| (distrax's
    Tanh computes the log-det from u stably): inverting the tanh of an action that rounded to +-1
    would give an infinite u. The noise is drawn ahead for a whole update (StepInputs), not by
    distrax's sample_and_log_prob(seed=...) inside the loop of gradient steps.
    """
    chex.assert_equal_shape([mean, log_std, noise])
    bijector = distrax.Chain([distrax.ScalarAffine(shift=scale.centre, scale=scale.half_range), distrax.Tanh()])
    u = mean + jnp.exp(log_std) * noise
    _, log_det = bijector.forward_and_log_det(u)
    log_prob = distrax.Normal(mean, jnp.exp(log_std)).log_prob(u) - log_det
    return jnp.tanh(u), log_prob.sum(-1)


# --------------------------------------------------------------------------------------
# Replay buffer
# --------------------------------------------------------------------------------------
class Transition(NamedTuple):
    obs: jax.Array  # [..., obs_dim]
    action: jax.Array  # [..., action_dim] in [-1, 1]: the action before the rescale to the env's bounds
    reward: jax.Array  # [...] float32
    terminated: jax.Array  # [...] bool: a terminal state; a time-limit truncation is not one
    final_obs: jax.Array  # [..., obs_dim] the true next observation (before auto-reset)


class ReplayBuffer(NamedTuple):
    """A circular store of one run's transitions. Slots [0, size) are filled; `position` is
    where the next transition goes. Under vmap every seed has its own buffer."""

    data: Transition  # every field [capacity, ...]
    position: jax.Array  # int32
    size: jax.Array  # int32, at most capacity


def buffer_init(capacity: int, obs_dim: int, action_dim: int) -> ReplayBuffer:
    data = Transition(
        obs=jnp.zeros((capacity, obs_dim), jnp.float32),
        action=jnp.zeros((capacity, action_dim), jnp.float32),
        reward=jnp.zeros(capacity, jnp.float32),
        terminated=jnp.zeros(capacity, bool),
        final_obs=jnp.zeros((capacity, obs_dim), jnp.float32),
    )
    return ReplayBuffer(data=data, position=jnp.int32(0), size=jnp.int32(0))


def buffer_add(buffer: ReplayBuffer, batch: Transition) -> ReplayBuffer:
    """Writes a batch of n <= capacity transitions at `position`, wrapping around the end."""
    capacity, n = buffer.data.reward.shape[0], batch.reward.shape[0]
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

    params: Any  # {"actor", "critic" (num_critics stacked), "log_alpha"}
    target_params: Any  # {"critic"}: the target critics
    opt_state: Any  # Adam state over the flattened parameter vector
    buffer: ReplayBuffer
    episodes: Episodes
    rng: jax.Array
    hparams: HParams


class LossSums(NamedTuple):
    """Sums over the gradient steps of one update; divided by their count, the logged metrics."""

    loss: jax.Array  # the critics' TD loss
    actor_loss: jax.Array
    q_mean: jax.Array
    entropy: jax.Array  # -log-density of the actor's sampled actions, averaged over the batch
    grad_norm: jax.Array


class Learner(NamedTuple):
    """What gradient steps change, as flat parameter vectors (see make_train)."""

    params: jax.Array  # actor, critics and log alpha
    target: jax.Array  # target critics
    opt_state: Any
    sums: LossSums


class GradientNoise(NamedTuple):
    """The randomness of one gradient step, drawn ahead for a whole update."""

    bits: jax.Array  # [batch + 1] uint32: which transitions the batch holds (buffer_sample)
    next_action: jax.Array  # [batch, action_dim] standard normal: the target's next actions
    action: jax.Array  # [batch, action_dim] standard normal: the actions the actor's loss rates


class StepInputs(NamedTuple):
    """What one vectorized env step consumes, drawn ahead for a whole update ([num_steps, ...] each)."""

    t: jax.Array  # the step's index within the update
    random_action: jax.Array  # [num_envs, action_dim] uniform in [-1, 1]: actions before learning_starts
    action_noise: jax.Array  # [num_envs, action_dim] standard normal: the policy's exploration
    gradient_noise: GradientNoise  # [max gradient steps per env step, ...]
    env_noise: StepNoise


def interval_crossings(before, steps: int, interval: int, learning_starts: int):
    """How many multiples of `interval` lie in (max(before, learning_starts), before + steps]: the
    training rounds that a vectorized step from `before` to `before + steps` env steps owes. Summed
    over a run, exactly max(0, total // interval - learning_starts // interval), whatever num_envs is."""
    return jnp.maximum(0, (before + steps) // interval - jnp.maximum(before, learning_starts) // interval)


def total_gradient_steps(config: Config) -> int:
    trained = config.num_updates * config.steps_per_update
    rounds = max(0, trained // config.train_frequency - config.learning_starts // config.train_frequency)
    return rounds * config.gradient_steps


def polyak_update(online: jax.Array, target: jax.Array, tau: jax.Array, count: jax.Array) -> jax.Array:
    """`count` Polyak updates target <- tau * online + (1 - tau) * target in a row with the same
    online parameters, in closed form: online + (1 - tau)^count * (target - online). tau = 1 copies."""
    return online + (1.0 - tau) ** jnp.asarray(count, jnp.float32) * (target - online)


def temperature(log_alpha: jax.Array, hparams: HParams) -> jax.Array:
    """alpha: the fixed --alpha where it is > 0, else the learned exp(log_alpha)."""
    return jnp.where(hparams.alpha > 0, hparams.alpha, jnp.exp(log_alpha))


def soft_td_target(reward, terminated, next_q, next_log_prob, alpha, gamma):
    """y = r + gamma * (1 - terminated) * (min over critics of Q_target(s', a') - alpha * log pi(a'|s')),
    a' ~ pi(s'). s' is the true next observation, so a time-limit truncation bootstraps from
    the state it cut off; only `terminated` zeroes the bootstrap. next_q: [num_critics, batch]."""
    chex.assert_equal_shape([reward, terminated, next_q[0], next_log_prob])
    soft_value = next_q.min(0) - alpha * next_log_prob
    return reward + gamma * (1.0 - terminated) * soft_value


def temperature_loss(log_alpha: jax.Array, log_prob: jax.Array, target_entropy: jax.Array) -> jax.Array:
    """-log_alpha * (log pi + target entropy), averaged: its gradient in log_alpha is
    (entropy estimate - target entropy), so descent raises alpha while the entropy is below the
    target and lowers it above; zero gradient where they are equal."""
    return -(log_alpha * jax.lax.stop_gradient(log_prob + target_entropy)).mean()


def make_sac_loss(config: Config, networks: Networks, scale: ActionScale) -> Callable:
    """Returns `sac_loss(params, target_critic, batch, noise, hparams) -> (loss, aux)`: the sum of
    three losses with disjoint gradients, so one backward pass (and one Adam over their flat vector)
    trains all three: the critics' 0.5 * sum over critics of the MSE to the soft TD target; the
    actor's alpha * log pi(a|s) - min over critics of Q(s, a), a ~ pi(s) reparameterised, critics
    held fixed; and temperature_loss, zero (no gradient) when --alpha fixes alpha."""
    action_dim = scale.centre.shape[0]

    def sac_loss(params, target_critic, batch: Transition, noise: GradientNoise, hp: HParams):
        alpha = jax.lax.stop_gradient(temperature(params["log_alpha"], hp))
        next_action, next_log_prob = jax.lax.stop_gradient(
            squashed_sample(*networks.actor.apply(params["actor"], batch.final_obs), noise.next_action, scale)
        )
        next_q = critic_values(networks.critic, target_critic, batch.final_obs, next_action)
        target = jax.lax.stop_gradient(
            soft_td_target(batch.reward, batch.terminated, next_q, next_log_prob, alpha, hp.gamma)
        )
        q = critic_values(networks.critic, params["critic"], batch.obs, batch.action)
        critic_loss = 0.5 * jnp.square(q - target).mean(-1).sum()

        action, log_prob = squashed_sample(*networks.actor.apply(params["actor"], batch.obs), noise.action, scale)
        q_policy = critic_values(networks.critic, jax.lax.stop_gradient(params["critic"]), batch.obs, action)
        actor_loss = (alpha * log_prob - q_policy.min(0)).mean()

        target_entropy = -action_dim * hp.target_entropy_scale
        alpha_loss = jnp.where(hp.alpha > 0, 0.0, temperature_loss(params["log_alpha"], log_prob, target_entropy))
        aux = dict(critic_loss=critic_loss, actor_loss=actor_loss, q=q, target=target, entropy=-log_prob.mean())
        return critic_loss + actor_loss + alpha_loss, aux

    return sac_loss


def make_optimizer(hparams: HParams):
    return optax.adam(learning_rate=hparams.lr)


def update_metrics(learner: Learner, episodes: Episodes, grad_steps: jax.Array) -> dict:
    """An update's metrics from its sums: NaN where no gradient step was taken, never a stale value."""
    mean = lambda total: jnp.where(grad_steps > 0, total / jnp.maximum(grad_steps, 1), jnp.nan)  # noqa: E731
    return {
        **episodes.metrics(),
        **{name: mean(total) for name, total in learner.sums._asdict().items()},
        "gradient_steps": grad_steps,
        "finite": jnp.isfinite(jnp.stack(learner.sums)).all() & jnp.isfinite(learner.params).all(),
    }


def make_train(config: Config) -> Callable:
    """Returns `train(rng, hparams=None) -> (runner, metrics)` running the whole config, where
    `metrics` maps names to arrays of shape [num_updates]: `train.init(rng, hparams)`, then
    `train.update(runner, update_index)` num_updates times in a `lax.scan`."""
    validate(config)
    env = VecEnv(config.env_name, config.num_envs)
    low, high = env.action_low, env.action_high  # the tanh-squashed policy needs finite bounds
    require(np.isfinite([low, high]).all(), f"--env-name {config.env_name} has unbounded actions ({low} to {high})")
    networks = make_networks(config, env.action_dim)
    scale = action_scale(env)
    sac_loss = make_sac_loss(config, networks, scale)
    T, N, B, A = config.num_steps, config.num_envs, config.batch_size, env.action_dim
    # The most gradient steps one vectorized step can owe (rounds due times steps per round).
    max_grad_steps = -(-N // config.train_frequency) * config.gradient_steps

    def init_params(key: jax.Array):
        actor_key, critic_key = jax.random.split(key)
        obs, action = jnp.zeros((1, env.obs_dim)), jnp.zeros((1, A))
        critic_keys = jax.random.split(critic_key, config.num_critics)
        return {
            "actor": networks.actor.init(actor_key, obs),
            "critic": jax.vmap(networks.critic.init, in_axes=(0, None, None))(critic_keys, obs, action),
            "log_alpha": jnp.zeros(()),  # alpha starts at 1
        }

    # The optimizer sees one flat vector instead of a dozen small arrays: on CPU every array is a
    # separate kernel launch in Adam. ravel_pytree orders dict keys, so the critics are one
    # contiguous slice of it, which the target critics (a flat vector of their own) follow.
    shapes = jax.eval_shape(init_params, jax.random.PRNGKey(0))
    zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    _, unravel = ravel_pytree(zeros)
    _, unravel_critic = ravel_pytree(zeros["critic"])
    critic_mask = np.asarray(ravel_pytree({**zeros, "critic": jax.tree.map(np.ones_like, zeros["critic"])})[0])
    critics = slice(int(np.argmax(critic_mask)), int(np.argmax(critic_mask)) + int(critic_mask.sum()))
    assert critic_mask[critics].all()

    def loss_fn(flat_params, flat_target, batch: Transition, noise: GradientNoise, hp: HParams):
        return sac_loss(unravel(flat_params), unravel_critic(flat_target), batch, noise, hp)

    def init(rng: jax.Array, hparams: HParams | None = None) -> Runner:
        hparams = hparams_from(config) if hparams is None else hparams
        rng, params_key, env_key = jax.random.split(rng, 3)
        params = init_params(params_key)
        return Runner(
            params=params,
            target_params={"critic": params["critic"]},
            opt_state=make_optimizer(hparams).init(ravel_pytree(params)[0]),
            buffer=buffer_init(config.buffer_size, env.obs_dim, A),
            episodes=Episodes.start(*env.reset(env_key)),
            rng=rng,
            hparams=hparams,
        )

    def gradient_step(learner: Learner, buffer: ReplayBuffer, noise: GradientNoise, hp: HParams) -> Learner:
        """One Adam step of actor, critics and temperature on a batch from the buffer, then one
        Polyak step of the target critics."""
        batch = buffer_sample(buffer, noise.bits)
        (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(learner.params, learner.target, batch, noise, hp)
        updates, opt_state = make_optimizer(hp).update(grads, learner.opt_state)
        params = learner.params + updates
        sums = LossSums(
            loss=learner.sums.loss + aux["critic_loss"],
            actor_loss=learner.sums.actor_loss + aux["actor_loss"],
            q_mean=learner.sums.q_mean + aux["q"].mean(),
            entropy=learner.sums.entropy + aux["entropy"],
            grad_norm=learner.sums.grad_norm + jnp.linalg.norm(grads),
        )
        target = polyak_update(params[critics], learner.target, hp.tau, 1)
        return Learner(params=params, target=target, opt_state=opt_state, sums=sums)

    def learn(learner: Learner, buffer: ReplayBuffer, before: jax.Array, noise: GradientNoise, hp: HParams):
        """The gradient steps due in a vectorized step from `before` env steps: `gradient_steps` per
        multiple of train_frequency that the env-step count crossed, so any num_envs keeps the
        schedule. Returns (learner, gradient steps taken)."""
        num_grad = interval_crossings(before, N, config.train_frequency, config.learning_starts)
        num_grad = num_grad * config.gradient_steps
        step = lambda i, c: gradient_step(c, buffer, jax.tree.map(lambda x: x[i], noise), hp)  # noqa: E731
        if max_grad_steps == 1:
            learner = jax.lax.cond(num_grad > 0, lambda c: step(0, c), lambda c: c, learner)
        else:
            learner = jax.lax.fori_loop(0, num_grad, step, learner)
        return learner, num_grad

    def act(flat_params: jax.Array, obs: jax.Array, noise: jax.Array) -> jax.Array:
        """The policy's sampled actions in [-1, 1] (no log-density: acting does not need it)."""
        mean, log_std = networks.actor.apply(unravel(flat_params)["actor"], obs)
        return jnp.tanh(mean + jnp.exp(log_std) * noise)

    def draw_inputs(key: jax.Array) -> StepInputs:
        """All randomness of an update, in a few batched calls instead of step by step."""
        random_key, action_key, bits_key, next_key, policy_key, env_key = key
        G = max_grad_steps
        return StepInputs(
            t=jnp.arange(T, dtype=jnp.int32),
            random_action=jax.random.uniform(random_key, (T, N, A), minval=-1.0, maxval=1.0),
            action_noise=jax.random.normal(action_key, (T, N, A)),
            gradient_noise=GradientNoise(
                bits=jax.random.bits(bits_key, (T, G, B + 1), jnp.uint32),
                next_action=jax.random.normal(next_key, (T, G, B, A)),
                action=jax.random.normal(policy_key, (T, G, B, A)),
            ),
            env_noise=env.presample(env_key, T),
        )

    def env_step(hp: HParams, update_index: jax.Array, carry, inputs: StepInputs):
        """One vectorized env step: act, store the transitions, take the gradient steps now due."""
        learner, buffer, episodes = carry
        before = (update_index * T + inputs.t) * N  # env steps of this run before this vectorized step
        # Env n's transition is env step before + n + 1 of the run: uniformly random actions
        # until learning_starts, then the policy's.
        warmup = before + jnp.arange(N) < config.learning_starts
        policy_action = act(learner.params, episodes.obs, inputs.action_noise)
        action = jnp.where(warmup[:, None], inputs.random_action, policy_action)
        step = env.step(inputs.env_noise, episodes.env_state, scale(action))
        transition = Transition(
            obs=episodes.obs,
            action=action,
            reward=step.reward,
            terminated=step.terminated,
            final_obs=step.final_obs,
        )
        buffer = buffer_add(buffer, transition)
        learner, num_grad = learn(learner, buffer, before, inputs.gradient_noise, hp)
        return (learner, buffer, episodes.after(step)), num_grad

    def update(runner: Runner, update_index: jax.Array):
        hp = runner.hparams
        rng, *keys = jax.random.split(runner.rng, 7)
        zero = jnp.float32(0)
        learner = Learner(
            params=ravel_pytree(runner.params)[0],
            target=ravel_pytree(runner.target_params["critic"])[0],
            opt_state=runner.opt_state,
            sums=LossSums(loss=zero, actor_loss=zero, q_mean=zero, entropy=zero, grad_norm=zero),
        )
        start = (learner, runner.buffer, runner.episodes.counting())
        step = lambda carry, inputs: env_step(hp, update_index, carry, inputs)  # noqa: E731
        (learner, buffer, episodes), num_grad = jax.lax.scan(step, start, draw_inputs(keys))
        params = unravel(learner.params)

        metrics = {
            "env_steps": (update_index + 1) * T * N,
            **update_metrics(learner, episodes, num_grad.sum()),
            "alpha": temperature(params["log_alpha"], hp),  # at the end of the update
        }
        runner = Runner(
            params=params,
            target_params={"critic": unravel_critic(learner.target)},
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
    """What params.msgpack holds and `make_evaluate` takes: actor, critics and log alpha."""
    return runner.params


def make_greedy_policy(config: Config, env: VecEnv) -> "GreedyPolicy":
    """The squashed mean: centre + half_range * tanh(mean), no sampling."""
    networks = make_networks(config, env.action_dim)
    scale = action_scale(env)

    def act(params, carry, obs: jax.Array, start: jax.Array):
        mean, _ = networks.actor.apply(params["actor"], obs)
        return carry, scale(jnp.tanh(mean))

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
