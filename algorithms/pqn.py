"""PQN (Parallelised Q-Network, Q(lambda)) for discrete-action gymnax environments, in one file:
`python pqn.py --env-name Acrobot-v1 --num-seeds 16 --lr 1e-3` (--help lists every option).

PQN (Gallici et al., "Simplifying Deep Temporal Difference Learning", 2024) is Q-learning without
a replay buffer or a target network: many parallel envs act epsilon-greedily, the rollout's
Q(lambda) returns are computed once with the current network, and a LayerNorm Q-network regresses
onto them for a few epochs of shuffled minibatches, as PPO does. The whole run is one jitted
function, and seeds (and sweep points: the float hyperparameters in HParams) are vmapped into one
program:

    train = make_train(Config(env_name="CartPole-v1"))
    runner, metrics = jax.jit(jax.vmap(train))(jax.random.split(jax.random.PRNGKey(0), 8))

Depends only on jax, flax, optax, chex, gymnax and numpy: copy it anywhere and it runs. Importing
it defines things and does nothing else. The algorithm comes first; the blocks that let the file
run alone (environment loop, evaluation, command line) are last, the same in every file.
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
import typing
from collections.abc import Callable
from typing import Annotated, Any, NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization

# gymnax is imported where an environment is made, not here: it computes with JAX when
# imported, which would start JAX's backend before the command line sets XLA's flags.

HARNESS_PROTOCOL = 2  # the run harness's interface this file follows (algorithms/onefile_harness/protocol.py)
ACTIONS = "discrete"  # the action spaces this algorithm takes


@dataclasses.dataclass(frozen=True)
class Config:
    """Every field is a command-line flag (`lr` is --lr); its annotation's text is the flag's help."""

    env_name: Annotated[str, "a gymnax environment with discrete actions (gymnax.registered_envs)"] = "CartPole-v1"
    total_timesteps: Annotated[int, "environment steps per run (all envs together)"] = 307_200
    num_envs: Annotated[int, "parallel environments per run"] = 16
    num_steps: Annotated[int, "steps per environment in each rollout"] = 32
    update_epochs: Annotated[int, "passes over each rollout batch"] = 4
    num_minibatches: Annotated[int, "minibatches per epoch; must divide num_envs * num_steps"] = 4
    lr: Annotated[float, "Adam learning rate (start value when annealed)"] = 1e-3
    anneal_lr: Annotated[bool, "decay the learning rate linearly to 0 over all gradient steps"] = True
    gamma: Annotated[float, "discount factor"] = 0.99
    q_lambda: Annotated[float, "Q(lambda) lambda: 0 is one-step Q-learning, 1 Monte Carlo + bootstrap"] = 0.65
    eps_start: Annotated[float, "epsilon-greedy exploration: epsilon at the first update"] = 1.0
    eps_end: Annotated[float, "epsilon after the decay, to the end of training"] = 0.01
    eps_fraction: Annotated[float, "fraction of training (updates) over which epsilon decays linearly"] = 0.2
    reward_scale: Annotated[float, "rewards are multiplied by this in the Q targets (not in logged returns)"] = 0.1
    max_grad_norm: Annotated[float, "global gradient-norm clip"] = 10.0
    activation: Annotated[str, "hidden activation: tanh or relu"] = "relu"
    hidden_size: Annotated[int, "units per hidden layer of the Q-network"] = 64
    num_layers: Annotated[int, "hidden layers (Dense -> LayerNorm -> activation) of the Q-network"] = 2
    layer_norm: Annotated[bool, "LayerNorm after every hidden Dense layer (PQN's stabiliser)"] = True
    eval_episodes: Annotated[int, "greedy evaluation episodes per run after training"] = 16
    seed: Annotated[int, "base seed; run i uses jax.random.split(PRNGKey(seed), num_seeds)[i]"] = 0
    num_seeds: Annotated[int, "independent runs trained side by side (vmapped)"] = 8

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
    shape = dict(hidden_size=config.hidden_size, num_layers=config.num_layers, activation=config.activation)
    return Networks(q=QNetwork(num_actions, layer_norm=config.layer_norm, **shape))


# --------------------------------------------------------------------------------------
# The algorithm: Q(lambda) returns, the epsilon schedule, the Q loss, and the training loop
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

    params: Any  # {"q": ...}
    opt_state: Any
    episodes: "Episodes"
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


def q_loss(networks: Networks, params, minibatch: Batch, key: jax.Array):
    """Half the squared error of Q(obs, action) against its Q(lambda) return. `key` is unused by
    PQN itself: it is there for a loss that samples (noise, dropout)."""
    q = networks.q.apply(params["q"], minibatch.obs)
    q_taken = jnp.take_along_axis(q, minibatch.action[:, None], -1)[:, 0]
    loss = 0.5 * jnp.square(q_taken - minibatch.target).mean()
    return loss, {"loss": loss, "q_mean": q_taken.mean()}


def make_optimizer(config: Config, hparams: HParams):
    num_grad_steps = config.num_updates * config.update_epochs * config.num_minibatches
    lr = (lambda count: hparams.lr * (1.0 - count / num_grad_steps)) if config.anneal_lr else hparams.lr
    return optax.chain(optax.clip_by_global_norm(hparams.max_grad_norm), optax.adam(learning_rate=lr, eps=1e-5))


def make_train(config: Config, env: "VecEnv | None" = None) -> Callable:
    """Returns `train(rng, hparams=None) -> (runner, metrics)` running the whole config, where
    `metrics` maps names to arrays of shape [num_updates]: `train.init(rng, hparams)`, then
    `train.update(runner, update_index)` num_updates times in a `lax.scan`. `env` is the vectorised
    environment to train in (default: `VecEnv(config.env_name, config.num_envs)`)."""
    validate(config)
    env = VecEnv(config.env_name, config.num_envs) if env is None else env
    networks = make_networks(config, env.num_actions)
    T, N, M = config.num_steps, config.num_envs, config.num_minibatches

    def init(rng: jax.Array, hparams: HParams | None = None) -> Runner:
        hparams = hparams_from(config) if hparams is None else hparams
        rng, params_key, env_key = jax.random.split(rng, 3)
        params = {"q": networks.q.init(params_key, jnp.zeros((1, env.obs_dim)))}
        opt_state = make_optimizer(config, hparams).init(params)
        episodes = Episodes.start(*env.reset(env_key))
        return Runner(params=params, opt_state=opt_state, episodes=episodes, rng=rng, hparams=hparams)

    def rollout(params, episodes: "Episodes", epsilon: jax.Array, key: jax.Array):
        """T epsilon-greedy steps of every env: (the episodes after them, [T, N] transitions)."""

        def env_step(episodes: Episodes, key: jax.Array):
            action_key, env_key = jax.random.split(key)
            action = epsilon_greedy_action(networks, params, episodes.obs, epsilon, action_key)
            step = env.step(env_key, episodes.env_state, action)
            done = step.terminated | step.truncated
            transition = Transition(episodes.obs, action, step.reward, step.terminated, done, step.final_obs)
            return episodes.after(step), transition

        return jax.lax.scan(env_step, episodes.counting(), jax.random.split(key, T))

    def make_batch(params, transitions: Transition, hp: HParams) -> Batch:
        """The rollout with its Q(lambda) returns, flattened to [T * N]."""
        # Bootstrap values run once over the whole rollout with the params that acted, and stay
        # fixed during the epochs: max_a Q(final_obs) gives every step's, last step included.
        next_q = networks.q.apply(params["q"], transitions.final_obs).max(-1)
        terminated = transitions.terminated.astype(jnp.float32)
        reward = transitions.reward * hp.reward_scale
        target = compute_q_lambda(reward, next_q, terminated, transitions.done, hp.gamma, hp.q_lambda)
        batch = Batch(obs=transitions.obs, action=transitions.action, target=target)
        return jax.tree.map(lambda x: x.reshape(T * N, *x.shape[2:]), batch)

    def learn(params, opt_state, batch: Batch, key: jax.Array, hp: HParams):
        """`update_epochs` passes of shuffled minibatch steps over the batch."""
        optimizer = make_optimizer(config, hp)

        def minibatch_step(train, inputs):
            (params, opt_state), (minibatch, key) = train, inputs
            grads, stats = jax.grad(q_loss, argnums=1, has_aux=True)(networks, params, minibatch, key)
            updates, opt_state = optimizer.update(grads, opt_state)
            return (optax.apply_updates(params, updates), opt_state), {**stats, "grad_norm": optax.tree.norm(grads)}

        def epoch(train, key):
            order_key, loss_key = jax.random.split(key)
            order = jax.random.permutation(order_key, T * N)
            minibatches = jax.tree.map(lambda x: x[order].reshape(M, T * N // M, *x.shape[1:]), batch)
            return jax.lax.scan(minibatch_step, train, (minibatches, jax.random.split(loss_key, M)))

        return jax.lax.scan(epoch, (params, opt_state), jax.random.split(key, config.update_epochs))

    def update(runner: Runner, update_index: jax.Array):
        hp = runner.hparams
        epsilon = epsilon_at(update_index, config.num_updates, hp.eps_start, hp.eps_end, hp.eps_fraction)
        rng, rollout_key, learn_key = jax.random.split(runner.rng, 3)
        episodes, transitions = rollout(runner.params, runner.episodes, epsilon, rollout_key)
        batch = make_batch(runner.params, transitions, hp)
        (params, opt_state), stats = learn(runner.params, runner.opt_state, batch, learn_key, hp)
        metrics = {
            "env_steps": (update_index + 1) * T * N,
            **episodes.metrics(),
            **{name: value.mean() for name, value in stats.items()},
            "epsilon": epsilon,
            "finite": jnp.isfinite(stats["loss"]).all() & jnp.isfinite(optax.tree.norm(params)),
        }
        return Runner(params=params, opt_state=opt_state, episodes=episodes, rng=rng, hparams=hp), metrics

    def train(rng: jax.Array, hparams: HParams | None = None):
        return jax.lax.scan(update, init(rng, hparams), jnp.arange(config.num_updates, dtype=jnp.int32))

    train.init, train.update = init, update
    return train


# --------------------------------------------------------------------------------------
# The policy's action
# --------------------------------------------------------------------------------------
def epsilon_greedy_action(networks: Networks, params, obs: jax.Array, epsilon: jax.Array, key: jax.Array):
    """For each observation, with probability epsilon a uniformly random action, else the greedy one."""
    explore_key, random_key = jax.random.split(key)
    q = networks.q.apply(params["q"], obs)
    explore = jax.random.uniform(explore_key, q.shape[:-1]) < epsilon
    random_action = jax.random.randint(random_key, q.shape[:-1], 0, q.shape[-1])
    return jnp.where(explore, random_action, jnp.argmax(q, -1))


def make_greedy_policy(config: Config, env: "VecEnv") -> "Policy":
    """The action of the highest Q-value (no carry: the policy is not recurrent)."""
    networks = make_networks(config, env.num_actions)

    def act(params, carry, obs: jax.Array, start: jax.Array, key: jax.Array):
        return carry, jnp.argmax(networks.q.apply(params["q"], obs), -1)

    return Policy(init=lambda num_envs: (), act=act)


def saved_params(runner: Runner) -> dict:
    """What params.msgpack holds and `make_evaluate` takes: the Q-network's parameters."""
    return runner.params


# --------------------------------------------------------------------------------------
# Running this file (the same in every algorithm file: tests/test_files.py): config helpers, the
# environment loop, greedy evaluation and the command line. In the repository, `python
# algorithms/<name>.py` hands over to the run harness beside it (algorithms/onefile_harness); a copy
# of this file alone runs `main`.
# --------------------------------------------------------------------------------------
class ConfigError(ValueError):
    """A config value that cannot work, naming the option and what is allowed; raised before anything compiles."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def require_positive(config, names: tuple) -> None:
    for name in names:
        require(getattr(config, name) > 0, f"{flag(name)} must be a positive integer, got {getattr(config, name)}")


def hparams_from(config) -> HParams:  # the Config's own values of the sweepable fields
    return HParams(**{name: jnp.float32(getattr(config, name)) for name in HParams._fields})


def make_env(env_name: str):
    """gymnax.make, with errors a user can act on; only the ACTIONS this file's algorithm takes."""
    import gymnax

    names = gymnax.registered_envs
    require(env_name in names, f"--env-name {env_name!r} is not a gymnax environment; choose one of {', '.join(names)}")
    env, env_params = gymnax.make(env_name)
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


class VecEnv:
    """`num_envs` copies of a gymnax env stepped by gymnax's own `step` (auto-reset, the true final
    observation) under `jax.vmap`; observations flat float32, actions in the env's shape."""

    def __init__(self, env_name: str, num_envs: int):
        self.env, self.params = make_env(env_name)
        self.num_envs, self.max_episode_steps = num_envs, int(self.params.max_steps_in_episode)
        self.obs_shape = tuple(self.env.observation_space(self.params).shape)
        self.obs_dim = int(np.prod(self.obs_shape))
        space = self.env.action_space(self.params)
        self.num_actions = int(getattr(space, "n", 0))  # discrete actions: how many
        self.action_shape, self.action_dim = tuple(space.shape), int(np.prod(space.shape))  # continuous actions
        bounds = [np.broadcast_to(np.float32(getattr(space, end, 0)), space.shape) for end in ("low", "high")]
        self.action_low, self.action_high = (bound.reshape(-1) for bound in bounds)  # flat [action_dim]

    def flat(self, obs: jax.Array) -> jax.Array:
        return obs.reshape(*obs.shape[: obs.ndim - len(self.obs_shape)], self.obs_dim).astype(jnp.float32)

    def reset(self, key: jax.Array):
        obs, state = jax.vmap(self.env.reset, in_axes=(0, None))(jax.random.split(key, self.num_envs), self.params)
        return self.flat(obs), state

    def step(self, key: jax.Array, state: Any, action: jax.Array) -> EnvStep:
        step = jax.vmap(self.env.step, in_axes=(0, 0, 0, None))
        keys, action = jax.random.split(key, self.num_envs), action.reshape(self.num_envs, *self.action_shape)
        obs, state, reward, terminated, truncated, info = step(keys, state, action, self.params)
        final_obs = self.flat(info["final_observation"])
        return EnvStep(self.flat(obs), state, reward.astype(jnp.float32), terminated, truncated, final_obs)


class Episodes(NamedTuple):
    """Every env's current episode, and sums over the episodes that ended since `counting()` (an
    update's start): their means are the logged metrics."""

    env_state: Any
    obs: jax.Array  # [num_envs, obs_dim]
    episode_return: jax.Array  # [num_envs] return so far
    episode_length: jax.Array  # [num_envs] steps so far
    finished: jax.Array = None  # int32: episodes that ended since counting began
    return_sum: jax.Array = None  # float32: their returns, summed
    length_sum: jax.Array = None  # int32: their lengths, summed

    @classmethod
    def start(cls, obs: jax.Array, env_state: Any) -> "Episodes":
        return cls(env_state, obs, jnp.zeros(obs.shape[0]), jnp.zeros(obs.shape[0], jnp.int32)).counting()

    def counting(self) -> "Episodes":
        return self._replace(finished=jnp.int32(0), return_sum=jnp.float32(0), length_sum=jnp.int32(0))

    def after(self, step: EnvStep) -> "Episodes":
        """The episodes after `step`: those that ended are counted and begin anew."""
        done, ret, length = step.terminated | step.truncated, self.episode_return + step.reward, self.episode_length + 1
        ended = lambda x: jnp.where(done, x, 0).sum()  # noqa: E731
        sums = (self.finished + done.sum(), self.return_sum + ended(ret), self.length_sum + ended(length))
        return Episodes(step.state, step.obs, jnp.where(done, 0.0, ret), jnp.where(done, 0, length), *sums)

    def metrics(self) -> dict:
        """Mean return and length of the episodes counted: NaN when none ended."""
        mean = lambda total: jnp.where(self.finished > 0, total / jnp.maximum(self.finished, 1), jnp.nan)  # noqa: E731
        return dict(episode_return=mean(self.return_sum), episode_length=mean(self.length_sum), **{
            "episodes_finished": self.finished})  # fmt: skip


class Policy(NamedTuple):
    init: Callable  # init(num_envs) -> the policy's own carry (e.g. a recurrent state)
    act: Callable  # act(params, carry, obs, start, key) -> (carry, action); start: obs begins an episode


class Evaluating(NamedTuple):  # what evaluation carries from step to step
    env_state: Any
    obs: jax.Array
    policy: Any  # the policy's own carry
    total: jax.Array  # [episodes] return so far: each env's first episode is scored, and only it
    alive: jax.Array  # [episodes] bool: that episode has not ended yet
    rng: jax.Array
    t: jax.Array  # env steps taken


def make_evaluate(config: Config, env: VecEnv | None = None) -> Callable:
    """Returns `evaluate(params, rng) -> mean return` of `eval_episodes` greedy episodes, one per env
    of `env` (default: VecEnv(config.env_name, config.eval_episodes)), each scored until it ends."""
    validate(config)
    env = VecEnv(config.env_name, config.eval_episodes) if env is None else env
    policy = make_greedy_policy(config, env)

    def env_step(params, carry: Evaluating) -> Evaluating:
        rng, act_key, env_key = jax.random.split(carry.rng, 3)
        policy_carry, action = policy.act(
            params, carry.policy, carry.obs, jnp.full(env.num_envs, carry.t == 0), act_key
        )
        step, total = env.step(env_key, carry.env_state, action), carry.total
        total, alive = (
            total + jnp.where(carry.alive, step.reward, 0.0),
            carry.alive & ~(step.terminated | step.truncated),
        )
        return Evaluating(step.state, step.obs, policy_carry, total=total, alive=alive, rng=rng, t=carry.t + 1)

    def evaluate(params, rng: jax.Array) -> jax.Array:
        reset_key, rng = jax.random.split(rng)
        obs, env_state = env.reset(reset_key)
        alive, total = jnp.ones(env.num_envs, bool), jnp.zeros(env.num_envs)
        first = Evaluating(env_state, obs, policy.init(env.num_envs), total=total, alive=alive, rng=rng, t=0)
        running = lambda carry: carry.alive.any() & (carry.t < env.max_episode_steps)  # noqa: E731
        return jax.lax.while_loop(running, lambda carry: env_step(params, carry), first).total.mean()

    return evaluate


def configure_xla() -> None:
    """XLA's flags for this file alone, set before JAX's first computation unless XLA_FLAGS has them:
    the concurrency-optimised CPU scheduler off (it has deadlocked vmapped training, jaxlib 0.10), and
    on a CPU-only install backend optimisation level 1 (compiles faster, trains as fast)."""
    flags = {"xla_cpu_enable_concurrency_optimized_scheduler": "false"}
    accelerator = any(module.name.startswith(("jax_cuda", "jax_rocm", "libtpu")) for module in pkgutil.iter_modules())
    if os.environ.get("JAX_PLATFORMS", "").lower() == "cpu" or not accelerator:
        flags["xla_backend_optimization_level"] = "1"
    for name, value in flags.items():
        if name not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{name}={value}".strip()


def train_in_chunks(config: Config, train, keys: jax.Array):
    """All seeds in one vmapped program, called for a tenth of the updates at a time with progress
    printed between calls; the updates past the run's end (in the last chunk) change nothing."""
    num_updates, chunk = config.num_updates, -(-config.num_updates // 10)
    runner = jax.jit(lambda keys: jax.lax.map(train.init, keys))(keys)  # as the harness does on CPU
    shapes = jax.eval_shape(train.update, jax.eval_shape(train.init, keys[0]), 0)[1]
    skip = lambda runner, index: (runner, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))  # noqa: E731
    update = lambda runner, index: jax.lax.cond(index < num_updates, train.update, skip, runner, index)  # noqa: E731
    scan = lambda runner, first: jax.lax.scan(update, runner, first + jnp.arange(chunk))  # noqa: E731
    run, chunks, start = jax.jit(jax.vmap(scan, in_axes=(0, None)), donate_argnums=0), [], time.perf_counter()
    for first in range(0, num_updates, chunk):
        runner, metrics = run(runner, first)
        chunks.append(jax.device_get(metrics))
        done, returns = min(first + chunk, num_updates), chunks[-1]["episode_return"]
        speed = done * config.steps_per_update * len(keys) / (time.perf_counter() - start)
        mean = returns[np.isfinite(returns)].mean() if np.isfinite(returns).any() else np.nan
        print(
            f"update {done}/{num_updates}: return {mean:.1f}, {speed:,.0f} env steps/s (compile included)", flush=True
        )
    return runner, jax.tree.map(lambda *parts: np.concatenate(parts, axis=1)[:, :num_updates], *chunks)


def main(argv: list[str] | None = None) -> int:
    """This file alone: every Config field a flag, all seeds trained in one vmapped program, the greedy
    policies evaluated, and config.json, metrics.npz, params.msgpack and summary.json written as the
    run harness writes them. Exits 2 on bad input (nothing written), 3 when NaN or inf appeared."""
    name, fields = os.path.basename(__file__), dataclasses.fields(Config)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False, exit_on_error=False)
    for field in fields:
        kind, doc = typing.get_args(field.type)
        parse = {"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind}
        parser.add_argument(flag(field.name), default=field.default, help=doc, **parse)
    parser.add_argument("--runs-dir", default="runs", help="results go to a new directory under this one")
    try:
        args, unknown = parser.parse_known_args(argv)
        harness = "(the others, such as --sweep, --resume and --track, need the run harness beside it)"
        require(
            not unknown, f"{' '.join(unknown)}: not an option of {name} alone, whose options --help lists {harness}"
        )
        config = Config(**{field.name: getattr(args, field.name) for field in fields})
        train, evaluate = make_train(config), make_evaluate(config)
        os.makedirs(args.runs_dir, exist_ok=True)
        prefix = f"{name[:-3]}-{config.env_name.replace('/', '-')}-{time.strftime('%Y%m%d-%H%M%S')}-"
        run_dir = pathlib.Path(tempfile.mkdtemp(prefix=prefix, dir=args.runs_dir))
    except (argparse.ArgumentError, ConfigError, OSError) as error:
        print(f"{name}: error: {error}", file=sys.stderr)
        return 2
    print(f"{name} alone (no run harness beside it): {config.num_seeds} seeds on {config.env_name}", flush=True)
    (run_dir / "config.json").write_text(json.dumps({**dataclasses.asdict(config), "sweep": {}}, indent=2))
    start, keys = time.perf_counter(), jax.random.split(jax.random.PRNGKey(config.seed), config.num_seeds)
    runner, metrics = train_in_chunks(config, train, keys)
    seconds = time.perf_counter() - start  # compilation included
    eval_keys = jax.random.split(jax.random.PRNGKey(config.seed + 1), config.num_seeds)
    return write_results(
        run_dir, config, runner, metrics, jax.jit(jax.vmap(evaluate))(saved_params(runner), eval_keys), seconds
    )


def write_results(run_dir: pathlib.Path, config: Config, runner, metrics: dict, eval_return, seconds: float) -> int:
    """metrics.npz, params.msgpack and summary.json as the run harness writes them (one sweep point),
    and the results on stdout; returns the exit status: 3 when NaN or inf appeared."""
    point = lambda tree: jax.tree.map(lambda x: np.asarray(x)[None], tree)  # noqa: E731
    wall = seconds * np.arange(1, config.num_updates + 1) / config.num_updates
    np.savez_compressed(run_dir / "metrics.npz", **point(metrics), eval_return=point(eval_return), wall_seconds=wall)
    (run_dir / "params.msgpack").write_bytes(serialization.to_bytes(point(saved_params(runner))))
    last = -(-config.num_updates // 20)  # a run's final return: its episodes ending in the last 5% of updates
    returns, counts = metrics["episode_return"][:, -last:], metrics["episodes_finished"][:, -last:]
    with np.errstate(invalid="ignore", divide="ignore"):  # NaN: no episode ended in that window
        final = np.where(counts > 0, returns * counts, 0.0).sum(-1) / counts.sum(-1)
    summary = dict(algorithm=os.path.basename(__file__)[:-3], env_name=config.env_name, num_seeds=config.num_seeds)
    summary.update(trained_timesteps=config.num_updates * config.steps_per_update, train_seconds=seconds)
    summary.update(final_return_per_seed=[float(x) if np.isfinite(x) else None for x in final])
    summary.update(eval_return_mean=float(np.mean(eval_return)))
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
