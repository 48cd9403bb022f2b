"""Recurrent PPO (a GRU under the actor and critic heads, clipped surrogate, GAE) for partially
observable discrete-action gymnax environments, in one file.

    python ppo_rnn.py                          # CartPole-v1 without velocities, 8 seeds
    python ppo_rnn.py --env-name MemoryChain-bsuite --num-seeds 16     # --help: every option

The whole run (rollout, GAE, epochs of minibatch updates that replay whole env sequences through
the GRU) is one jitted function, and seeds (and sweep points: the float hyperparameters in
HParams) are vmapped into one program:

    train = make_train(Config(env_name="CartPole-v1-no-velocity"))
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
    env_name: str = option(
        "CartPole-v1-no-velocity",
        "a gymnax environment with discrete actions (gymnax.registered_envs), or CartPole-v1-no-velocity (cart "
        "position and pole angle only)",
    )
    total_timesteps: int = option(299_520, "environment steps per run (all envs together)")
    num_envs: int = option(16, "parallel environments per run")
    num_steps: int = option(32, "steps per environment in each rollout")
    update_epochs: int = option(4, "passes over each rollout batch")
    num_minibatches: int = option(4, "minibatches per epoch, each whole env sequences; must divide num_envs")
    lr: float = option(6e-3, "Adam learning rate (start value when annealed)")
    anneal_lr: bool = option(True, "decay the learning rate linearly to 0 over all gradient steps")
    gamma: float = option(0.99, "discount factor")
    gae_lambda: float = option(0.95, "GAE lambda (bias/variance trade-off of advantages)")
    clip_eps: float = option(0.2, "PPO ratio clip range; also clips the value update")
    ent_coef: float = option(0.01, "entropy bonus coefficient")
    vf_coef: float = option(0.25, "value loss coefficient")
    max_grad_norm: float = option(1.0, "global gradient-norm clip")
    activation: str = option("tanh", "hidden activation: tanh or relu")
    hidden_size: int = option(32, "GRU state size and units per Dense layer (actor and critic alike)")
    num_layers: int = option(1, "Dense layers between the GRU and each output (actor and critic alike)")
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


def validate(config: Config) -> None:
    """Refuses a config that cannot run, naming the option and what is allowed; registers PARTIAL_ENVS
    with gymnax (what make_train and make_evaluate call first, so their VecEnv finds those names)."""
    integers = ("total_timesteps", "num_envs", "num_steps", "update_epochs", "num_minibatches", "hidden_size")
    require_positive(config, (*integers, "eval_episodes", "num_seeds"))
    # 0 layers: linear outputs straight from the GRU state.
    require(config.num_layers >= 0, f"--num-layers must be >= 0, got {config.num_layers}")
    validate_hparams({name: getattr(config, name) for name in HParams._fields})
    activation = config.activation
    require(activation in ACTIVATIONS, f"--activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    require(
        config.num_envs % config.num_minibatches == 0,
        f"--num-minibatches {config.num_minibatches} must divide --num-envs {config.num_envs} "
        "(each minibatch is whole env sequences)",
    )
    batch = config.steps_per_update
    require(
        batch <= config.total_timesteps < 2**31,
        f"--total-timesteps must be in [{batch}, 2**31) (one rollout "
        f"of num_envs * num_steps, and int32 step counts), got {config.total_timesteps}",
    )
    register_partial_envs()


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
# Partially observable environments
# --------------------------------------------------------------------------------------
def observation_subset(env, indices: tuple, name: str):
    """`env` showing only some entries of its observation: a partially observable version of it.

    Dynamics, rewards, termination and time limit are `env`'s own; it keeps gymnax's stock `step`
    (auto-reset), so VecEnv presamples its resets like any stock env's. (A class made here rather
    than at module level: gymnax is imported only where an env is made.)"""
    from gymnax.environments import environment, spaces

    class ObservationSubset(environment.Environment):
        def __init__(self):
            super().__init__()
            self.env, self.indices, self._name = env, np.asarray(indices), name

        @property
        def default_params(self):
            return self.env.default_params

        def step_env(self, key, state, action, params):
            obs, state, reward, terminated, info = self.env.step_env(key, state, action, params)
            return obs[..., self.indices], state, reward, terminated, info

        def reset_env(self, key, params):
            obs, state = self.env.reset_env(key, params)
            return obs[..., self.indices], state

        def is_truncated(self, state, params):
            return self.env.is_truncated(state, params)

        @property
        def name(self) -> str:
            return self._name

        def action_space(self, params=None):
            return self.env.action_space(params)

        def observation_space(self, params):
            space = self.env.observation_space(params)
            low, high = (
                np.broadcast_to(np.asarray(bound), space.shape)[..., self.indices] for bound in (space.low, space.high)
            )
            return spaces.Box(low, high, low.shape, space.dtype)

    return ObservationSubset()


# Partially observable versions of gymnax envs: name -> (gymnax env, observation entries kept). CartPole
# without velocities (cart position, pole angle) can only be balanced by an agent with memory.
PARTIAL_ENVS = {"CartPole-v1-no-velocity": ("CartPole-v1", (0, 2))}


def register_partial_envs() -> None:
    """Registers PARTIAL_ENVS with gymnax (those not registered yet), for make_env and VecEnv."""
    import gymnax

    def factory(name: str):
        base_name, indices = PARTIAL_ENVS[name]
        return lambda **kwargs: observation_subset(gymnax.make(base_name, **kwargs)[0], indices, name)

    for name in PARTIAL_ENVS:
        if name not in gymnax.registered_envs:
            gymnax.register(name, factory(name))


# --------------------------------------------------------------------------------------
# Networks
# --------------------------------------------------------------------------------------
class ActorCritic(nn.Module):
    """obs -> GRU -> actor head (logits) and critic head (value), each `num_layers` Dense layers and an
    output; the GRU's state is the memory both heads read.

    One GRU, not one per head: the recurrence is what the update cannot batch over time, and a second
    one doubles it; the shared one solves CartPole without velocities on every seed.

    `__call__(hidden, obs) -> (hidden, logits, value)` is one step. Its parts are methods of their own
    because only the GRU's recurrence lies on the sequential path: over a stored sequence `inputs` and
    `heads` run batched over all its steps at once, and `gru_unroll` steps through the rest with the
    parameters `hidden_kernel` and `hidden_bias`."""

    num_actions: int
    hidden_size: int
    num_layers: int
    activation: str

    def setup(self):
        H, orthogonal = self.hidden_size, nn.initializers.orthogonal
        # The gates (reset r, update z, candidate n) as one [., 3H] matmul of the observation and
        # one of the state; the state's kernel is one orthogonal block per gate, as in flax's GRUCell.
        self.input_gates = nn.Dense(3 * H)
        self.hidden_kernel = self.param("hidden_kernel", _stacked(orthogonal(), 3), (H, 3 * H))
        self.hidden_bias = self.param("hidden_bias", nn.initializers.zeros, (3 * H,))
        dense = lambda: nn.Dense(H, kernel_init=orthogonal(np.sqrt(2)))  # noqa: E731
        self.actor_layers = [dense() for _ in range(self.num_layers)]
        self.critic_layers = [dense() for _ in range(self.num_layers)]
        # Small initial logits: a near-uniform first policy.
        self.actor_out = nn.Dense(self.num_actions, kernel_init=orthogonal(0.01))
        self.critic_out = nn.Dense(1, kernel_init=orthogonal(1.0))

    def inputs(self, obs: jax.Array) -> jax.Array:
        """The observation's share of the GRU gates: [..., obs_dim] -> [..., 3H]."""
        return self.input_gates(obs)

    def heads(self, hidden: jax.Array):
        """(logits, value) from GRU states [..., H]."""
        act = ACTIVATIONS[self.activation]
        x = y = hidden
        for actor_layer, critic_layer in zip(self.actor_layers, self.critic_layers, strict=True):
            x, y = act(actor_layer(x)), act(critic_layer(y))
        return self.actor_out(x), self.critic_out(y)[..., 0]

    def __call__(self, hidden: jax.Array, obs: jax.Array):
        hidden = gru_cell(self.hidden_kernel, self.hidden_bias, hidden, self.inputs(obs))
        return (hidden, *self.heads(hidden))


def _stacked(init: Callable, blocks: int) -> Callable:
    """An initializer drawing `init` separately for each of `blocks` equal column blocks."""

    def stacked(key, shape, dtype=jnp.float32):
        keys = jax.random.split(key, blocks)
        return jnp.concatenate([init(k, (*shape[:-1], shape[-1] // blocks), dtype) for k in keys], -1)

    return stacked


def gru_cell(kernel, bias, hidden, gates):
    """The state after one GRU step, from the state fed to it ([..., H]) and the observation's gates
    ([..., 3H]): the state's gates (a linear map of it), then `gru_combine`."""
    return gru_combine(gates, hidden @ kernel + bias, hidden)


def gru_combine(x_gates, h_gates, hidden):
    """The cell's elementwise part (flax GRUCell's equations): the state after a step from the
    observation's gates and the state's gates ([..., 3H] each: reset r, update z, candidate n)
    and the state fed to the step. Edit it freely (a layer norm, another cell): `gru_unroll`'s
    gradient differentiates it with jax.vjp."""
    x_r, x_z, x_n = jnp.split(x_gates, 3, axis=-1)
    h_r, h_z, h_n = jnp.split(h_gates, 3, axis=-1)
    r, z = nn.sigmoid(x_r + h_r), nn.sigmoid(x_z + h_z)
    n = jnp.tanh(x_n + r * h_n)
    return (1.0 - z) * n + z * hidden


def reset_hidden(hidden: jax.Array, start: jax.Array) -> jax.Array:
    """The GRU state fed to a step: the initial one (zeros) where `start` (its obs begins an episode)."""
    return jnp.where(start[..., None], 0.0, hidden)


@jax.custom_vjp
def gru_unroll(kernel, bias, hidden, gates, start):
    """The GRU over T steps: the state after each ([T, n, H]) from the state before the first
    ([n, H]) and the observations' gates ([T, n, 3H]); the state fed to step t is reset where
    start[t] ([T, n]), exactly as in the rollout.

    Its gradient is structured by hand, its arithmetic is JAX's. Autodiff of the scan adds the
    kernel's gradient up inside the backward loop, a small matmul and add per step; here the loop
    only carries the state's gradient, and the kernel's is one matmul over all steps after it
    (autodiff's update is slower: benchmarks/README.md). Each step's local derivatives are jax.vjp
    of `gru_combine`, so editing that function cannot make the gradient wrong; `gru_cell`'s linear
    map (hidden @ kernel + bias) is the part written into `_gru_backward`."""
    return _gru_forward(kernel, bias, hidden, gates, start)[0]


def _gru_forward(kernel, bias, hidden, gates, start):
    def step(hidden, xs):
        gates_t, start_t = xs
        fed = reset_hidden(hidden, start_t)
        hidden_gates = fed @ kernel + bias
        hidden = gru_combine(gates_t, hidden_gates, fed)
        return hidden, (hidden, hidden_gates)

    _, (states, hidden_gates) = jax.lax.scan(step, hidden, (gates, start))
    return states, (kernel, hidden, states, hidden_gates, gates, start)


def _gru_backward(residuals, d_states):
    kernel, hidden, states, hidden_gates, gates, start = residuals
    # The transposed kernel, materialised once: left to itself XLA folds the transpose into the
    # loop's matmul, whose CPU kernel then re-packs the kernel at every step.
    kernel_t = jax.lax.optimization_barrier(kernel.T)
    # The state fed to each step, rebuilt outside the loop: the one after the step before, or reset.
    fed = reset_hidden(jnp.concatenate([hidden[None], states[:-1]]), start)

    def step(d_after, xs):  # d_after: the gradient of the state after step t, from the steps after it
        d_state, gates_t, hidden_gates_t, fed_t, start_t = xs
        # The step's elementwise part, differentiated by JAX (its forward is recomputed: cheap).
        _, combine_vjp = jax.vjp(gru_combine, gates_t, hidden_gates_t, fed_t)
        d_gates, d_hidden_gates, d_fed = combine_vjp(d_state + d_after)
        d_fed = d_fed + d_hidden_gates @ kernel_t  # through hidden_gates = fed @ kernel + bias
        # A reset step's state was the initial one: nothing flows back into the step before it.
        return reset_hidden(d_fed, start_t), (d_gates, d_hidden_gates)

    d_hidden, (d_gates, d_hidden_gates) = jax.lax.scan(
        step, jnp.zeros_like(hidden), (d_states, gates, hidden_gates, fed, start), reverse=True
    )
    d_kernel = jnp.einsum("tnh,tng->hg", fed, d_hidden_gates)
    return d_kernel, d_hidden_gates.sum((0, 1)), d_hidden, d_gates, None


gru_unroll.defvjp(_gru_forward, _gru_backward)


def make_networks(config: Config, num_actions: int) -> ActorCritic:
    return ActorCritic(
        num_actions, hidden_size=config.hidden_size, num_layers=config.num_layers, activation=config.activation
    )


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------
class Transition(NamedTuple):
    obs: jax.Array  # [T, N, obs_dim]
    start: jax.Array  # [T, N] obs begins an episode: the GRU state fed to this step is reset
    action: jax.Array  # [T, N]
    log_prob: jax.Array  # [T, N] under the policy that acted
    value: jax.Array  # [T, N] the critic's value of obs, given the episode so far
    reward: jax.Array  # [T, N]
    terminated: jax.Array  # [T, N]
    done: jax.Array  # [T, N] terminated or truncated: the next obs starts a new episode
    final_obs: jax.Array  # [T, N, obs_dim] true next observation (for bootstrapping)
    next_value: jax.Array  # [T, N] V(final_obs), the GRU going on from its state after this step


class Batch(NamedTuple):
    """Time-major ([T, N, ...]); a minibatch is whole env sequences."""

    obs: jax.Array
    start: jax.Array
    action: jax.Array
    log_prob: jax.Array
    value: jax.Array
    advantage: jax.Array
    target: jax.Array


class Runner(NamedTuple):
    """Everything one run carries from update to update."""

    params: Any
    opt_state: Any  # Adam state over the flattened parameter vector
    episodes: Episodes
    hidden: jax.Array  # [num_envs, hidden] GRU state after the last step (not reset)
    rng: jax.Array
    hparams: HParams


def starts(episodes: Episodes) -> jax.Array:
    """[num_envs] bool: each env's observation begins an episode (the GRU state fed to it is reset)."""
    return episodes.episode_length == 0


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


def ppo_loss(logits: jax.Array, value: jax.Array, minibatch: Batch, hp: HParams):
    """The clipped surrogate, the clipped value loss and the entropy bonus of one minibatch of env
    sequences ([T, n, ...]), from the `logits` and `value` its replay gives."""
    log_probs = jax.nn.log_softmax(logits)
    log_prob = jnp.take_along_axis(log_probs, minibatch.action[..., None], -1)[..., 0]
    log_ratio = log_prob - minibatch.log_prob
    ratio = jnp.exp(log_ratio)
    advantage = minibatch.advantage
    advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
    policy_loss = -jnp.minimum(ratio * advantage, jnp.clip(ratio, 1 - hp.clip_eps, 1 + hp.clip_eps) * advantage).mean()
    value_clipped = minibatch.value + jnp.clip(value - minibatch.value, -hp.clip_eps, hp.clip_eps)
    value_loss = (
        0.5 * jnp.maximum(jnp.square(value - minibatch.target), jnp.square(value_clipped - minibatch.target)).mean()
    )
    entropy = -(jnp.exp(log_probs) * log_probs).sum(-1).mean()
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
    """Returns `train(rng, hparams=None) -> (runner, metrics)` running the whole config, where
    `metrics` maps names to arrays of shape [num_updates]: `train.init(rng, hparams)`, then
    `train.update(runner, update_index)` num_updates times in a `lax.scan`. For tests,
    `train.rollout(runner)` and `train.replay(params, hidden, obs, start)` are the two ways the
    network meets a sequence: acting step by step, and relearning from a stored one."""
    validate(config)
    env = VecEnv(config.env_name, config.num_envs)
    network = make_networks(config, env.num_actions)
    T, N, M = config.num_steps, config.num_envs, config.num_minibatches

    def init_params(key: jax.Array):
        return network.init(key, jnp.zeros((1, config.hidden_size)), jnp.zeros((1, env.obs_dim)))

    # The optimizer sees one flat vector instead of a dozen small arrays: on CPU every array is a
    # separate kernel launch in Adam and in the gradient-norm clip, which dominated a step.
    shapes = jax.eval_shape(init_params, jax.random.PRNGKey(0))
    _, unravel = ravel_pytree(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes))

    def init(rng: jax.Array, hparams: HParams | None = None) -> Runner:
        hparams = hparams_from(config) if hparams is None else hparams
        rng, params_key, env_key = jax.random.split(rng, 3)
        params = init_params(params_key)
        episodes = Episodes.start(*env.reset(env_key))
        opt_state = make_optimizer(config, hparams).init(ravel_pytree(params)[0])
        hidden = jnp.zeros((N, config.hidden_size))
        return Runner(params=params, opt_state=opt_state, episodes=episodes, hidden=hidden, rng=rng, hparams=hparams)

    def rollout(runner: Runner):
        """T steps of every env under the runner's policy: (the runner after them, [T, N] transitions)."""

        def env_step(carry, noise):
            episodes, hidden = carry
            action_noise, env_noise = noise
            start = starts(episodes)
            hidden, logits, value = network.apply(runner.params, reset_hidden(hidden, start), episodes.obs)
            action = jnp.argmax(logits + action_noise, -1)  # Gumbel-max: a sample of softmax(logits)
            log_prob = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None], -1)[:, 0]
            step = env.step(env_noise, episodes.env_state, action)
            transition = Transition(
                obs=episodes.obs,
                start=start,
                action=action,
                log_prob=log_prob,
                value=value,
                reward=step.reward,
                terminated=step.terminated,
                done=step.terminated | step.truncated,
                final_obs=step.final_obs,
                next_value=None,  # filled in below
            )
            return (episodes.after(step), hidden), (transition, hidden)

        # All randomness of the rollout is drawn here in two batched calls, not step by step.
        rng, action_key, env_key = jax.random.split(runner.rng, 3)
        noise = (jax.random.gumbel(action_key, (T, N, env.num_actions)), env.presample(env_key, T))
        first = (runner.episodes.counting(), runner.hidden)
        (episodes, hidden), (transitions, states) = jax.lax.scan(env_step, first, noise)
        # V(final_obs) from the GRU state after each step, one batched call for the whole rollout:
        # a truncated episode bootstraps from its true next observation with the state of the
        # episode it cut off (never the reset one); only `terminated` will zero it.
        transitions = transitions._replace(next_value=network.apply(runner.params, states, transitions.final_obs)[2])
        return runner._replace(episodes=episodes, hidden=hidden, rng=rng), transitions

    def replay(params, hidden: jax.Array, obs: jax.Array, start: jax.Array):
        """(logits, values) of stored env sequences ([T, n, ...]) from the GRU state before their
        first step ([n, H]), reset where the rollout reset it. Only the recurrence runs step by
        step; the layers before and after it see all T steps in one batched call."""
        gates = network.apply(params, obs, method=ActorCritic.inputs)
        states = gru_unroll(params["params"]["hidden_kernel"], params["params"]["hidden_bias"], hidden, gates, start)
        return network.apply(params, states, method=ActorCritic.heads)

    def learn(flat_params, opt_state, batch: Batch, hidden: jax.Array, key: jax.Array, hp: HParams):
        """`update_epochs` passes of shuffled minibatch steps, each minibatch whole env sequences
        replayed from the GRU state `hidden` [N, H] the rollout started from."""
        optimizer = make_optimizer(config, hp)

        def loss(flat_params, minibatch: Batch, hidden: jax.Array):
            logits, value = replay(unravel(flat_params), hidden, minibatch.obs, minibatch.start)
            return ppo_loss(logits, value, minibatch, hp)

        def minibatch_step(train, minibatch):
            flat_params, opt_state = train
            grads, stats = jax.grad(loss, has_aux=True)(flat_params, *minibatch)
            updates, opt_state = optimizer.update(grads, opt_state)
            stats["grad_norm"] = jnp.linalg.norm(grads)
            return (flat_params + updates, opt_state), stats

        def epoch(train, order):
            envs = order.reshape(M, N // M)  # minibatches split the envs, never the time axis
            minibatches = (jax.tree.map(lambda x: jnp.swapaxes(x[:, envs], 0, 1), batch), hidden[envs])
            return jax.lax.scan(minibatch_step, train, minibatches)

        # Every epoch's shuffle of the envs in one batched sort, not one sort per epoch.
        orders = jax.vmap(jax.random.permutation, in_axes=(0, None))(jax.random.split(key, config.update_epochs), N)
        return jax.lax.scan(epoch, (flat_params, opt_state), orders)

    def make_batch(tr: Transition, hp: HParams) -> Batch:
        """The rollout `tr` with its GAE advantages and value targets, time-major [T, N]."""
        terminated = tr.terminated.astype(jnp.float32)
        advantage, target = compute_gae(
            tr.reward, tr.value, tr.next_value, terminated, tr.done, hp.gamma, hp.gae_lambda
        )
        return Batch(
            obs=tr.obs,
            start=tr.start,
            action=tr.action,
            log_prob=tr.log_prob,
            value=tr.value,
            advantage=advantage,
            target=target,
        )

    def update(runner: Runner, update_index: jax.Array):
        hp = runner.hparams
        hidden = runner.hidden  # the GRU state this rollout starts from: its sequences replay from it
        runner, transitions = rollout(runner)
        batch = make_batch(transitions, hp)
        rng, shuffle_key = jax.random.split(runner.rng)
        flat_params = ravel_pytree(runner.params)[0]
        (flat_params, opt_state), stats = learn(flat_params, runner.opt_state, batch, hidden, shuffle_key, hp)
        metrics = {
            "env_steps": (update_index + 1) * T * N,
            **runner.episodes.metrics(),
            **{name: value.mean() for name, value in stats.items()},
            "finite": jnp.isfinite(stats["loss"]).all() & jnp.isfinite(flat_params).all(),
        }
        return runner._replace(params=unravel(flat_params), opt_state=opt_state, rng=rng), metrics

    def train(rng: jax.Array, hparams: HParams | None = None):
        return jax.lax.scan(update, init(rng, hparams), jnp.arange(config.num_updates, dtype=jnp.int32))

    train.init, train.update, train.rollout, train.replay = init, update, rollout, replay
    return train


# --------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------
def saved_params(runner: Runner) -> dict:
    """What params.msgpack holds and `make_evaluate` takes: the network's parameters."""
    return runner.params


def make_greedy_policy(config: Config, env: VecEnv) -> "GreedyPolicy":
    """The most probable action; the GRU state carried from step to step, reset where an episode begins."""
    network = make_networks(config, env.num_actions)

    def act(params, hidden: jax.Array, obs: jax.Array, start: jax.Array):
        hidden, logits, _ = network.apply(params, reset_hidden(hidden, start), obs)
        return hidden, jnp.argmax(logits, -1)

    return GreedyPolicy(init=lambda num_envs: jnp.zeros((num_envs, config.hidden_size)), act=act)


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
