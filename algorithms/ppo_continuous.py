"""PPO (clipped surrogate, GAE, Gaussian policy) for continuous-action gymnax environments, in one file.

    python ppo_continuous.py --env-name MountainCarContinuous-v0 --num-seeds 16     # --help: every option

The whole run (rollout, GAE, epochs of shuffled minibatch updates) is one jitted function, and
seeds (and sweep points: the float hyperparameters in HParams) are vmapped into one program:

    train = make_train(Config(env_name="Pendulum-v1"))
    runner, metrics = jax.jit(jax.vmap(train))(jax.random.split(jax.random.PRNGKey(0), 8))

The policy is a diagonal Gaussian (an MLP gives the mean, a learned state-independent vector the
log std); its samples are clipped to the action bounds (or squashed into them with tanh, --squash).
Observations are normalised by running per-feature statistics and rewards scaled by a running std
of the discounted return (both on by default); params.msgpack saves those statistics with the
networks.

Depends only on jax, flax, optax, distrax, chex, gymnax and numpy: copy it anywhere and it runs.
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
ACTIONS = "continuous"  # the action spaces this algorithm takes


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
# Defaults tuned on Pendulum-v1: rollouts of one whole 200-step episode per env learned faster
# and more evenly across seeds than ppo.py's 32-step rollouts (benchmarks/README.md).
@dataclasses.dataclass(frozen=True)
class Config:
    env_name: str = option("Pendulum-v1", "a gymnax environment with continuous actions (gymnax.registered_envs)")
    total_timesteps: int = option(160_000, "environment steps per run (all envs together)")
    num_envs: int = option(8, "parallel environments per run")
    num_steps: int = option(200, "steps per environment in each rollout")
    update_epochs: int = option(4, "passes over each rollout batch")
    num_minibatches: int = option(8, "minibatches per epoch; must divide num_envs * num_steps")
    lr: float = option(2.5e-3, "Adam learning rate (start value when annealed)")
    anneal_lr: bool = option(True, "decay the learning rate linearly to 0 over all gradient steps")
    gamma: float = option(0.97, "discount factor")
    gae_lambda: float = option(0.95, "GAE lambda (bias/variance trade-off of advantages)")
    clip_eps: float = option(0.2, "PPO ratio clip range; also clips the value update")
    objective: str = option("ppo", "policy objective: ppo (clipped surrogate) or dpo (Discovered Policy Optimisation)")
    dpo_alpha: float = option(2.0, "DPO's drift threshold where the advantage is >= 0 (objective dpo)")
    dpo_beta: float = option(0.6, "DPO's drift threshold where the advantage is < 0 (objective dpo)")
    ent_coef: float = option(0.01, "entropy bonus coefficient")
    vf_coef: float = option(0.5, "value loss coefficient")
    max_grad_norm: float = option(0.5, "global gradient-norm clip")
    activation: str = option("tanh", "hidden activation: tanh or relu")
    hidden_size: int = option(64, "units per hidden layer (actor and critic alike)")
    num_layers: int = option(2, "hidden layers in actor and critic")
    log_std_init: float = option(
        0.0, "initial log standard deviation of the Gaussian policy (learned, the same for every state)"
    )
    squash: bool = option(False, "squash actions into the bounds with tanh (else clip them to the bounds)")
    normalize_obs: bool = option(True, "normalise observations by a running per-feature mean and variance")
    normalize_reward: bool = option(True, "divide rewards by a running std of the discounted return")
    eval_episodes: int = option(16, "greedy evaluation episodes per run after training")
    seed: int = option(0, "base seed; run i uses jax.random.split(PRNGKey(seed), num_seeds)[i]")
    num_seeds: int = option(8, "independent runs trained side by side (vmapped)")

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


ACTIVATIONS = {"tanh": nn.tanh, "relu": nn.relu}
OBJECTIVES = ("ppo", "dpo")


def validate(config: Config) -> None:
    """Refuses a config that cannot run, naming the option and what is allowed."""
    integers = ("total_timesteps", "num_envs", "num_steps", "update_epochs", "num_minibatches", "hidden_size")
    require_positive(config, (*integers, "num_layers", "eval_episodes", "num_seeds"))
    validate_hparams({name: getattr(config, name) for name in HParams._fields})
    require(np.isfinite(config.log_std_init), f"--log-std-init must be finite, got {config.log_std_init}")
    for name, allowed in (("objective", OBJECTIVES), ("activation", ACTIVATIONS)):
        value = getattr(config, name)
        require(value in allowed, f"{flag(name)} must be one of {', '.join(allowed)}, got {value!r}")
    for name in ("dpo_alpha", "dpo_beta"):
        value = getattr(config, name)
        require(np.isfinite(value) and value > 0, f"{flag(name)} must be positive, got {value}")
    batch, minibatches = config.steps_per_update, config.num_minibatches
    require(batch % minibatches == 0, f"--num-minibatches {minibatches} must divide num_envs * num_steps = {batch}")
    require(
        batch <= config.total_timesteps < 2**31,
        f"--total-timesteps must be in [{batch}, 2**31) (one rollout "
        f"of num_envs * num_steps, and int32 step counts), got {config.total_timesteps}",
    )


def validate_hparams(values: dict) -> None:
    """The checks of the sweepable fields, for the Config and for every sweep point."""
    for name, value in values.items():
        require(np.isfinite(value), f"{flag(name)} must be finite, got {value}")
    require(values["lr"] > 0, f"--lr must be positive, got {values['lr']}")
    for name in ("gamma", "gae_lambda"):
        require(0 <= values[name] <= 1, f"{flag(name)} must be in [0, 1], got {values[name]}")
    for name in ("clip_eps", "max_grad_norm"):
        require(values[name] > 0, f"{flag(name)} must be positive, got {values[name]}")
    for name in ("ent_coef", "vf_coef"):
        require(values[name] >= 0, f"{flag(name)} must be >= 0, got {values[name]}")


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
    episodes: Episodes
    obs_norm: RunningStats  # [obs_dim] statistics of every observation acted on, all envs together
    return_norm: RunningStats  # [] statistics of discounted_return, whose std scales the rewards
    discounted_return: jax.Array  # [num_envs] discounted return so far of each env's current episode
    rng: jax.Array
    hparams: HParams


def compute_gae(reward, value, next_value, terminated, done, gamma, gae_lambda):
    """Advantages and value targets for a [T, N] rollout. `next_value[t]` is V of the true next observation
    (before auto-reset), so a time-limit truncation bootstraps from the state it cut off; only `terminated`
    zeroes it. `done` (either) stops the recursion from leaking advantages across episodes."""
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
    """Per sample, the policy loss from the ratio r = exp(log_ratio) of the new policy to the one that
    acted and the (normalised) advantage A. ppo: -min(r A, clip(r, 1 - clip_eps, 1 + clip_eps) A). dpo
    (Lu et al. 2022): -(r A - drift), the drift ReLU((r - 1) A - alpha tanh((r - 1) A / alpha)) for
    A >= 0 and ReLU(log(r) A - beta tanh(log(r) A / beta)) for A < 0: zero near r = 1, growing once
    the policy has moved far in the direction the advantage favours."""
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
    lr = (lambda count: hparams.lr * (1.0 - count / num_grad_steps)) if config.anneal_lr else hparams.lr
    return optax.chain(optax.clip_by_global_norm(hparams.max_grad_norm), optax.adam(learning_rate=lr, eps=1e-5))


def make_train(config: Config) -> Callable:
    """Returns `train(rng, hparams=None) -> (runner, metrics)` running the whole config, where
    `metrics` maps names to arrays of shape [num_updates]: `train.init(rng, hparams)`, then
    `train.update(runner, update_index)` num_updates times in a `lax.scan`."""
    validate(config)
    env = VecEnv(config.env_name, config.num_envs)
    bounded = np.isfinite(env.action_low).all() and np.isfinite(env.action_high).all()
    require(
        bounded or not config.squash,
        f"--squash needs bounded actions; --env-name {config.env_name} has bounds {env.action_low} to "
        f"{env.action_high}",
    )
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
        return Runner(
            params=params,
            opt_state=make_optimizer(config, hparams).init(ravel_pytree(params)[0]),
            episodes=Episodes.start(*env.reset(env_key)),
            obs_norm=RunningStats.empty((env.obs_dim,)),
            return_norm=RunningStats.empty(),
            discounted_return=jnp.zeros(N),
            rng=rng,
            hparams=hparams,
        )

    def rollout(runner: Runner, key: jax.Array, norm: Callable):
        """T steps of every env under the current policy: (the episodes after them, [T, N] transitions)."""

        def env_step(episodes: Episodes, noise):
            action_noise, env_noise = noise
            mean, log_std = networks.actor.apply(runner.params["actor"], norm(episodes.obs))
            action = mean + jnp.exp(log_std) * action_noise
            log_prob = to_env.log_prob(action, mean, log_std)
            step = env.step(env_noise, episodes.env_state, to_env(action))
            transition = Transition(
                obs=episodes.obs,
                action=action,
                log_prob=log_prob,
                reward=step.reward,
                terminated=step.terminated,
                done=step.terminated | step.truncated,
                final_obs=step.final_obs,
            )
            return episodes.after(step), transition

        # All randomness of the rollout is drawn here in two batched calls, not step by step.
        action_key, env_key = key
        noise = (jax.random.normal(action_key, (T, N, env.action_dim)), env.presample(env_key, T))
        return jax.lax.scan(env_step, runner.episodes.counting(), noise)

    def make_batch(params, transitions: Transition, reward: jax.Array, norm: Callable, hp: HParams) -> Batch:
        """The rollout (observations normalised) with its values, GAE advantages and value targets
        for the (scaled) `reward`, flattened to [T * N]."""
        batch_obs = norm(transitions.obs)
        # The critic is not needed to act, so it runs once over the whole rollout instead of
        # once per step; V(final_obs) gives every step's bootstrap value, last step included.
        observations = jnp.concatenate([batch_obs, norm(transitions.final_obs)])
        values = networks.critic.apply(params["critic"], observations)[..., 0]
        value, next_value = values[:T], values[T:]
        terminated = transitions.terminated.astype(jnp.float32)
        advantage, target = compute_gae(
            reward, value, next_value, terminated, transitions.done, hp.gamma, hp.gae_lambda
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
            loss = lambda p: ppo_loss(config, networks, to_env, unravel(p), minibatch, hp)  # noqa: E731
            grads, stats = jax.grad(loss, has_aux=True)(flat_params)
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
        episodes, transitions = rollout(runner, (action_key, env_key), norm)
        reward, return_norm, discounted_return = scale_rewards(runner, transitions, hp)
        obs_norm = update_stats(runner.obs_norm, transitions.obs) if config.normalize_obs else runner.obs_norm
        batch = make_batch(runner.params, transitions, reward, norm, hp)
        rng, shuffle_key = jax.random.split(rng)
        flat_params = ravel_pytree(runner.params)[0]
        (flat_params, opt_state), stats = learn(flat_params, runner.opt_state, batch, shuffle_key, hp)
        params = unravel(flat_params)
        metrics = {
            "env_steps": (update_index + 1) * T * N,
            **episodes.metrics(),
            **{name: value.mean() for name, value in stats.items()},
            "action_std": jnp.exp(params["actor"]["params"]["log_std"]).mean(),
            "return_std": jnp.sqrt(return_norm.var),
            "finite": jnp.isfinite(stats["loss"]).all() & jnp.isfinite(flat_params).all(),
        }
        runner = Runner(
            params=params,
            opt_state=opt_state,
            episodes=episodes,
            obs_norm=obs_norm,
            return_norm=return_norm,
            discounted_return=discounted_return,
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
    """What params.msgpack holds and `make_evaluate` takes: the networks and the normalisation
    statistics (as dicts, so that flax.serialization.msgpack_restore gives back the same tree)."""
    return {**runner.params, "obs_norm": runner.obs_norm._asdict(), "return_norm": runner.return_norm._asdict()}


def make_greedy_policy(config: Config, env: VecEnv) -> "GreedyPolicy":
    """The Gaussian's mean, clipped or squashed into the bounds, of observations normalised by
    the saved statistics, frozen."""
    networks = make_networks(config, env.action_dim)
    to_env = action_map(config, env)

    def act(params, carry, obs: jax.Array, start: jax.Array):
        if config.normalize_obs:
            obs = normalize(RunningStats(**params["obs_norm"]), obs)
        return carry, to_env(networks.actor.apply(params["actor"], obs)[0])

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
