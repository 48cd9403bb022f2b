"""Gumbel AlphaZero (Danihelka et al. 2022) for discrete-action gymnax environments, in one file: each action is
chosen by a search (mctx's Gumbel MuZero policy) whose model is the environment's own `step_env`, so it plans in any
gymnax environment whose step is a pure function; the policy learns the search's improved policy and the value
lambda-returns. `python alphazero.py --env-name Acrobot-v1` (--help lists every option). The whole run is one
jitted function; seeds, and sweep points of the float hyperparameters in HParams, are vmapped into one program:

    train = make_train(Config(env_name="CartPole-v1"))
    runner, metrics = jax.jit(jax.vmap(train))(jax.random.split(jax.random.PRNGKey(0), 8))

Needs jax, flax, optax, chex, gymnax, mctx and numpy only; importing it defines things and does nothing else.
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
import mctx
import numpy as np
import optax
from flax import serialization

HARNESS_PROTOCOL = 4  # the run harness's interface this file follows (algorithms/onefile_harness/protocol.py)
ACTIONS = "discrete"  # the action spaces this algorithm takes


@dataclasses.dataclass(frozen=True)
class Config:
    """Each field is a flag (`lr` is --lr), annotated with its help, then the rules its value satisfies."""

    env_name: Annotated[str, "a gymnax environment with discrete actions (gymnax.registered_envs)"] = "CartPole-v1"
    total_timesteps: Annotated[int, "env steps per run (all envs together)", "total_timesteps < 2**31"] = 131_072
    num_envs: Annotated[int, "parallel environments per run", "0 < num_envs < 2**31"] = 16
    num_steps: Annotated[int, "steps per environment in each rollout", "0 < num_steps < 2**31"] = 32
    update_epochs: Annotated[int, "passes over each rollout batch", "0 < update_epochs < 2**31"] = 4
    num_minibatches: Annotated[int, "minibatches per epoch; divides num_envs * num_steps", "num_minibatches > 0"] = 4
    num_simulations: Annotated[int, "simulations per search (training, acting)", "0 < num_simulations < 2**31"] = 16
    max_considered_actions: Annotated[int, "actions considered at the root", "max_considered_actions > 0"] = 16
    lr: Annotated[float, "Adam learning rate", "0 < lr < inf"] = 3e-4
    gamma: Annotated[float, "discount factor (the search's too)", "0 <= gamma <= 1"] = 0.99
    gae_lambda: Annotated[float, "lambda of the value targets' lambda-returns", "0 <= gae_lambda <= 1"] = 0.95
    vf_coef: Annotated[float, "value loss coefficient", "0 <= vf_coef < inf"] = 1.0
    max_grad_norm: Annotated[float, "global gradient-norm clip", "0 < max_grad_norm < inf"] = 0.5
    activation: Annotated[str, "hidden activation", "activation in ('tanh', 'relu')"] = "tanh"
    hidden_size: Annotated[int, "units per hidden layer (policy and value alike)", "0 < hidden_size < 2**31"] = 64
    num_layers: Annotated[int, "hidden layers in policy and value networks", "0 < num_layers < 2**31"] = 2
    network: Annotated[str, "torso: its convolutions (CONVOLUTIONS)", "network in ('mlp', 'cnn', 'nature_cnn')"] = "mlp"
    eval_episodes: Annotated[int, "greedy evaluation episodes per run after training", "eval_episodes > 0"] = 16
    seed: Annotated[int, "base seed; run i uses jax.random.split(PRNGKey(seed), num_seeds)[i]"] = 0
    num_seeds: Annotated[int, "independent runs trained side by side (vmapped)", "0 < num_seeds < 2**31"] = 8

    @property
    def steps_per_update(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def num_updates(self) -> int:
        return self.total_timesteps // self.steps_per_update


class HParams(NamedTuple):  # the float hyperparameters in which runs of one compiled program may differ (--sweep)
    lr: jax.Array
    gamma: jax.Array
    gae_lambda: jax.Array
    vf_coef: jax.Array
    max_grad_norm: jax.Array


hparams_from = lambda config: HParams(**{f: jnp.float32(getattr(config, f)) for f in HParams._fields})  # noqa: E731


def validate(config: Config) -> None:
    """Refuses a config that cannot run, naming the option and what is allowed (each field's rules, then these)."""
    validate_hparams(dataclasses.asdict(config))
    batch, minibatches = config.steps_per_update, config.num_minibatches
    require(batch % minibatches == 0, f"--num-minibatches {minibatches} must divide num_envs * num_steps = {batch}")
    require(batch <= config.total_timesteps, f"--total-timesteps must be at least num_envs * num_steps = {batch}")


# ---- Networks ----
CONVOLUTIONS = {  # --network: the torso's convolutions, each (features, kernel size, stride), unpadded, ReLU after
    "mlp": (),  # none: the observation flattened
    "cnn": ((16, 3, 1),),  # MinAtar's (Young & Tian 2019), for small images
    "nature_cnn": ((32, 8, 4), (64, 4, 2), (64, 3, 1)),  # Atari's (Mnih et al. 2015), for 84x84 frames
}


class Conv(nn.Module):  # nn.Conv(features, (size, size), stride, padding="VALID"): its parameters and outputs
    features: int
    size: int
    stride: int
    patches: bool | None = None  # one matmul of the image's patches (None: on CPU, docs/speed-tricks.md)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [B, H, W, C] -> [B, H', W', features]
        k, s = self.size, self.stride
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (k, k, x.shape[-1], self.features))
        bias = self.param("bias", nn.initializers.zeros, (self.features,))
        if not (jax.default_backend() == "cpu" if self.patches is None else self.patches):
            dims = ("NHWC", "HWIO", "NHWC")
            return jax.lax.conv_general_dilated(x, kernel, (s, s), "VALID", dimension_numbers=dims) + bias
        # XLA's CPU convolution is slow inside a lax.scan (jax-ml/jax#12868): each output pixel's patch, its k * k
        # offsets sliced and joined (row, column, channel: the kernel's own order), times the kernel as a matrix.
        h, w = (x.shape[1] - k) // s + 1, (x.shape[2] - k) // s + 1
        offsets = [x[:, i : i + s * (h - 1) + 1 : s, j : j + s * (w - 1) + 1 : s] for i in range(k) for j in range(k)]
        return jnp.concatenate(offsets, -1) @ kernel.reshape(-1, self.features) + bias


class Torso(nn.Module):  # what a network reads first: replace it to read observations another way
    network: str  # a key of CONVOLUTIONS
    obs_shape: tuple  # one observation's shape, as the env gives it ([height, width, channels] for an image)

    @nn.compact
    def __call__(self, obs: jax.Array) -> jax.Array:
        """Observations [..., *obs_shape] as float32 features [..., F]: convolved, then flattened."""
        lead, x = obs.shape[: obs.ndim - len(self.obs_shape)], obs.reshape(-1, *self.obs_shape).astype(jnp.float32)
        x = x / 255.0 if CONVOLUTIONS[self.network] and obs.dtype == jnp.uint8 else x  # bytes (Atari's) as [0, 1]
        for features, size, stride in CONVOLUTIONS[self.network]:
            x = nn.relu(Conv(features, size, stride)(x))
        return x.reshape(*lead, -1)


def check_network(network: str, obs_shape: tuple) -> None:
    """Convolutions read images [height, width, channels] no smaller than their kernels."""
    size = min(obs_shape[:2]) if len(obs_shape) == 3 else 0
    for _, kernel, stride in CONVOLUTIONS[network]:
        size = (size - kernel) // stride + 1 if size >= kernel else 0
    why = f"reads images [height, width, channels] larger than its kernels; this env's are {tuple(obs_shape)}"
    require(network == "mlp" or size > 0, f"--network {network} {why}")


class MLP(nn.Module):  # the actor's and the critic's towers: the same shape, different output scales
    out_dim: int
    out_scale: float
    network: str
    obs_shape: tuple
    hidden_size: int
    num_layers: int
    activation: str

    @nn.compact
    def __call__(self, obs: jax.Array) -> jax.Array:
        act, x = getattr(nn, self.activation), Torso(self.network, self.obs_shape)(obs)  # nn.tanh or nn.relu
        for _ in range(self.num_layers):
            x = act(nn.Dense(self.hidden_size, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
        return nn.Dense(self.out_dim, kernel_init=nn.initializers.orthogonal(self.out_scale))(x)


class Networks(NamedTuple):
    actor: nn.Module  # obs -> the search's prior logits; its parameters are params["actor"]
    critic: nn.Module  # obs -> [1] the value, transformed (value_transform); params["critic"]


def make_networks(config: Config, num_actions: int, obs_shape: tuple) -> Networks:
    """Actor (small initial output: a near-uniform first prior) and critic, of observations of `obs_shape`."""
    check_network(config.network, obs_shape)
    shape = dict(hidden_size=config.hidden_size, num_layers=config.num_layers, activation=config.activation)
    shape |= dict(network=config.network, obs_shape=obs_shape)
    return Networks(actor=MLP(num_actions, 0.01, **shape), critic=MLP(1, 1.0, **shape))


# ---- The algorithm: the search, its targets, the loss, and the training loop ----
class Transition(NamedTuple):
    obs: jax.Array  # [T, N, *obs_shape]
    search_policy: jax.Array  # [T, N, num_actions] the search's improved policy (the policy's target)
    reward: jax.Array  # [T, N]
    terminated: jax.Array  # [T, N]
    done: jax.Array  # [T, N] terminated or truncated: the next obs starts a new episode
    final_obs: jax.Array  # [T, N, *obs_shape] true next observation (for bootstrapping)


class Batch(NamedTuple):
    obs: jax.Array
    search_policy: jax.Array
    target: jax.Array  # the value's target, a lambda-return (untransformed)


class Runner(NamedTuple):  # everything one run carries from update to update
    params: Any  # {"actor": ..., "critic": ...}
    opt_state: Any
    episodes: "Episodes"
    rng: jax.Array
    hparams: HParams


def value_transform(x: jax.Array, eps: float = 1e-3) -> jax.Array:
    """h(x) = sign(x) (sqrt(|x| + 1) - 1) + eps x (Pohlen et al. 2018, MuZero's): the critic learns h(V), whose scale
    stays small for returns in the hundreds; learned as plain V, the value collapsed and the search with it."""
    return jnp.sign(x) * (jnp.sqrt(jnp.abs(x) + 1) - 1) + eps * x


def inverse_value_transform(y: jax.Array, eps: float = 1e-3) -> jax.Array:
    """h^-1, in closed form: the critic's output as a value."""
    return jnp.sign(y) * (jnp.square((jnp.sqrt(1 + 4 * eps * (jnp.abs(y) + 1 + eps)) - 1) / (2 * eps)) - 1)


def compute_gae(reward, value, next_value, terminated, done, gamma, gae_lambda):
    """Advantages and value targets of a [T, N] rollout. `next_value` is V of the true next observation, so a
    truncation bootstraps from the state it cut off; `terminated` zeroes it; `done` (either) stops the recursion."""
    chex.assert_equal_shape([reward, value, next_value, terminated, done])
    delta = reward + gamma * next_value * (1.0 - terminated) - value  # terminated: bool or 0/1

    def backward(next_advantage, step):
        delta_t, done_t = step
        advantage = delta_t + gamma * gae_lambda * (1.0 - done_t) * next_advantage
        return advantage, advantage

    _, advantage = jax.lax.scan(backward, jnp.zeros_like(delta[0]), (delta, done.astype(delta.dtype)), reverse=True)
    return advantage, advantage + value


def ply_sign(env: "VecEnv") -> float:
    """-1 in a two-player zero-sum game (the env's `two_player`: pgx/NAME), whose rewards are the mover's and values
    the player to move's, so that each ply's discount flips the sign of the value after it; else 1."""
    return -1.0 if getattr(env.env, "two_player", False) else 1.0


def value_targets(networks: Networks, params, tr: Transition, gamma, gae_lambda) -> jax.Array:
    """[T, N] lambda-returns of a rollout from the critic's values (h^-1 of its outputs) of each observation and of
    the true next one: a truncation bootstraps from the state it cut off, a termination from nothing. In self-play
    `gamma` is negative (ply_sign): each return is the player to move's."""
    values = networks.critic.apply(params["critic"], jnp.stack([tr.obs, tr.final_obs]))[..., 0]
    value, next_value = inverse_value_transform(values)
    return compute_gae(tr.reward, value, next_value, tr.terminated, tr.done, gamma, gae_lambda)[1]


def search(config: Config, networks: Networks, env: "VecEnv", params, obs, env_state, key, gamma, **options):
    """mctx's Gumbel MuZero search from B states (observations and env states [B, ...]), the env's own `step_env` as
    its model: mctx's PolicyOutput (the action chosen, the improved policy `action_weights`, the tree). `options`
    override the Config's num_simulations, or set gumbel_scale (1, as in training; 0: no noise, the greedy choice).
    A termination's discount is 0, which ends every path through it; the search ignores time limits. Where the env
    has legal moves (`legal_action_mask`), the root's others are invalid and every node's prior is 0 on them."""
    mask = getattr(env.env, "legal_action_mask", None)  # one state's legal moves: [num_actions] bool
    legal = lambda state: jnp.bool_(True) if mask is None else jax.vmap(mask)(state)  # noqa: E731
    actor = lambda obs, state: jnp.where(legal(state), networks.actor.apply(params["actor"], obs), -1e9)  # noqa: E731
    critic = lambda obs: inverse_value_transform(networks.critic.apply(params["critic"], obs)[..., 0])  # noqa: E731

    def model(_, key: jax.Array, action: jax.Array, env_state: Any):
        keys, step_env = jax.random.split(key, action.shape[0]), jax.vmap(env.env.step_env, in_axes=(0, 0, 0, None))
        obs, env_state, reward, terminated, _ = step_env(keys, env_state, action, env.params)
        discount, reward = ply_sign(env) * gamma * (1.0 - terminated), reward.astype(jnp.float32)
        logits, value = actor(obs, env_state), critic(obs)
        return mctx.RecurrentFnOutput(reward=reward, discount=discount, prior_logits=logits, value=value), env_state

    root = mctx.RootFnOutput(prior_logits=actor(obs, env_state), value=critic(obs), embedding=env_state)
    invalid = None if mask is None else ~legal(env_state)
    default = dict(num_simulations=config.num_simulations, max_num_considered_actions=config.max_considered_actions)
    return mctx.gumbel_muzero_policy(None, key, root, model, invalid_actions=invalid, **default | options)


def alphazero_loss(config: Config, networks: Networks, params, minibatch: Batch, hp: HParams, key: jax.Array):
    """Cross-entropy of the policy to the search's improved policy, plus the squared error of the critic to the
    transformed value target. `key` is unused: it is there for a loss that samples (noise, dropout)."""
    log_probs = jax.nn.log_softmax(networks.actor.apply(params["actor"], minibatch.obs))
    policy_loss = -(minibatch.search_policy * log_probs).sum(-1).mean()
    value = networks.critic.apply(params["critic"], minibatch.obs)[:, 0]
    value_loss = 0.5 * jnp.square(value - value_transform(minibatch.target)).mean()
    loss = policy_loss + hp.vf_coef * value_loss
    entropy = -(jnp.exp(log_probs) * log_probs).sum(-1).mean()
    return loss, dict(loss=loss, policy_loss=policy_loss, value_loss=value_loss, entropy=entropy)


def make_optimizer(config: Config, hparams: HParams):
    return optax.chain(optax.clip_by_global_norm(hparams.max_grad_norm), optax.adam(learning_rate=hparams.lr))


def make_train(config: Config, env: "VecEnv | None" = None) -> Callable:
    """`train(rng, hparams=None) -> (runner, metrics of shape [num_updates])`: `train.init(rng, hparams)`, then
    `train.update(runner, update_index)` in a `lax.scan`, in `env` (default: VecEnv(env_name, num_envs))."""
    validate(config)
    env = VecEnv(config.env_name, config.num_envs) if env is None else env
    require(hasattr(env.env, "step_env"), f"--env-name {config.env_name}: the search steps a gymnax env's step_env")
    networks, sign = make_networks(config, env.num_actions, env.obs_shape), ply_sign(env)
    T, N, M = config.num_steps, config.num_envs, config.num_minibatches

    @jax.custom_batching.sequential_vmap  # seeds in turn: vmapped, orthogonal init's QRs can deadlock XLA's CPU pool
    def init(rng: jax.Array, hparams: HParams | None = None) -> Runner:
        hparams = hparams_from(config) if hparams is None else hparams
        rng, actor_key, critic_key, env_key = jax.random.split(rng, 4)
        obs = jnp.zeros((1, *env.obs_shape), env.obs_dtype)
        params = {"actor": networks.actor.init(actor_key, obs), "critic": networks.critic.init(critic_key, obs)}
        opt_state = make_optimizer(config, hparams).init(params)
        episodes = Episodes.start(*env.reset(env_key))
        return Runner(params=params, opt_state=opt_state, episodes=episodes, rng=rng, hparams=hparams)

    def rollout(params, episodes: "Episodes", key: jax.Array, hp: HParams):
        """T steps of every env, each action the search's: (the episodes after them, [T, N] transitions)."""

        def env_step(episodes: Episodes, key: jax.Array):
            search_key, env_key = jax.random.split(key)
            plan = search(config, networks, env, params, episodes.obs, episodes.env_state, search_key, hp.gamma)
            step = env.step(env_key, episodes.env_state, plan.action)
            done = step.terminated | step.truncated
            transition = Transition(
                episodes.obs, plan.action_weights, step.reward, step.terminated, done, step.final_obs
            )
            return episodes.after(step), transition

        return jax.lax.scan(env_step, episodes.counting(), jax.random.split(key, T))

    def make_batch(params, tr: Transition, hp: HParams) -> Batch:
        """The rollout with its value targets, flattened to [T * N]."""
        batch = Batch(tr.obs, tr.search_policy, value_targets(networks, params, tr, sign * hp.gamma, hp.gae_lambda))
        return jax.tree.map(lambda x: x.reshape(T * N, *x.shape[2:]), batch)

    def learn(params, opt_state, batch: Batch, key: jax.Array, hp: HParams):
        """`update_epochs` passes of shuffled minibatch steps over the batch."""
        optimizer = make_optimizer(config, hp)

        def minibatch_step(train, inputs):
            (params, opt_state), (minibatch, key) = train, inputs
            loss = jax.grad(alphazero_loss, argnums=2, has_aux=True)
            grads, stats = loss(config, networks, params, minibatch, hp, key)
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
        rng, rollout_key, learn_key = jax.random.split(runner.rng, 3)
        episodes, transitions = rollout(runner.params, runner.episodes, rollout_key, hp)
        batch = make_batch(runner.params, transitions, hp)
        (params, opt_state), stats = learn(runner.params, runner.opt_state, batch, learn_key, hp)
        finite = jnp.isfinite(stats["loss"]).all() & jnp.isfinite(optax.tree.norm(params))
        metrics = {**episodes.metrics(), **{name: value.mean() for name, value in stats.items()}, "finite": finite}
        metrics["env_steps"] = (update_index + 1) * T * N
        return Runner(params=params, opt_state=opt_state, episodes=episodes, rng=rng, hparams=hp), metrics

    def train(rng: jax.Array, hparams: HParams | None = None):
        return jax.lax.scan(update, init(rng, hparams), jnp.arange(config.num_updates, dtype=jnp.int32))

    train.init, train.update = init, update
    return train


# ---- The policy's action ----
def make_act(config: Config, greedy: bool = True, env: "VecEnv | None" = None, num_simulations=None) -> Callable:
    """`act(params, (obs, env_state), key) -> action` for one env's observation and state (vmap it for a batch): a
    search from that state with `num_simulations` (default: the Config's), its choice without Gumbel noise, or
    (greedy=False) with it as in training. `act.reads_state`: the evaluation passes the env's state with the obs."""
    env = env or VecEnv(config.env_name, 1)
    networks = make_networks(config, env.num_actions, env.obs_shape)
    options = dict(gumbel_scale=0.0 if greedy else 1.0, num_simulations=num_simulations or config.num_simulations)

    def act(params, observation: tuple, key: jax.Array) -> jax.Array:
        obs, env_state = jax.tree.map(lambda x: jnp.asarray(x)[None], observation)  # a batch of one
        return search(config, networks, env, params, obs, env_state, key, config.gamma, **options).action[0]

    act.reads_state = True
    return act


def saved_params(runner: Runner) -> dict:
    return runner.params  # what params.msgpack holds and `make_evaluate` takes: the actor's and critic's parameters


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
