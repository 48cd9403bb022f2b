"""PQN (Parallelised Q-Network, Q(lambda)) for discrete-action gymnax environments, in one file.

    python pqn.py --env-name Acrobot-v1 --num-seeds 16 --lr 1e-3     # --help: every option

PQN (Gallici et al., "Simplifying Deep Temporal Difference Learning", 2024) is Q-learning without
a replay buffer or a target network: many parallel envs act epsilon-greedily, the rollout's
Q(lambda) returns are computed once with the current network, and a LayerNorm Q-network regresses
onto them for a few epochs of shuffled minibatches, as PPO does. The whole run is one jitted
function, and seeds (and sweep points: the float hyperparameters in HParams) are vmapped into one
program:

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
    total_timesteps: int = option(307_200, "environment steps per run (all envs together)")
    num_envs: int = option(16, "parallel environments per run")
    num_steps: int = option(32, "steps per environment in each rollout")
    update_epochs: int = option(4, "passes over each rollout batch")
    num_minibatches: int = option(4, "minibatches per epoch; must divide num_envs * num_steps")
    lr: float = option(1e-3, "Adam learning rate (start value when annealed)")
    anneal_lr: bool = option(True, "decay the learning rate linearly to 0 over all gradient steps")
    gamma: float = option(0.99, "discount factor")
    q_lambda: float = option(0.65, "Q(lambda) lambda: 0 is one-step Q-learning, 1 Monte Carlo + bootstrap")
    eps_start: float = option(1.0, "epsilon-greedy exploration: epsilon at the first update")
    eps_end: float = option(0.01, "epsilon after the decay, to the end of training")
    eps_fraction: float = option(0.2, "fraction of training (updates) over which epsilon decays linearly")
    reward_scale: float = option(0.1, "rewards are multiplied by this in the Q targets (not in logged returns)")
    max_grad_norm: float = option(10.0, "global gradient-norm clip")
    activation: str = option("relu", "hidden activation: tanh or relu")
    hidden_size: int = option(64, "units per hidden layer of the Q-network")
    num_layers: int = option(2, "hidden layers (Dense -> LayerNorm -> activation) of the Q-network")
    layer_norm: bool = option(True, "LayerNorm after every hidden Dense layer (PQN's stabiliser)")
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
    q_lambda: jax.Array
    eps_start: jax.Array
    eps_end: jax.Array
    eps_fraction: jax.Array
    reward_scale: jax.Array
    max_grad_norm: jax.Array


ACTIVATIONS = {"tanh": nn.tanh, "relu": nn.relu}


def validate(config: Config) -> None:
    """Refuses a config that cannot run, naming the option and what is allowed."""
    integers = ("total_timesteps", "num_envs", "num_steps", "update_epochs", "num_minibatches", "hidden_size")
    require_positive(config, (*integers, "num_layers", "eval_episodes", "num_seeds"))
    validate_hparams({name: getattr(config, name) for name in HParams._fields})
    require(
        config.activation in ACTIVATIONS,
        f"--activation must be one of {', '.join(ACTIVATIONS)}, got {config.activation!r}",
    )
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
    for name in ("gamma", "q_lambda", "eps_start", "eps_end", "eps_fraction"):
        require(0 <= values[name] <= 1, f"{flag(name)} must be in [0, 1], got {values[name]}")
    for name in ("reward_scale", "max_grad_norm"):
        require(values[name] > 0, f"{flag(name)} must be positive, got {values[name]}")


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


class Networks(NamedTuple):
    q: nn.Module  # obs -> [num_actions] Q-values; its parameters are params["q"]


def make_networks(config: Config, num_actions: int) -> Networks:
    return Networks(
        q=QNetwork(
            num_actions,
            hidden_size=config.hidden_size,
            num_layers=config.num_layers,
            activation=config.activation,
            layer_norm=config.layer_norm,
        )
    )


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------
class Transition(NamedTuple):
    obs: jax.Array  # [T, N, obs_dim]
    action: jax.Array  # [T, N]
    reward: jax.Array  # [T, N]
    terminated: jax.Array  # [T, N]
    done: jax.Array  # [T, N] terminated or truncated: the next obs starts a new episode
    final_obs: jax.Array  # [T, N, obs_dim] true next observation (for bootstrapping)


class Batch(NamedTuple):
    obs: jax.Array
    action: jax.Array
    target: jax.Array  # Q(lambda) return of (obs, action)


class Runner(NamedTuple):
    """Everything one run carries from update to update."""

    params: Any
    opt_state: Any  # Adam state over the flattened parameter vector
    episodes: Episodes
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


def epsilon_at(update_index, num_updates: int, eps_start, eps_end, eps_fraction):
    """Exploration rate of an update: linear from eps_start (update 0) to eps_end (update
    eps_fraction * num_updates), then constant."""
    decay_updates = eps_fraction * num_updates
    progress = jnp.where(decay_updates > 0, jnp.clip(update_index / jnp.maximum(decay_updates, 1e-9), 0.0, 1.0), 1.0)
    return eps_start + (eps_end - eps_start) * progress


def q_loss(networks: Networks, params, minibatch: Batch):
    """Half the squared error of Q(obs, action) against its Q(lambda) return."""
    q = networks.q.apply(params["q"], minibatch.obs)
    q_taken = jnp.take_along_axis(q, minibatch.action[:, None], -1)[:, 0]
    loss = 0.5 * jnp.square(q_taken - minibatch.target).mean()
    return loss, {"loss": loss, "q_mean": q_taken.mean()}


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
    `train.update(runner, update_index)` num_updates times in a `lax.scan`."""
    validate(config)
    env = VecEnv(config.env_name, config.num_envs)
    networks = make_networks(config, env.num_actions)
    T, N, M, A = config.num_steps, config.num_envs, config.num_minibatches, env.num_actions

    def init_params(key: jax.Array):
        return {"q": networks.q.init(key, jnp.zeros((1, env.obs_dim)))}

    # The optimizer sees one flat vector instead of a handful of small arrays: on CPU every array
    # is a separate kernel launch in Adam and in the gradient-norm clip, which dominated a step.
    shapes = jax.eval_shape(init_params, jax.random.PRNGKey(0))
    _, unravel = ravel_pytree(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes))

    def init(rng: jax.Array, hparams: HParams | None = None) -> Runner:
        hparams = hparams_from(config) if hparams is None else hparams
        rng, params_key, env_key = jax.random.split(rng, 3)
        params = init_params(params_key)
        episodes = Episodes.start(*env.reset(env_key))
        opt_state = make_optimizer(config, hparams).init(ravel_pytree(params)[0])
        return Runner(params=params, opt_state=opt_state, episodes=episodes, rng=rng, hparams=hparams)

    def rollout(runner: Runner, key: jax.Array, epsilon: jax.Array):
        """T epsilon-greedy steps of every env: (the episodes after them, [T, N] transitions)."""

        def env_step(episodes: Episodes, noise):
            (explore, random_action), env_noise = noise
            greedy = jnp.argmax(networks.q.apply(runner.params["q"], episodes.obs), -1)
            action = jnp.where(explore, random_action, greedy)
            step = env.step(env_noise, episodes.env_state, action)
            transition = Transition(
                obs=episodes.obs,
                action=action,
                reward=step.reward,
                terminated=step.terminated,
                done=step.terminated | step.truncated,
                final_obs=step.final_obs,
            )
            return episodes.after(step), transition

        # All randomness of the rollout is drawn here in two batched calls, not step by step:
        # which env explores at which step, and the uniformly random action it then takes.
        action_key, env_key = key
        explore_u, action_u = jax.random.uniform(action_key, (2, T, N))
        random_action = jnp.minimum((action_u * A).astype(jnp.int32), A - 1)
        noise = ((explore_u < epsilon, random_action), env.presample(env_key, T))
        return jax.lax.scan(env_step, runner.episodes.counting(), noise)

    def make_batch(params, transitions: Transition, hp: HParams) -> Batch:
        """The rollout with its Q(lambda) returns, flattened to [T * N]."""
        # Bootstrap values run once over the whole rollout with the params that acted, and stay
        # fixed during the epochs: max_a Q(final_obs) gives every step's, last step included.
        next_q = jax.lax.stop_gradient(networks.q.apply(params["q"], transitions.final_obs).max(-1))
        target = compute_q_lambda(
            transitions.reward * hp.reward_scale,
            next_q,
            transitions.terminated.astype(jnp.float32),
            transitions.done,
            hp.gamma,
            hp.q_lambda,
        )
        batch = Batch(obs=transitions.obs, action=transitions.action, target=target)
        return jax.tree.map(lambda x: x.reshape(T * N, *x.shape[2:]), batch)

    def learn(flat_params, opt_state, batch: Batch, key: jax.Array, hp: HParams):
        """`update_epochs` passes of shuffled minibatch steps over the batch."""
        optimizer = make_optimizer(config, hp)

        def minibatch_step(train, minibatch: Batch):
            flat_params, opt_state = train
            grads, stats = jax.grad(lambda p: q_loss(networks, unravel(p), minibatch), has_aux=True)(flat_params)
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
        epsilon = epsilon_at(update_index, config.num_updates, hp.eps_start, hp.eps_end, hp.eps_fraction)
        rng, action_key, env_key = jax.random.split(runner.rng, 3)
        episodes, transitions = rollout(runner, (action_key, env_key), epsilon)
        batch = make_batch(runner.params, transitions, hp)
        rng, shuffle_key = jax.random.split(rng)
        (flat_params, opt_state), stats = learn(
            ravel_pytree(runner.params)[0], runner.opt_state, batch, shuffle_key, hp
        )
        metrics = {
            "env_steps": (update_index + 1) * T * N,
            **episodes.metrics(),
            **{name: value.mean() for name, value in stats.items()},
            "epsilon": epsilon,
            "finite": jnp.isfinite(stats["loss"]).all() & jnp.isfinite(flat_params).all(),
        }
        params = unravel(flat_params)
        return Runner(params=params, opt_state=opt_state, episodes=episodes, rng=rng, hparams=hp), metrics

    def train(rng: jax.Array, hparams: HParams | None = None):
        return jax.lax.scan(update, init(rng, hparams), jnp.arange(config.num_updates, dtype=jnp.int32))

    train.init, train.update = init, update
    return train


# --------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------
def saved_params(runner: Runner) -> dict:
    """What params.msgpack holds and `make_evaluate` takes: the Q-network's parameters."""
    return runner.params


def make_greedy_policy(config: Config, env: VecEnv) -> "GreedyPolicy":
    """The action of the highest Q-value."""
    networks = make_networks(config, env.num_actions)

    def act(params, carry, obs: jax.Array, start: jax.Array):
        return carry, jnp.argmax(networks.q.apply(params["q"], obs), -1)

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
