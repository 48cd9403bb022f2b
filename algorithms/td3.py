"""TD3 (twin critics, target policy smoothing, delayed policy updates) for continuous-action gymnax envs, in one
file: `python td3.py --env-name MountainCarContinuous-v0 --total-timesteps 50000` (--help lists every option;
--num-critics 1 --policy-delay 1 --policy-noise 0 is DDPG). The whole run (acting, replay-buffer writes, critic
steps, delayed actor steps and Polyak target updates at their env-step intervals) is one jitted function; seeds,
and sweep points of the float hyperparameters in HParams, are vmapped into one program, each run with its own
replay buffer:

    train = make_train(Config(env_name="Pendulum-v1"))
    runner, metrics = jax.jit(jax.vmap(train))(jax.random.split(jax.random.PRNGKey(0), 8))

The actor is deterministic: tanh of an MLP, in [-1, 1] (as the buffer stores actions and the critics see them),
rescaled onto the env's action bounds. Exploration adds Gaussian noise; the critics' targets use the target
actor's action plus clipped Gaussian noise; the actor and both targets step once every --policy-delay critic
steps. Noise scales are relative to the action range's half width.

Needs jax, flax, optax, chex, gymnax and numpy only; importing it defines things and does nothing else.
"""

import argparse
import ast
import dataclasses
import difflib
import inspect
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

HARNESS_PROTOCOL = 4  # the run harness's interface this file follows (algorithms/onefile_harness/protocol.py)
ACTIONS = "continuous"  # the action spaces this algorithm takes (bounded: the actor squashes into them)


# Defaults for Pendulum-v1, as sac.py's: an update (20 envs x 200 steps) is one episode of every env; tau 0.02
# (the TD3 paper's 0.005) lets the targets follow within this short budget (docs/defaults.md).
@dataclasses.dataclass(frozen=True)
class Config:
    """Each field is a flag (`lr` is --lr), annotated with its help, then the rules its value satisfies."""

    env_name: Annotated[str, "a gymnax env with bounded continuous actions (gymnax.registered_envs)"] = "Pendulum-v1"
    total_timesteps: Annotated[int, "env steps per run (all envs together)", "total_timesteps < 2**31"] = 20_000
    num_envs: Annotated[int, "parallel environments per run", "0 < num_envs < 2**31"] = 20
    num_steps: Annotated[int, "steps per environment in each update (one metrics row)", "0 < num_steps < 2**31"] = 200
    buffer_size: Annotated[int, "replay buffer capacity in transitions (>= num_envs)", "buffer_size < 2**31"] = 100_000
    batch_size: Annotated[int, "transitions per gradient step, drawn uniformly from the buffer", "batch_size > 0"] = 128
    learning_starts: Annotated[int, "random-action env steps before learning", "0 <= learning_starts < 2**31"] = 1_000
    train_frequency: Annotated[int, "env steps (all envs) per critic-step round", "0 < train_frequency < 2**31"] = 2
    gradient_steps: Annotated[int, "critic steps per round of train_frequency env steps", "gradient_steps > 0"] = 1
    policy_delay: Annotated[int, "critic steps per actor step and target update (1 with DDPG)", "policy_delay > 0"] = 2
    lr: Annotated[float, "Adam learning rate of actor and critics", "0 < lr < inf"] = 1e-3
    gamma: Annotated[float, "discount factor", "0 <= gamma <= 1"] = 0.99
    tau: Annotated[float, "targets <- tau * online + (1 - tau) * targets, at every actor step", "0 < tau <= 1"] = 0.02
    exploration_noise: Annotated[float, "acting noise std, times the half range", "0 <= exploration_noise < inf"] = 0.1
    policy_noise: Annotated[float, "target smoothing noise std, times the half range", "0 <= policy_noise < inf"] = 0.2
    noise_clip: Annotated[float, "smoothing noise clip: +-this times the half range", "0 <= noise_clip < inf"] = 0.5
    num_critics: Annotated[int, "Q-networks; the targets use their minimum (2: twin, 1: DDPG)", "num_critics > 0"] = 2
    activation: Annotated[str, "hidden activation", "activation in ('relu', 'tanh', 'swish')"] = "relu"
    hidden_size: Annotated[int, "units per hidden layer (actor and critics alike)", "0 < hidden_size < 2**31"] = 64
    num_layers: Annotated[int, "hidden layers of the actor and of each critic", "0 < num_layers < 2**31"] = 2
    eval_episodes: Annotated[int, "greedy evaluation episodes per run after training", "eval_episodes > 0"] = 100
    seed: Annotated[int, "base seed; run i uses jax.random.split(PRNGKey(seed), num_seeds)[i]"] = 0
    num_seeds: Annotated[int, "independent runs trained side by side (vmapped)", "0 < num_seeds < 2**31"] = 8

    @property
    def steps_per_update(self) -> int:  # env steps of one update, all envs together (one metrics row)
        return self.num_envs * self.num_steps

    @property
    def num_updates(self) -> int:
        return self.total_timesteps // self.steps_per_update


class HParams(NamedTuple):  # the float hyperparameters in which runs of one compiled program may differ (--sweep)
    lr: jax.Array
    gamma: jax.Array
    tau: jax.Array
    exploration_noise: jax.Array
    policy_noise: jax.Array
    noise_clip: jax.Array


hparams_from = lambda config: HParams(**{f: jnp.float32(getattr(config, f)) for f in HParams._fields})  # noqa: E731


def validate(config: Config) -> None:
    """Refuses a config that cannot run, naming the option and what is allowed (each field's rules, then these)."""
    validate_hparams(dataclasses.asdict(config))
    buffer, envs, total, update = config.buffer_size, config.num_envs, config.total_timesteps, config.steps_per_update
    require(buffer >= envs, f"--buffer-size {buffer} must be at least num_envs = {envs} (one env step's transitions)")
    require(total >= update, f"--total-timesteps {total} is less than one update (num_envs * num_steps = {update})")
    steps = total_gradient_steps(config)  # the critic-step counter that schedules actor steps is int32
    require(steps < 2**31, f"--gradient-steps {config.gradient_steps}: {steps} critic steps, more than 2**31")


# ---- Networks ----
class Torso(nn.Module):  # what a network reads first: replace it to read observations another way
    obs_shape: tuple  # one observation's shape, as the env gives it

    @nn.compact
    def __call__(self, obs: jax.Array) -> jax.Array:
        """Observations [..., *obs_shape] as float32 vectors [..., features]."""
        return obs.reshape(*obs.shape[: obs.ndim - len(self.obs_shape)], -1).astype(jnp.float32)


class MLP(nn.Module):  # the actor and every critic: `num_layers` hidden layers, then a linear output
    out_dim: int
    obs_shape: tuple
    hidden_size: int
    num_layers: int
    activation: str

    @nn.compact
    def __call__(self, obs: jax.Array, action: jax.Array | None = None) -> jax.Array:
        x = Torso(self.obs_shape)(obs)  # a critic reads the action too, after the observation's features
        x = x if action is None else jnp.concatenate([x, action], axis=-1)
        for _ in range(self.num_layers):
            x = getattr(nn, self.activation)(nn.Dense(self.hidden_size)(x))  # nn.relu, nn.tanh or nn.swish
        return nn.Dense(self.out_dim)(x)


class Networks(NamedTuple):
    actor: nn.Module  # obs -> the actor's outputs (actor_action); its parameters are params["actor"]
    critic: nn.Module  # (obs, action) -> Q; params["critic"] stacks num_critics of them on a leading axis


def make_networks(config: Config, action_dim: int, obs_shape: tuple) -> Networks:
    shape = dict(hidden_size=config.hidden_size, num_layers=config.num_layers, activation=config.activation)
    shape |= dict(obs_shape=obs_shape)
    return Networks(actor=MLP(action_dim, **shape), critic=MLP(1, **shape))


# ---- The critics, the action scale and the replay buffer (the same in sac.py, td3.py: tests/test_files.py) ----
def critic_values(networks: Networks, critics, obs: jax.Array, action: jax.Array) -> jax.Array:
    """Every critic's Q(obs, action in [-1, 1]): [num_critics, batch]. The critics are one network
    vmapped over their stacked parameters: all of them run as one batched matmul per layer."""
    return jax.vmap(lambda params: networks.critic.apply(params, obs, action)[..., 0])(critics)


class ActionScale(NamedTuple):  # the affine map from the tanh's range [-1, 1] onto the env's action bounds
    centre: jax.Array  # [action_dim]
    half_range: jax.Array  # [action_dim]

    def __call__(self, squashed: jax.Array) -> jax.Array:
        return self.centre + self.half_range * squashed


def action_scale(env: "VecEnv") -> ActionScale:
    low, high = jnp.asarray(env.action_low), jnp.asarray(env.action_high)
    return ActionScale(centre=(high + low) / 2, half_range=(high - low) / 2)


class Transition(NamedTuple):
    obs: jax.Array  # [..., *obs_shape] in the env's dtype
    action: jax.Array  # [..., action_dim] in [-1, 1]: the action before the rescale to the env's bounds
    reward: jax.Array  # [...] float32
    terminated: jax.Array  # [...] bool: a terminal state; a time-limit truncation is not one
    final_obs: jax.Array  # [..., *obs_shape] the true next observation (before auto-reset)


class ReplayBuffer(NamedTuple):  # a circular store of one run's transitions (one per seed): slots [0, size) filled
    data: Transition  # every field [capacity, ...]
    position: jax.Array  # int32: where the next transition goes
    size: jax.Array  # int32, at most capacity


def buffer_init(capacity: int, obs_shape: tuple, obs_dtype, action_dim: int) -> ReplayBuffer:
    zeros = lambda *shape, dtype=jnp.float32: jnp.zeros((capacity, *shape), dtype)  # noqa: E731
    obs = zeros(*obs_shape, dtype=obs_dtype)
    fields = dict(obs=obs, action=zeros(action_dim), reward=zeros(), terminated=zeros(dtype=bool))
    return ReplayBuffer(data=Transition(**fields, final_obs=obs), position=jnp.int32(0), size=jnp.int32(0))


def buffer_add(buffer: ReplayBuffer, batch: Transition) -> ReplayBuffer:
    """Writes a batch of n <= capacity transitions at `position`, wrapping around the end."""
    capacity, n = buffer.data.reward.shape[0], batch.reward.shape[0]
    slots = (buffer.position + jnp.arange(n, dtype=jnp.int32)) % capacity
    data = jax.tree.map(lambda store, x: store.at[slots].set(x.astype(store.dtype)), buffer.data, batch)
    size = jnp.minimum(buffer.size + n, capacity)
    return ReplayBuffer(data=data, position=(buffer.position + n) % capacity, size=size)


def buffer_sample(buffer: ReplayBuffer, key: jax.Array, batch_size: int) -> Transition:
    """`batch_size` transitions drawn uniformly, with replacement, from the filled slots."""
    slots = jax.random.randint(key, (batch_size,), 0, buffer.size)
    return jax.tree.map(lambda store: store[slots], buffer.data)


# ---- The algorithm: the smoothed TD target, TD3's losses, and the training loop ----
class Runner(NamedTuple):  # everything one run carries from update to update
    params: Any  # {"actor", "critic" (num_critics stacked)}
    target_params: Any  # the same tree: target actor and target critics
    opt_state: Any  # {"actor", "critic"}: an Adam state each (the actor steps only every policy_delay)
    buffer: ReplayBuffer
    episodes: "Episodes"
    rng: jax.Array
    hparams: HParams


# What the steps log; summed over an update's steps and divided by their count, its metrics. loss (the
# critics' TD loss), q_mean and grad_norm (the critics') per critic step; actor_loss per actor step.
LOGGED = ("loss", "q_mean", "grad_norm", "actor_loss")


def interval_crossings(before, steps: int, interval: int, learning_starts: int):
    """How many multiples of `interval` lie in (max(before, learning_starts), before + steps]: the
    training rounds that a vectorized step from `before` to `before + steps` env steps owes. Summed
    over a run, exactly max(0, total // interval - learning_starts // interval), whatever num_envs is."""
    return jnp.maximum(0, (before + steps) // interval - jnp.maximum(before, learning_starts) // interval)


def total_gradient_steps(config: Config) -> int:
    """Critic steps of the whole run; the actor takes total_gradient_steps // policy_delay."""
    trained = config.num_updates * config.steps_per_update
    rounds = max(0, trained // config.train_frequency - config.learning_starts // config.train_frequency)
    return rounds * config.gradient_steps


def smoothed_target_action(target_action: jax.Array, noise: jax.Array, hparams: HParams) -> jax.Array:
    """Target policy smoothing: the target actor's action plus N(0, policy_noise) noise clipped to
    +-noise_clip, then clipped to [-1, 1]. In [-1, 1] units these are fractions of the half range."""
    chex.assert_equal_shape([target_action, noise])
    clipped = jnp.clip(hparams.policy_noise * noise, -hparams.noise_clip, hparams.noise_clip)
    return jnp.clip(target_action + clipped, -1.0, 1.0)


def td_target(reward, terminated, next_q, gamma):
    """y = r + gamma * (1 - terminated) * min over critics of Q_target(s', a'). s' is the true next
    observation, so a time-limit truncation bootstraps from the state it cut off; only
    `terminated` zeroes the bootstrap. next_q: [num_critics, batch]."""
    chex.assert_equal_shape([reward, terminated, next_q[0]])
    return reward + gamma * (1.0 - terminated) * next_q.min(0)


def critic_loss(config: Config, networks: Networks, critic, target_params, batch: Transition, hp: HParams, key):
    """0.5 * the MSE to the TD target per critic, summed over critics (each regresses on the same
    target), a' the target actor's smoothed action. `key` draws the smoothing noise."""
    target_action = actor_action(networks, target_params["actor"], batch.final_obs)
    next_action = smoothed_target_action(target_action, jax.random.normal(key, target_action.shape), hp)
    next_q = critic_values(networks, target_params["critic"], batch.final_obs, next_action)
    target = td_target(batch.reward, batch.terminated, next_q, hp.gamma)  # a constant: only `critic` is trained
    q = critic_values(networks, critic, batch.obs, batch.action)
    return 0.5 * jnp.square(q - target).mean(-1).sum(), {"q": q, "target": target}


def actor_loss(config: Config, networks: Networks, actor, critic, obs: jax.Array, hp: HParams, key: jax.Array):
    """-Q_1(s, actor(s)): the first critic only, as in the TD3 paper. `key` is unused by the deterministic
    actor: it is there for a loss that samples."""
    first = jax.tree.map(lambda x: x[:1], critic)  # stacked, as critic_values takes critics
    return -critic_values(networks, first, obs, actor_action(networks, actor, obs))[0].mean()


def make_optimizer(config: Config, hparams: HParams):
    return optax.adam(learning_rate=hparams.lr)


def critic_step(config: Config, networks: Networks, runner: Runner, sums: dict, batch: Transition, key: jax.Array):
    """One Adam step of the critics on `batch`; `sums` plus this step's loss, q_mean and grad_norm."""
    params, hp = runner.params, runner.hparams
    loss_and_grad = jax.value_and_grad(critic_loss, argnums=2, has_aux=True)
    (loss, aux), grads = loss_and_grad(config, networks, params["critic"], runner.target_params, batch, hp, key)
    updates, opt_state = make_optimizer(config, hp).update(grads, runner.opt_state["critic"])
    params = {**params, "critic": optax.apply_updates(params["critic"], updates)}
    runner = runner._replace(params=params, opt_state={**runner.opt_state, "critic": opt_state})
    step = dict(loss=loss, q_mean=aux["q"].mean(), grad_norm=optax.tree.norm(grads))
    return runner, {**sums, **{name: sums[name] + value for name, value in step.items()}}


def actor_step(config: Config, networks: Networks, runner: Runner, sums: dict, obs: jax.Array, key: jax.Array):
    """One Adam step of the actor against the (just updated) first critic, then one Polyak step of
    both target networks: targets <- tau * online + (1 - tau) * targets."""
    params, hp = runner.params, runner.hparams
    loss_and_grad = jax.value_and_grad(actor_loss, argnums=2)
    loss, grads = loss_and_grad(config, networks, params["actor"], params["critic"], obs, hp, key)
    updates, opt_state = make_optimizer(config, hp).update(grads, runner.opt_state["actor"])
    params = {**params, "actor": optax.apply_updates(params["actor"], updates)}
    targets = optax.incremental_update(params, runner.target_params, hp.tau)
    runner = runner._replace(params=params, target_params=targets, opt_state={**runner.opt_state, "actor": opt_state})
    return runner, {**sums, "actor_loss": sums["actor_loss"] + loss}


def make_train(config: Config, env: "VecEnv | None" = None) -> Callable:
    """`train(rng, hparams=None) -> (runner, metrics of shape [num_updates])`: `train.init(rng, hparams)`, then
    `train.update(runner, update_index)` in a `lax.scan`, in `env` (default: VecEnv(env_name, num_envs))."""
    validate(config)
    env = VecEnv(config.env_name, config.num_envs) if env is None else env
    low, high = env.action_low, env.action_high  # the squashed actions need finite bounds
    require(np.isfinite([low, high]).all(), f"--env-name {config.env_name} has unbounded actions ({low} to {high})")
    networks, scale = make_networks(config, env.action_dim, env.obs_shape), action_scale(env)
    T, N, A = config.num_steps, config.num_envs, env.action_dim

    @jax.custom_batching.sequential_vmap  # seeds in turn: vmapped, orthogonal init's QRs can deadlock XLA's CPU pool
    def init(rng: jax.Array, hparams: HParams | None = None) -> Runner:
        hparams = hparams_from(config) if hparams is None else hparams
        rng, actor_key, critic_key, env_key = jax.random.split(rng, 4)
        obs = jnp.zeros((1, *env.obs_shape), env.obs_dtype)
        critic_keys = jax.random.split(critic_key, config.num_critics)
        critics = jax.vmap(networks.critic.init, in_axes=(0, None, None))(critic_keys, obs, jnp.zeros((1, A)))
        params = {"actor": networks.actor.init(actor_key, obs), "critic": critics}
        return Runner(
            params=params,
            target_params=params,
            opt_state={name: make_optimizer(config, hparams).init(params[name]) for name in ("actor", "critic")},
            buffer=buffer_init(config.buffer_size, env.obs_shape, env.obs_dtype, A),
            episodes=Episodes.start(*env.reset(env_key)),
            rng=rng,
            hparams=hparams,
        )

    def learn(runner: Runner, sums: dict, before: jax.Array, key: jax.Array):
        """The critic steps due in a vectorized step from `before` env steps (`gradient_steps` per multiple of
        train_frequency crossed: any num_envs keeps the schedule), each policy_delay-th of the run followed by
        an actor step and the target updates. Returns (runner, sums, (critic steps, actor steps) taken)."""
        every, starts, per_round = config.train_frequency, config.learning_starts, config.gradient_steps
        done = per_round * interval_crossings(0, before, every, starts)  # critic steps of the run so far
        num_grad = per_round * interval_crossings(before, N, every, starts)

        def step(i, carry):
            runner, sums = carry
            batch_key, critic_key, actor_key = jax.random.split(jax.random.fold_in(key, i), 3)
            batch = buffer_sample(runner.buffer, batch_key, config.batch_size)
            runner, sums = critic_step(config, networks, runner, sums, batch, critic_key)
            # done + i is the same in every seed (not batched under vmap): the cond stays a branch.
            due = (done + i + 1) % config.policy_delay == 0
            actor = lambda carry: actor_step(config, networks, *carry, batch.obs, actor_key)  # noqa: E731
            return jax.lax.cond(due, actor, lambda carry: carry, (runner, sums))

        runner, sums = jax.lax.fori_loop(0, num_grad, step, (runner, sums))
        return runner, sums, (num_grad, (done + num_grad) // config.policy_delay - done // config.policy_delay)

    def env_step(carry, inputs):
        """One vectorized env step after `before` env steps of the run: act, store, learn what is due."""
        (runner, sums), (before, key) = carry, inputs
        obs, (random_key, action_key, env_key, learn_key) = runner.episodes.obs, jax.random.split(key, 4)
        # Env n's transition is env step before + n + 1 of the run: uniformly random actions
        # until learning_starts, then the actor's with Gaussian noise.
        warmup = before + jnp.arange(N) < config.learning_starts
        random_action = jax.random.uniform(random_key, (N, A), minval=-1.0, maxval=1.0)
        policy_action = noisy_action(networks, runner.params["actor"], obs, action_key, runner.hparams)
        action = jnp.where(warmup[:, None], random_action, policy_action)
        step = env.step(env_key, runner.episodes.env_state, scale(action))
        transitions = dict(obs=obs, action=action, reward=step.reward, terminated=step.terminated)
        buffer = buffer_add(runner.buffer, Transition(**transitions, final_obs=step.final_obs))
        runner = runner._replace(buffer=buffer, episodes=runner.episodes.after(step))
        runner, sums, steps = learn(runner, sums, before, learn_key)
        return (runner, sums), steps

    def update(runner: Runner, update_index: jax.Array):
        rng, steps_key = jax.random.split(runner.rng)
        start = (runner._replace(episodes=runner.episodes.counting(), rng=rng), dict.fromkeys(LOGGED, jnp.float32(0)))
        befores = (update_index * T + jnp.arange(T)) * N  # env steps of the run before each vectorized step
        (runner, sums), steps = jax.lax.scan(env_step, start, (befores, jax.random.split(steps_key, T)))
        num_grad, num_actor = steps[0].sum(), steps[1].sum()  # the metrics are NaN where no step was taken
        mean = lambda total, n: jnp.where(n > 0, total / jnp.maximum(n, 1), jnp.nan)  # noqa: E731
        counts = dict(loss=num_grad, q_mean=num_grad, grad_norm=num_grad, actor_loss=num_actor)
        metrics = {
            "env_steps": (update_index + 1) * T * N,
            **runner.episodes.metrics(),
            **{name: mean(total, counts[name]) for name, total in sums.items()},
            "gradient_steps": num_grad,
            "actor_steps": num_actor,
            "finite": jnp.isfinite(jnp.stack(list(sums.values()))).all()
            & jnp.isfinite(optax.tree.norm((runner.params, runner.target_params))),
        }
        return runner, metrics

    def train(rng: jax.Array, hparams: HParams | None = None):
        return jax.lax.scan(update, init(rng, hparams), jnp.arange(config.num_updates, dtype=jnp.int32))

    train.init, train.update = init, update
    return train


# ---- The policy's action ----
def actor_action(networks: Networks, actor, obs: jax.Array) -> jax.Array:
    """The deterministic actor's action in [-1, 1] (tanh of its network's output); `actor` its parameters."""
    return jnp.tanh(networks.actor.apply(actor, obs))


def noisy_action(networks: Networks, actor, obs: jax.Array, key: jax.Array, hp: HParams) -> jax.Array:
    """The actor's action plus N(0, exploration_noise) noise (a fraction of the half range), clipped to [-1, 1]."""
    action = actor_action(networks, actor, obs)
    return jnp.clip(action + hp.exploration_noise * jax.random.normal(key, action.shape), -1.0, 1.0)


def make_act(config: Config, greedy: bool = True, env: "VecEnv | None" = None) -> Callable:
    """`act(params, obs, key) -> action` for one observation in the env's own shape (vmap it for a batch): the
    actor's action rescaled onto the bounds, or (greedy=False) with the exploration noise training acts with."""
    env = env or VecEnv(config.env_name, 1)
    networks, scale = make_networks(config, env.action_dim, env.obs_shape), action_scale(env)
    hparams = hparams_from(config)

    def act(params, obs: jax.Array, key: jax.Array) -> jax.Array:
        greedy_action = actor_action(networks, params["actor"], obs)
        return scale(greedy_action if greedy else noisy_action(networks, params["actor"], obs, key, hparams))

    return act


def saved_params(runner: Runner) -> dict:
    return runner.params  # what params.msgpack holds and `make_evaluate` takes: actor and critics


# --------------------------------------------------------------------------------------
# Running this file (the same in every single-agent file: tests/test_files.py): checks, env loop, eval, command line
# --------------------------------------------------------------------------------------
class ConfigError(ValueError):
    """A config value that cannot work, naming the option and what is allowed; raised before anything compiles."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate_hparams(values: dict) -> None:
    """Each value satisfies its Config field's rules (Python expressions; NaN fails them), as must each sweep point;
    and Config names no field twice (the second line would silently replace the first)."""
    try:  # without source (a class typed into a notebook cell) there is nothing to compare
        names = [n.target.id for n in ast.parse(inspect.getsource(Config)).body[0].body if hasattr(n, "target")]
    except (OSError, TypeError):
        names = []
    require(len(set(names)) == len(names), f"Config names {max(names or [''], key=names.count)} twice: rename one")
    rules = {field.name: typing.get_args(field.type)[2:] for field in dataclasses.fields(Config)}
    for name, value in values.items():
        for rule in rules[name]:
            ok = eval(rule, {name: value, "inf": np.inf})
            require(ok, f"--{name.replace('_', '-')} must satisfy {rule}, got {value!r}")


class EnvStep(NamedTuple):
    obs: jax.Array  # [num_envs, *obs_shape] after auto-reset, in the env's own shape and dtype
    state: Any
    reward: jax.Array  # [num_envs] float32
    terminated: jax.Array  # [num_envs] bool: the episode reached a terminal state
    truncated: jax.Array  # [num_envs] bool: the episode hit its time limit
    final_obs: jax.Array  # [num_envs, *obs_shape] the true next observation, before auto-reset


class VecEnv:
    """`num_envs` copies of a gymnax env under `jax.vmap` of its own `step` (auto-reset, final observation)."""

    def __init__(self, env_name: str, num_envs: int):
        import gymnax  # here: importing it computes with JAX, which must wait for configure_xla's flags

        require(env_name in gymnax.registered_envs, f"--env-name {env_name!r} is not in gymnax.registered_envs")
        try:  # a download without a network, a missing package, a factory that raises: refused in one line
            self.env, self.params = gymnax.make(env_name)
        except Exception as error:
            reason = f"{type(error).__name__}: {' '.join(str(error).split())}"
            raise ConfigError(f"--env-name {env_name} cannot be built: {reason}") from None
        self.num_envs, self.max_episode_steps = num_envs, self.params.max_steps_in_episode
        obs = jax.eval_shape(self.env.reset, jax.random.PRNGKey(0), self.params)[0]  # one observation, unbatched
        self.obs_shape, self.obs_dtype = obs.shape, obs.dtype  # as the env gives it: networks flatten what they read
        space = self.env.action_space(self.params)
        kind = "discrete" if hasattr(space, "n") else "continuous"
        require(kind == ACTIONS, f"--env-name {env_name} has {kind} actions; this file takes {ACTIONS} actions")
        self.num_actions, self.action_shape = getattr(space, "n", 0), space.shape
        bounds = (np.float32(np.broadcast_to(getattr(space, end, 0), space.shape)).flatten() for end in ("low", "high"))
        self.action_dim, (self.action_low, self.action_high) = int(np.prod(space.shape)), bounds  # continuous actions

    def reset(self, key: jax.Array):
        return jax.vmap(self.env.reset, in_axes=(0, None))(jax.random.split(key, self.num_envs), self.params)

    def step(self, key: jax.Array, state: Any, action: jax.Array) -> EnvStep:
        keys, action = jax.random.split(key, self.num_envs), action.reshape(self.num_envs, *self.action_shape)
        step = jax.vmap(self.env.step, in_axes=(0, 0, 0, None))(keys, state, action, self.params)
        obs, state, reward, terminated, truncated, info = step
        return EnvStep(obs, state, reward.astype(jnp.float32), terminated, truncated, info["final_observation"])


class Episodes(NamedTuple):  # every env's current episode, and those ended since `counting()` (an update's start)
    env_state: Any
    obs: jax.Array  # [num_envs, *obs_shape]
    episode_return: jax.Array  # [num_envs] return so far
    episode_length: jax.Array  # [num_envs] int32 steps so far
    ended: jax.Array = None  # [3] since counting began: episodes ended, their returns summed, their lengths summed

    @classmethod
    def start(cls, obs: jax.Array, env_state: Any) -> "Episodes":
        return cls(env_state, obs, jnp.zeros(obs.shape[0]), jnp.zeros(obs.shape[0], jnp.int32)).counting()

    def counting(self) -> "Episodes":
        return self._replace(ended=jnp.zeros(3))

    def after(self, step: EnvStep) -> "Episodes":  # those that ended in `step` are counted and begin anew
        done, ret, length = step.terminated | step.truncated, self.episode_return + step.reward, self.episode_length + 1
        ended = self.ended + jnp.where(done, jnp.stack([jnp.ones_like(ret), ret, length]), 0).sum(-1)
        return Episodes(step.state, step.obs, jnp.where(done, 0.0, ret), jnp.where(done, 0, length), ended)

    def metrics(self) -> dict:  # the mean return and length of the episodes counted: NaN when none ended
        count, ret, length = self.ended  # 0 / 0 is NaN
        return dict(episode_return=ret / count, episode_length=length / count, episodes_finished=jnp.int32(count))


def make_evaluate(config: Config, env: VecEnv | None = None) -> Callable:
    """`evaluate(params, rng) -> mean return` of greedy episodes, one per env of `env` (default: eval_episodes)."""
    validate(config)
    env = VecEnv(config.env_name, config.eval_episodes) if env is None else env
    act = make_act(config, env=env)
    start = getattr(act, "memory", None)  # a recurrent policy's memory at an episode's start (None: it has none)
    batched = jax.vmap(act if start is not None else lambda p, o, k, m: (act(p, o, k), m), (None, 0, 0, 0))

    class Evaluating(NamedTuple):  # what evaluation carries from step to step
        env_state: Any
        obs: jax.Array
        memory: Any  # a recurrent policy's memory, per env
        total: jax.Array  # [episodes] return so far: each env's first episode is scored, and only it
        alive: jax.Array  # [episodes] bool: that episode has not ended yet
        rng: jax.Array
        t: jax.Array  # env steps taken

    def evaluate(params, rng: jax.Array) -> jax.Array:
        def env_step(carry: Evaluating) -> Evaluating:
            rng, act_key, env_key = jax.random.split(carry.rng, 3)
            seen = (carry.obs, carry.env_state) if getattr(act, "reads_state", False) else carry.obs  # a planner's
            action, memory = batched(params, seen, jax.random.split(act_key, env.num_envs), carry.memory)
            step = env.step(env_key, carry.env_state, action)
            total = carry.total + jnp.where(carry.alive, step.reward, 0.0)
            alive = carry.alive & ~(step.terminated | step.truncated)
            return Evaluating(step.state, step.obs, memory, total=total, alive=alive, rng=rng, t=carry.t + 1)

        reset_key, rng = jax.random.split(rng)
        obs, env_state = env.reset(reset_key)
        memory = jax.tree.map(lambda m: jnp.broadcast_to(m, (env.num_envs, *jnp.shape(m))), start)
        first = Evaluating(env_state, obs, memory, jnp.zeros(env.num_envs), jnp.ones(env.num_envs, bool), rng, t=0)
        return jax.lax.while_loop(lambda c: c.alive.any() & (c.t < env.max_episode_steps), env_step, first).total.mean()

    return evaluate


def load_run(run_dir: str, seed: int = 0, point: int = 0):
    """(config, params) of one run in a run directory of this file (alone or the harness's): the Config with its sweep
    point's values (--pbt: the member's last) and its part of params.msgpack, whose arrays are [points, seeds, ...]."""
    with np.load(pathlib.Path(run_dir, "metrics.npz")) as metrics:
        values = {name[6:]: metrics[name][point] for name in metrics.files if name.startswith("sweep_")}
        values |= {name[4:]: metrics[name][point, seed, -1] for name in metrics.files if name.startswith("pbt_")}
    saved = json.loads(pathlib.Path(run_dir, "config.json").read_text()) | {k: v.item() for k, v in values.items()}
    params = serialization.msgpack_restore(pathlib.Path(run_dir, "params.msgpack").read_bytes())
    config = Config(**{f.name: saved.get(f.name, f.default) for f in dataclasses.fields(Config)})  # new fields: default
    return config, jax.tree.map(lambda x: x[point, seed], params)


def configure_xla() -> None:
    """Unless XLA_FLAGS has them: the concurrent CPU scheduler off (it deadlocked vmapped training), faster compiles."""
    cpu = not any(module.name.startswith(("jax_cuda", "jax_rocm", "libtpu")) for module in pkgutil.iter_modules())
    flags, given = ["xla_cpu_enable_concurrency_optimized_scheduler=false"], os.environ.get("XLA_FLAGS", "")
    flags += ["xla_backend_optimization_level=1"] * cpu
    os.environ["XLA_FLAGS"] = " ".join([given] + [f"--{f}" for f in flags if f.split("=")[0] not in given]).strip()


def train_with_progress(config: Config, train: Callable):
    """Every seed's run in one program, compiled, then trained with a report every tenth of it: (runner, metrics
    [seeds, updates], {"compile": seconds, "train": seconds})."""
    total, every, clock = config.num_updates, -(-config.num_updates // 10), [time.perf_counter()]

    def report(index, mean_return):  # this update's mean return over seeds, env steps/s since training began
        speed = (index + 1) * config.steps_per_update * config.num_seeds / (time.perf_counter() - clock[-1])
        shown = f"{mean_return:.1f}" if np.isfinite(mean_return) else "- (no episode ended in this update)"
        print(f"update {index + 1}/{total}: return {shown}, {speed:,.0f} env steps/s", flush=True)

    def update(runners, index: jax.Array):  # every seed's update, and a report every tenth of the run
        runners, metrics = jax.vmap(train.update, in_axes=(0, None))(runners, index)
        mean_return, tenth = jnp.nanmean(metrics["episode_return"]), ((index + 1) % every == 0) | (index + 1 == total)
        jax.lax.cond(tenth, lambda: jax.debug.callback(report, index, mean_return, ordered=True), lambda: None)
        return runners, metrics

    keys = jax.random.split(jax.random.PRNGKey(config.seed), config.num_seeds)
    run = lambda keys: jax.lax.scan(update, jax.lax.map(train.init, keys), jnp.arange(total))  # noqa: E731
    compiled = jax.jit(run).lower(keys).compile()  # init by lax.map (not vmap), as the harness does on CPU
    clock.append(time.perf_counter())
    print(f"compiled in {clock[1] - clock[0]:.1f} s", flush=True)
    runner, metrics = jax.device_get(compiled(keys))
    seconds = {"compile": clock[1] - clock[0], "train": time.perf_counter() - clock[1]}
    return runner, {name: np.swapaxes(value, 0, 1) for name, value in metrics.items()}, seconds


def summarise_run(config: Config, metrics: dict, greedy: np.ndarray, seconds: dict) -> dict:
    """summary.json in the harness's names. A seed's final return: the mean return of its episodes that ended in the
    last 5% of updates (None where none did)."""
    last = -int(np.ceil(config.num_updates * 0.05))
    returns, counts = metrics["episode_return"][:, last:], metrics["episodes_finished"][:, last:]
    with np.errstate(invalid="ignore", divide="ignore"):
        final = np.where(counts > 0, returns * counts, 0.0).sum(-1) / counts.sum(-1)
    finite, number = final[np.isfinite(final)], lambda x: float(x) if np.isfinite(x) else None  # noqa: E731
    summary = dict(algorithm=os.path.basename(__file__)[:-3], env_name=config.env_name, num_seeds=config.num_seeds)
    summary |= dict(
        total_timesteps=config.total_timesteps, trained_timesteps=config.num_updates * config.steps_per_update
    )
    summary |= {f"final_return_{f.__name__}": number(f(finite)) if finite.size else None for f in (np.mean, np.std)}
    summary |= dict(final_return_per_seed=[number(x) for x in final], eval_return_mean=number(greedy.mean()))
    summary |= {f"{name}_seconds": value for name, value in seconds.items()} | dict(backend=jax.default_backend())
    return summary | dict(steps_per_second=summary["trained_timesteps"] * config.num_seeds / seconds["train"])


def report_lines(summary: dict) -> str:
    """The harness's closing lines, of what a file alone computes."""
    show = {
        k: "n/a" if v is None else f"{v:.1f}" for k, v in summary.items() if k.endswith(("_mean", "_std", "_seconds"))
    }
    return (
        f"final: return {show['final_return_mean']} ± {show['final_return_std']} over {summary['num_seeds']} seeds "
        f"(episodes ending in the last 5% of training), greedy eval {show['eval_return_mean']}\ncompile "
        f"{show['compile_seconds']} s, train {show['train_seconds']} s ({summary['steps_per_second']:,.0f} env "
        f"steps/s), eval {show['eval_seconds']} s"
    )


HARNESS_OPTIONS = "sweep compile-cache checkpoint checkpoint-every checkpoint-buffer resume eval-only render track "
HARNESS_OPTIONS += "wandb-project quiet pbt pbt-interval pbt-fraction pbt-fields pbt-bounds pbt-perturb pbt-fitness"


def unknown_option(name: str, given: list, options: list) -> str:
    """What to say of an option this file alone lacks: that it is the run harness's, or the closest of its own."""
    option = next((word.split("=")[0] for word in given if word.startswith("-")), given[0])
    if option.lstrip("-").removeprefix("no-") in HARNESS_OPTIONS.split():
        return f"{option}: an option of the run harness (algorithms/onefile_harness/), not of {name} alone"
    squash = lambda text: text.lstrip("-").replace("-", "").replace("_", "").lower()  # noqa: E731  (--mtau: --m-tau)
    close = difflib.get_close_matches(squash(option), (ours := {squash(o): o for o in options}), n=1)
    return f"{option}: not an option of {name}" + (f"; did you mean {ours[close[0]]}?" if close else " (see --help)")


def main(argv: list[str] | None = None) -> int:
    """This file alone, writing a run directory as the harness does; exit 2: bad input (nothing written), 3: NaN."""
    configure_xla()  # before JAX's first computation
    name, fields = os.path.basename(__file__), dataclasses.fields(Config)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False, exit_on_error=False)
    try:
        for field in fields:
            kind, *text = typing.get_args(field.type) or (field.type, "")  # its help and rules; a plain `x: float` too
            require(kind in (bool, int, float, str), f"Config.{field.name}: a flag takes bool, int, float or str")
            parse = {"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind}
            parse |= dict(default=field.default, help="; ".join(text))
            parser.add_argument("--" + field.name.replace("_", "-"), **parse)
        parser.add_argument("--runs-dir", default="runs", help="results go to a new directory under this one")
        args, unknown = parser.parse_known_args(argv)
        require(not unknown, unknown and unknown_option(name, unknown, list(parser._option_string_actions)))
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
    runner, metrics, seconds = train_with_progress(config, train)
    params, keys = saved_params(runner), jax.random.split(jax.random.PRNGKey(config.seed + 1), config.num_seeds)
    start, greedy = time.perf_counter(), np.asarray(jax.jit(jax.vmap(evaluate))(params, keys))
    summary = summarise_run(config, metrics, greedy, {**seconds, "eval": time.perf_counter() - start})
    point = lambda tree: jax.tree.map(lambda x: np.asarray(x)[None], tree)  # noqa: E731  (one sweep point)
    wall = seconds["train"] * np.arange(1, config.num_updates + 1) / config.num_updates  # spread evenly over updates
    np.savez_compressed(run_dir / "metrics.npz", **point(metrics), eval_return=point(greedy), wall_seconds=wall)
    (run_dir / "params.msgpack").write_bytes(serialization.to_bytes(point(params)))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    for update, seed in np.argwhere(~metrics["finite"].T)[:1]:  # [update, seed] where NaN or inf first appeared
        print(f"error: NaN or inf first appeared at update {update + 1}, seed index {seed}", file=sys.stderr)
    print(report_lines(summary) + f"\nresults: {run_dir}", flush=True)
    return 0 if metrics["finite"].all() else 3


if __name__ == "__main__":  # in the repository, the run harness beside this file takes over
    harness = os.path.isdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "onefile_harness"))
    sys.exit(__import__("onefile_harness").command_line(sys.modules[__name__]) if harness else main())
