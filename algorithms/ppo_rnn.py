"""Recurrent PPO (a GRU under the actor and critic heads, clipped surrogate, GAE) for partially
observable discrete-action gymnax environments, in one file: `python ppo_rnn.py` (CartPole-v1 without
velocities; --env-name MemoryChain-bsuite, say; --help lists every option). The whole run (rollout,
GAE, epochs of minibatch updates that replay whole env sequences through the GRU) is one jitted
function, and seeds (and sweep points: the float hyperparameters in HParams) are vmapped into one
program:

    train = make_train(Config(env_name="CartPole-v1-no-velocity"))
    runner, metrics = jax.jit(jax.vmap(train))(jax.random.split(jax.random.PRNGKey(0), 8))

Depends only on jax, flax, optax, chex, gymnax and numpy: copy it anywhere and it runs. Importing
it defines things and does nothing else. The algorithm comes first; the blocks that let the file
run alone (environment loop, evaluation, command line) are last, the same in every file.
"""

import argparse
import dataclasses
import functools
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

    env_name: Annotated[str, "a discrete-action gymnax env, or CartPole-v1-no-velocity"] = "CartPole-v1-no-velocity"
    total_timesteps: Annotated[int, "environment steps per run (all envs together)"] = 299_520
    num_envs: Annotated[int, "parallel environments per run"] = 16
    num_steps: Annotated[int, "steps per environment in each rollout"] = 32
    update_epochs: Annotated[int, "passes over each rollout batch"] = 4
    num_minibatches: Annotated[int, "minibatches per epoch, each whole env sequences; must divide num_envs"] = 4
    lr: Annotated[float, "Adam learning rate (start value when annealed)"] = 6e-3
    anneal_lr: Annotated[bool, "decay the learning rate linearly to 0 over all gradient steps"] = True
    gamma: Annotated[float, "discount factor"] = 0.99
    gae_lambda: Annotated[float, "GAE lambda (bias/variance trade-off of advantages)"] = 0.95
    clip_eps: Annotated[float, "PPO ratio clip range; also clips the value update"] = 0.2
    ent_coef: Annotated[float, "entropy bonus coefficient"] = 0.01
    vf_coef: Annotated[float, "value loss coefficient"] = 0.25
    max_grad_norm: Annotated[float, "global gradient-norm clip"] = 1.0
    activation: Annotated[str, "hidden activation: tanh or relu"] = "tanh"
    hidden_size: Annotated[int, "GRU state size and units per Dense layer (actor and critic alike)"] = 32
    num_layers: Annotated[int, "Dense layers between the GRU and each output (actor and critic alike)"] = 1
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
    gae_lambda: jax.Array
    clip_eps: jax.Array
    ent_coef: jax.Array
    vf_coef: jax.Array
    max_grad_norm: jax.Array


ACTIVATIONS = {"tanh": nn.tanh, "relu": nn.relu}


def validate(config: Config) -> None:
    """Refuses a config that cannot run, naming the option and what is allowed; registers PARTIAL_ENVS
    with gymnax (what make_train and make_evaluate call first, so that their VecEnv finds those names)."""
    integers = ("total_timesteps", "num_envs", "num_steps", "update_epochs", "num_minibatches", "hidden_size")
    require_positive(config, (*integers, "eval_episodes", "num_seeds"))
    layers = config.num_layers  # 0: linear outputs straight from the GRU state
    require(layers >= 0, f"--num-layers must be >= 0, got {layers}")
    validate_hparams({name: getattr(config, name) for name in HParams._fields})
    activation, envs, minibatches = config.activation, config.num_envs, config.num_minibatches
    require(activation in ACTIVATIONS, f"--activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    whole = "(each minibatch is whole env sequences)"
    require(envs % minibatches == 0, f"--num-minibatches {minibatches} must divide --num-envs {envs} {whole}")
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
# Partially observable environments
# --------------------------------------------------------------------------------------
def observation_subset(name: str, **kwargs):
    """The env PARTIAL_ENVS[name]: a gymnax env showing only some entries of its observation, whose
    dynamics, rewards, termination, time limit, params and name (gymnax draws it) are the env's own: its
    class, extended here (gymnax is imported only where an env is made). `kwargs` are gymnax.make's."""
    import gymnax
    from gymnax.environments import spaces

    base_name, keep = PARTIAL_ENVS[name]

    class ObservationSubset(type(gymnax.make(base_name)[0])):
        def step_env(self, key, state, action, params):
            obs, state, reward, terminated, info = super().step_env(key, state, action, params)
            return obs[..., keep], state, reward, terminated, info

        def reset_env(self, key, params):
            obs, state = super().reset_env(key, params)
            return obs[..., keep], state

        def observation_space(self, params):
            space = super().observation_space(params)
            low, high = (np.broadcast_to(np.asarray(end), space.shape)[..., keep] for end in (space.low, space.high))
            return spaces.Box(low, high, low.shape, space.dtype)

    return ObservationSubset(**kwargs)


# Partially observable versions of gymnax envs: name -> (gymnax env, observation entries kept). CartPole
# without velocities (cart position, pole angle) can only be balanced by an agent with memory.
PARTIAL_ENVS = {"CartPole-v1-no-velocity": ("CartPole-v1", [0, 2])}


def register_partial_envs() -> None:
    """Registers PARTIAL_ENVS with gymnax (those not registered yet), for make_env and VecEnv."""
    import gymnax

    for name in PARTIAL_ENVS:
        if name not in gymnax.registered_envs:
            gymnax.register(name, functools.partial(observation_subset, name))


# --------------------------------------------------------------------------------------
# Networks
# --------------------------------------------------------------------------------------
class ActorCritic(nn.Module):
    """obs -> GRU -> actor head (logits) and critic head (value), each `num_layers` Dense layers and an
    output. One GRU whose state both heads read, not one per head: the recurrence is what the update
    cannot batch over time. `__call__(hidden, obs) -> (hidden, logits, value)` is one step, as the
    policy acts; `unroll` is the same over stored sequences, as the update replays them."""

    num_actions: int
    hidden_size: int
    num_layers: int
    activation: str

    def setup(self):
        H, orthogonal = self.hidden_size, nn.initializers.orthogonal
        # The gates (reset r, update z, candidate n) as one [., 3H] matmul of the observation and
        # one of the state; the state's kernel is one orthogonal block per gate, as in flax's GRUCell.
        self.input_gates = nn.Dense(3 * H)
        blocks = lambda key, shape: jnp.concatenate([orthogonal()(k, (H, H)) for k in jax.random.split(key, 3)], -1)
        self.hidden_kernel = self.param("hidden_kernel", blocks, (H, 3 * H))
        self.hidden_bias = self.param("hidden_bias", nn.initializers.zeros, (3 * H,))
        dense = lambda: nn.Dense(H, kernel_init=orthogonal(np.sqrt(2)))
        self.actor_layers = [dense() for _ in range(self.num_layers)]
        self.critic_layers = [dense() for _ in range(self.num_layers)]
        self.actor_out = nn.Dense(self.num_actions, kernel_init=orthogonal(0.01))  # a near-uniform first policy
        self.critic_out = nn.Dense(1, kernel_init=orthogonal(1.0))

    def heads(self, hidden: jax.Array):
        """(logits, value) from GRU states [..., H]."""
        act = ACTIVATIONS[self.activation]
        x = y = hidden
        for actor_layer, critic_layer in zip(self.actor_layers, self.critic_layers, strict=True):
            x, y = act(actor_layer(x)), act(critic_layer(y))
        return self.actor_out(x), self.critic_out(y)[..., 0]

    def __call__(self, hidden: jax.Array, obs: jax.Array):
        hidden = gru_cell(self.hidden_kernel, self.hidden_bias, hidden, self.input_gates(obs))
        return (hidden, *self.heads(hidden))

    def unroll(self, hidden: jax.Array, obs: jax.Array, start: jax.Array):
        """(states after each step, logits, values) [T, n, ...] of sequences `obs` [T, n, obs_dim] from the
        state before their first step [n, H], reset where `start` [T, n]: only the recurrence runs step
        by step, the layers before and after it see all T steps in one batched call."""
        states = gru_unroll(self.hidden_kernel, self.hidden_bias, hidden, self.input_gates(obs), start)
        return (states, *self.heads(states))


def gru_cell(kernel, bias, hidden, gates):
    """The state after one GRU step (flax GRUCell's equations) from the state fed to it [..., H] and
    the observation's gates [..., 3H] (reset r, update z, candidate n)."""
    x_r, x_z, x_n = jnp.split(gates, 3, axis=-1)
    h_r, h_z, h_n = jnp.split(hidden @ kernel + bias, 3, axis=-1)
    r, z = nn.sigmoid(x_r + h_r), nn.sigmoid(x_z + h_z)
    n = jnp.tanh(x_n + r * h_n)
    return (1.0 - z) * n + z * hidden


def reset_hidden(hidden: jax.Array, start: jax.Array) -> jax.Array:
    """The GRU state fed to a step: the initial one (zeros) where `start` (its obs begins an episode)."""
    return jnp.where(start[..., None], 0.0, hidden)


def gru_unroll(kernel, bias, hidden, gates, start):
    """The GRU over T steps, a scan of `gru_cell` that jax.grad differentiates: the state after each
    step [T, n, H] from the state before the first [n, H] and the observations' gates [T, n, 3H], the
    state fed to step t reset where start[t] [T, n] as in the rollout (no gradient crosses a start)."""

    def step(hidden, inputs):
        gates_t, start_t = inputs
        hidden = gru_cell(kernel, bias, reset_hidden(hidden, start_t), gates_t)
        return hidden, hidden

    return jax.lax.scan(step, hidden, (gates, start))[1]


def make_networks(config: Config, num_actions: int) -> ActorCritic:
    return ActorCritic(num_actions, config.hidden_size, config.num_layers, config.activation)


# --------------------------------------------------------------------------------------
# The algorithm: GAE, the PPO loss, and the training loop
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
    next_value: jax.Array = None  # [T, N] V(final_obs), the GRU going on from its state after this step
    advantage: jax.Array = None  # [T, N] GAE's, filled in with the value targets before the update learns
    target: jax.Array = None  # [T, N]


class Runner(NamedTuple):
    """Everything one run carries from update to update."""

    params: Any
    opt_state: Any
    episodes: "Episodes"
    hidden: jax.Array  # [num_envs, hidden_size] GRU state after the last step (not reset)
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


def ppo_loss(network: ActorCritic, params, minibatch: Transition, hidden: jax.Array, hp: HParams, key: jax.Array):
    """The clipped surrogate, the clipped value loss and the entropy bonus of a minibatch of env sequences
    ([T, n, ...]) replayed through the GRU from the state `hidden` [n, H] before their first step. `key`
    is unused by PPO itself: it is there for a loss that samples (noise, dropout)."""
    _, logits, value = network.apply(params, hidden, minibatch.obs, minibatch.start, method=ActorCritic.unroll)
    log_probs = jax.nn.log_softmax(logits)
    log_prob = jnp.take_along_axis(log_probs, minibatch.action[..., None], -1)[..., 0]
    log_ratio = log_prob - minibatch.log_prob
    ratio = jnp.exp(log_ratio)
    advantage = minibatch.advantage
    advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
    policy_loss = -jnp.minimum(ratio * advantage, jnp.clip(ratio, 1 - hp.clip_eps, 1 + hp.clip_eps) * advantage).mean()
    value_clipped = minibatch.value + jnp.clip(value - minibatch.value, -hp.clip_eps, hp.clip_eps)
    value_losses = jnp.maximum(jnp.square(value - minibatch.target), jnp.square(value_clipped - minibatch.target))
    value_loss = 0.5 * value_losses.mean()
    entropy = -(jnp.exp(log_probs) * log_probs).sum(-1).mean()
    loss = policy_loss + hp.vf_coef * value_loss - hp.ent_coef * entropy
    stats = dict(loss=loss, policy_loss=policy_loss, value_loss=value_loss, entropy=entropy)
    stats.update(approx_kl=((ratio - 1) - log_ratio).mean(), clip_fraction=(jnp.abs(ratio - 1) > hp.clip_eps).mean())
    return loss, stats


def make_optimizer(config: Config, hparams: HParams):
    num_grad_steps = config.num_updates * config.update_epochs * config.num_minibatches
    lr = (lambda count: hparams.lr * (1.0 - count / num_grad_steps)) if config.anneal_lr else hparams.lr
    return optax.chain(optax.clip_by_global_norm(hparams.max_grad_norm), optax.adam(learning_rate=lr, eps=1e-5))


def make_train(config: Config, env: "VecEnv | None" = None) -> Callable:
    """Returns `train(rng, hparams=None) -> (runner, metrics)` running the whole config, where
    `metrics` maps names to arrays of shape [num_updates]: `train.init(rng, hparams)`, then
    `train.update(runner, update_index)` num_updates times in a `lax.scan`, in `env` (default:
    `VecEnv(config.env_name, config.num_envs)`); `train.rollout(params, episodes, hidden, key)` is its acting."""
    validate(config)
    env = VecEnv(config.env_name, config.num_envs) if env is None else env
    network = make_networks(config, env.num_actions)
    T, N, M = config.num_steps, config.num_envs, config.num_minibatches

    def init(rng: jax.Array, hparams: HParams | None = None) -> Runner:
        hparams = hparams_from(config) if hparams is None else hparams
        rng, params_key, env_key = jax.random.split(rng, 3)
        params = network.init(params_key, jnp.zeros((1, config.hidden_size)), jnp.zeros((1, env.obs_dim)))
        opt_state = make_optimizer(config, hparams).init(params)
        episodes, hidden = Episodes.start(*env.reset(env_key)), jnp.zeros((N, config.hidden_size))
        return Runner(params=params, opt_state=opt_state, episodes=episodes, hidden=hidden, rng=rng, hparams=hparams)

    def rollout(params, episodes: "Episodes", hidden: jax.Array, key: jax.Array):
        """T steps of every env under the current policy, its GRU state reset where an episode starts:
        (the episodes after them, the state after the last step, [T, N] transitions)."""

        def env_step(carry, key: jax.Array):
            (episodes, hidden), (action_key, env_key) = carry, jax.random.split(key)
            start = episodes.episode_length == 0  # obs begins an episode: the GRU state fed to it is reset
            hidden, logits, value = network.apply(params, reset_hidden(hidden, start), episodes.obs)
            action, log_prob = sample_action(logits, action_key)
            step = env.step(env_key, episodes.env_state, action)
            transition = Transition(
                episodes.obs, start, action, log_prob, value, step.reward, step.terminated,
                done=step.terminated | step.truncated, final_obs=step.final_obs,
            )  # fmt: skip
            return (episodes.after(step), hidden), (transition, hidden)

        first = (episodes.counting(), hidden)
        (episodes, hidden), (transitions, states) = jax.lax.scan(env_step, first, jax.random.split(key, T))
        # V(final_obs) from the GRU state after each step, batched: a truncated episode bootstraps from its
        # true next observation and the state of the episode it cut off (never a reset one).
        next_value = network.apply(params, states, transitions.final_obs)[2]
        return episodes, hidden, transitions._replace(next_value=next_value)

    def learn(params, opt_state, batch: Transition, hidden: jax.Array, key: jax.Array, hp: HParams):
        """`update_epochs` passes of shuffled minibatch steps, each minibatch whole env sequences
        replayed from the GRU state `hidden` [N, H] the rollout started from."""
        optimizer = make_optimizer(config, hp)

        def minibatch_step(train, inputs):
            (params, opt_state), (minibatch, hidden, key) = train, inputs
            grads, stats = jax.grad(ppo_loss, argnums=1, has_aux=True)(network, params, minibatch, hidden, hp, key)
            updates, opt_state = optimizer.update(grads, opt_state)
            return (optax.apply_updates(params, updates), opt_state), {**stats, "grad_norm": optax.tree.norm(grads)}

        def epoch(train, key):
            order_key, loss_key = jax.random.split(key)
            envs = jax.random.permutation(order_key, N).reshape(M, N // M)  # split the envs, never the time axis
            minibatches = jax.tree.map(lambda x: jnp.swapaxes(x[:, envs], 0, 1), batch)
            return jax.lax.scan(minibatch_step, train, (minibatches, hidden[envs], jax.random.split(loss_key, M)))

        return jax.lax.scan(epoch, (params, opt_state), jax.random.split(key, config.update_epochs))

    def update(runner: Runner, update_index: jax.Array):
        hp = runner.hparams
        rng, rollout_key, learn_key = jax.random.split(runner.rng, 3)
        episodes, hidden, tr = rollout(runner.params, runner.episodes, runner.hidden, rollout_key)
        advantage, target = compute_gae(
            tr.reward, tr.value, tr.next_value, tr.terminated.astype(jnp.float32), tr.done, hp.gamma, hp.gae_lambda
        )
        batch = tr._replace(advantage=advantage, target=target)
        # Its sequences replay from the GRU state the rollout started from.
        (params, opt_state), stats = learn(runner.params, runner.opt_state, batch, runner.hidden, learn_key, hp)
        metrics = {
            "env_steps": (update_index + 1) * T * N,
            **episodes.metrics(),
            **{name: value.mean() for name, value in stats.items()},
            "finite": jnp.isfinite(stats["loss"]).all() & jnp.isfinite(optax.tree.norm(params)),
        }
        runner = Runner(params=params, opt_state=opt_state, episodes=episodes, hidden=hidden, rng=rng, hparams=hp)
        return runner, metrics

    def train(rng: jax.Array, hparams: HParams | None = None):
        return jax.lax.scan(update, init(rng, hparams), jnp.arange(config.num_updates, dtype=jnp.int32))

    train.init, train.update, train.rollout = init, update, rollout
    return train


# --------------------------------------------------------------------------------------
# The policy's action
# --------------------------------------------------------------------------------------
def sample_action(logits: jax.Array, key: jax.Array):
    """An action drawn from softmax(logits) for each env, and its log-probability."""
    action = jax.random.categorical(key, logits)
    return action, jnp.take_along_axis(jax.nn.log_softmax(logits), action[..., None], -1)[..., 0]


def make_greedy_policy(config: Config, env: "VecEnv") -> "Policy":
    """The most probable action; the carry is the GRU state, reset where an episode begins."""
    network = make_networks(config, env.num_actions)

    def act(params, carry, obs: jax.Array, start: jax.Array, key: jax.Array):  # carry: the GRU state
        hidden, logits, _ = network.apply(params, reset_hidden(carry, start), obs)
        return hidden, jnp.argmax(logits, -1)

    return Policy(init=lambda num_envs: jnp.zeros((num_envs, config.hidden_size)), act=act)


def saved_params(runner: Runner) -> dict:
    """What params.msgpack holds and `make_evaluate` takes: the network's parameters."""
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
