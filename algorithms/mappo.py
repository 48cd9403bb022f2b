"""MAPPO (ippo.py's decentralised actor, one shared by the agents, with a centralised critic: each agent's value
of every agent's observation joined and its own id; GAE per agent) for JaxMARL's discrete-action multi-agent
environments, in one file: `python mappo.py --env-name MPE_simple_spread_v3` (--help lists every option). The
whole run is one jitted function; seeds, and sweep points of the float hyperparameters in HParams, are vmapped into
one program:

    train = make_train(Config(env_name="MPE_simple_spread_v3"))
    runner, metrics = jax.jit(jax.vmap(train))(jax.random.split(jax.random.PRNGKey(0), 8))

Needs jax, flax, optax, chex, jaxmarl and numpy only; importing it defines things and does nothing else.
"""

import argparse
import ast
import dataclasses
import difflib
import inspect
import io
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
ACTIONS = "discrete"  # the action spaces this algorithm takes


@dataclasses.dataclass(frozen=True)
class Config:
    """Each field is a flag (`lr` is --lr), annotated with its help, then the rules its value satisfies."""

    env_name: Annotated[str, "a JaxMARL env (jaxmarl.registered_envs, or SMAX-<map>)"] = "MPE_simple_spread_v3"
    total_timesteps: Annotated[int, "env steps per run (all envs together)", "total_timesteps < 2**31"] = 2_000_000
    num_envs: Annotated[int, "parallel environments per run", "0 < num_envs < 2**31"] = 16
    num_steps: Annotated[int, "steps per environment in each rollout", "0 < num_steps < 2**31"] = 128
    update_epochs: Annotated[int, "passes over each rollout batch", "0 < update_epochs < 2**31"] = 4
    num_minibatches: Annotated[int, "minibatches per epoch; divides num_envs * num_steps", "num_minibatches > 0"] = 4
    lr: Annotated[float, "Adam learning rate (start value when annealed)", "0 < lr < inf"] = 2.5e-4
    anneal_lr: Annotated[bool, "decay the learning rate linearly to 0 over all gradient steps"] = True
    gamma: Annotated[float, "discount factor", "0 <= gamma <= 1"] = 0.99
    gae_lambda: Annotated[float, "GAE lambda (bias/variance trade-off of advantages)", "0 <= gae_lambda <= 1"] = 0.95
    clip_eps: Annotated[float, "PPO ratio clip range; also clips the value update", "0 < clip_eps < inf"] = 0.2
    objective: Annotated[str, "ppo, or dpo (Discovered Policy Optimisation)", "objective in ('ppo', 'dpo')"] = "ppo"
    dpo_alpha: Annotated[float, "DPO's drift threshold where the advantage is >= 0", "0 < dpo_alpha < inf"] = 2.0
    dpo_beta: Annotated[float, "DPO's drift threshold where the advantage is < 0", "0 < dpo_beta < inf"] = 0.6
    ent_coef: Annotated[float, "entropy bonus coefficient", "0 <= ent_coef < inf"] = 0.01
    vf_coef: Annotated[float, "value loss coefficient", "0 <= vf_coef < inf"] = 0.5
    max_grad_norm: Annotated[float, "global gradient-norm clip", "0 < max_grad_norm < inf"] = 0.5
    activation: Annotated[str, "hidden activation", "activation in ('tanh', 'relu')"] = "tanh"
    hidden_size: Annotated[int, "units per hidden layer (actor and critic alike)", "0 < hidden_size < 2**31"] = 64
    num_layers: Annotated[int, "hidden layers in actor and critic", "0 < num_layers < 2**31"] = 2
    network: Annotated[str, "torso: its convolutions (CONVOLUTIONS)", "network in ('mlp', 'cnn', 'nature_cnn')"] = "mlp"
    shaping_horizon: Annotated[int, "env steps in which the shaped reward fades out", "shaping_horizon >= 0"] = 0
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
    clip_eps: jax.Array
    ent_coef: jax.Array
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
    masked: bool = False  # observations end with out_dim legal-action flags (VecEnv.masks_actions): others are -1e9

    @nn.compact
    def __call__(self, obs: jax.Array) -> jax.Array:
        act, x = getattr(nn, self.activation), Torso(self.network, self.obs_shape)(obs)  # nn.tanh or nn.relu
        for _ in range(self.num_layers):
            x = act(nn.Dense(self.hidden_size, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
        out = nn.Dense(self.out_dim, kernel_init=nn.initializers.orthogonal(self.out_scale))(x)
        return jnp.where(obs[..., -self.out_dim :] > 0, out, -1e9) if self.masked else out


class Networks(NamedTuple):
    actor: nn.Module  # an agent's obs -> logits; its parameters are params["actor"]
    critic: nn.Module  # an agent's global state (global_state) -> [1] value; params["critic"]


def make_networks(
    config: Config, num_actions: int, obs_shape: tuple, num_agents: int = 1, masked=False, world_state_size: int = 0
) -> Networks:
    """Actor (small initial output: a near-uniform first policy; illegal actions' logits -1e9 where `masked`) of one
    agent's observations of `obs_shape`, and critic of the global state of `num_agents` agents' (an MLP: the env's
    own of `world_state_size` features, or the observations flattened and joined; and the agent's id)."""
    check_network(config.network, obs_shape)
    shape = dict(hidden_size=config.hidden_size, num_layers=config.num_layers, activation=config.activation)
    state_shape = ((world_state_size or num_agents * int(np.prod(obs_shape))) + num_agents,)
    critic = MLP(1, 1.0, **shape, network="mlp", obs_shape=state_shape)
    actor = MLP(num_actions, 0.01, **shape, network=config.network, obs_shape=obs_shape, masked=masked)
    return Networks(actor=actor, critic=critic)


# ---- The critic's input (the same in mappo.py, mappo_rnn.py: tests/test_files.py) ----
def global_state(obs: jax.Array, obs_shape: tuple, world: jax.Array | None = None) -> jax.Array:
    """What each agent's critic reads, from one step's observations [..., A, *obs_shape] and the env's own global
    state `world` [..., S] (SMAX's world_state; S = 0 where it has none): that state, else every agent's observation
    joined (JaxMARL's MPE world state), and the agent's one-hot id (its rewards are its own): [..., A, S + A] or
    [..., A, A * obs + A]."""
    lead, agents = obs.shape[: obs.ndim - len(obs_shape) - 1], obs.shape[obs.ndim - len(obs_shape) - 1]
    joint = obs.reshape(*lead, 1, -1) if world is None or world.shape[-1] == 0 else world[..., None, :]
    joint = jnp.broadcast_to(joint, (*lead, agents, joint.shape[-1]))
    ids = jnp.broadcast_to(jnp.eye(agents), (*lead, agents, agents))
    return jnp.concatenate([joint.astype(jnp.float32), ids], -1)


# ---- The algorithm: GAE, the PPO loss, and the training loop ----
class Transition(NamedTuple):  # T steps of N envs of A agents: every agent of every env is one actor
    obs: jax.Array  # [T, N, A, *obs_shape]
    action: jax.Array  # [T, N, A]
    log_prob: jax.Array  # [T, N, A] under the policy that acted
    reward: jax.Array  # [T, N, A] each agent's own
    terminated: jax.Array  # [T, N, A] the env's episode, for each of its agents
    done: jax.Array  # [T, N, A] terminated or truncated: the next obs starts a new episode
    final_obs: jax.Array  # [T, N, A, *obs_shape] true next observation (for bootstrapping)
    world_state: jax.Array  # [T, N, S] the env's own global state (S = 0 where it has none)
    final_world_state: jax.Array  # [T, N, S] of the true next state


class Batch(NamedTuple):
    obs: jax.Array
    state: jax.Array  # the critic's input: global_state of the step's observations
    action: jax.Array
    log_prob: jax.Array
    value: jax.Array
    advantage: jax.Array
    target: jax.Array


class Runner(NamedTuple):  # everything one run carries from update to update
    params: Any  # {"actor": ..., "critic": ...}
    opt_state: Any
    episodes: "Episodes"
    rng: jax.Array
    hparams: HParams


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


def policy_objective(config: Config, ratio, log_ratio, advantage, clip_eps):
    """Per sample, from the ratio r of the new policy to the acting one and the advantage A. ppo: -min(r A,
    clip(r, 1 - clip_eps, 1 + clip_eps) A). dpo (Lu et al. 2022): -(r A - drift), the drift ReLU((r - 1) A -
    alpha tanh((r - 1) A / alpha)) for A >= 0, ReLU(log(r) A - beta tanh(log(r) A / beta)) for A < 0."""
    if config.objective == "dpo":
        alpha, beta = config.dpo_alpha, config.dpo_beta
        drift_positive = nn.relu((ratio - 1) * advantage - alpha * jnp.tanh((ratio - 1) * advantage / alpha))
        drift_negative = nn.relu(log_ratio * advantage - beta * jnp.tanh(log_ratio * advantage / beta))
        return -(ratio * advantage - jnp.where(advantage >= 0, drift_positive, drift_negative))
    return -jnp.minimum(ratio * advantage, jnp.clip(ratio, 1 - clip_eps, 1 + clip_eps) * advantage)


def ppo_loss(config: Config, networks: Networks, params, minibatch: Batch, hp: HParams, key: jax.Array):
    """The policy objective (clipped surrogate or DPO), the centralised critic's clipped value loss and the entropy
    bonus of one minibatch. `key` is unused by PPO itself: it is there for a loss that samples (noise, dropout)."""
    logits = networks.actor.apply(params["actor"], minibatch.obs)
    log_probs = jax.nn.log_softmax(logits)
    log_prob = jnp.take_along_axis(log_probs, minibatch.action[:, None], -1)[:, 0]
    log_ratio = log_prob - minibatch.log_prob
    ratio = jnp.exp(log_ratio)
    advantage = minibatch.advantage
    advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
    policy_loss = policy_objective(config, ratio, log_ratio, advantage, hp.clip_eps).mean()
    value = networks.critic.apply(params["critic"], minibatch.state)[:, 0]
    value_clipped = minibatch.value + jnp.clip(value - minibatch.value, -hp.clip_eps, hp.clip_eps)
    value_loss = 0.5 * jnp.maximum(jnp.square(value - minibatch.target), jnp.square(value_clipped - minibatch.target))
    value_loss = value_loss.mean()
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
    """`train(rng, hparams=None) -> (runner, metrics of shape [num_updates])`: `train.init(rng, hparams)`, then
    `train.update(runner, update_index)` in a `lax.scan`, in `env` (default: VecEnv(env_name, num_envs))."""
    validate(config)
    env = VecEnv(config.env_name, config.num_envs) if env is None else env
    horizon = config.shaping_horizon  # Overcooked's shaped reward is weighted 1 falling to 0 in `horizon` env steps
    require(not horizon or env.shapes_reward(), f"--shaping-horizon: {config.env_name} has no shaped reward")
    shaping = optax.linear_schedule(1.0, 0.0, horizon) if horizon else optax.constant_schedule(0.0)
    networks = make_networks(
        config, env.num_actions, env.obs_shape, env.num_agents, env.masks_actions, env.world_state_size
    )
    T, N, M, A = config.num_steps, config.num_envs, config.num_minibatches, env.num_agents

    @jax.custom_batching.sequential_vmap  # seeds in turn: vmapped, orthogonal init's QRs can deadlock XLA's CPU pool
    def init(rng: jax.Array, hparams: HParams | None = None) -> Runner:
        hparams = hparams_from(config) if hparams is None else hparams
        rng, actor_key, critic_key, env_key = jax.random.split(rng, 4)
        obs = jnp.zeros((1, *env.obs_shape), env.obs_dtype)
        world = jnp.zeros((1, env.world_state_size))
        state = global_state(jnp.zeros((1, A, *env.obs_shape), env.obs_dtype), env.obs_shape, world)
        params = {"actor": networks.actor.init(actor_key, obs), "critic": networks.critic.init(critic_key, state)}
        opt_state = make_optimizer(config, hparams).init(params)
        episodes = Episodes.start(*env.reset(env_key))
        return Runner(params=params, opt_state=opt_state, episodes=episodes, rng=rng, hparams=hparams)

    def rollout(params, episodes: "Episodes", shaping: jax.Array, key: jax.Array):
        """T steps of every env under the current policy, each agent acting on its own observation: (the episodes
        after them, [T, N, A] transitions, the agents' rewards with the env's shaped reward times `shaping`)."""

        def env_step(episodes: Episodes, key: jax.Array):
            action_key, env_key = jax.random.split(key)
            action, log_prob = sample_action(networks.actor.apply(params["actor"], episodes.obs), action_key)
            step = env.step(env_key, episodes.env_state, action)
            terminated, truncated = (jnp.broadcast_to(x[:, None], (N, A)) for x in (step.terminated, step.truncated))
            done = terminated | truncated  # an episode ends for all its agents at once (JaxMARL's dones["__all__"])
            world = jax.vmap(env.world_state)(episodes.env_state)  # [N, S]: the state the agents acted in
            outcome = step.agent_reward + shaping * step.shaped_reward, terminated, done, step.final_obs
            transition = Transition(episodes.obs, action, log_prob, *outcome, world, step.final_world_state)
            return episodes.after(step), transition

        return jax.lax.scan(env_step, episodes.counting(), jax.random.split(key, T))

    def make_batch(params, tr: Transition, hp: HParams) -> Batch:
        """The rollout with its values, GAE advantages and value targets (per agent), flattened to [T * N * A]."""
        # V of the final observations' global state gives every step's bootstrap value, the last step's included.
        world = jnp.stack([tr.world_state, tr.final_world_state])
        state, final_state = global_state(jnp.stack([tr.obs, tr.final_obs]), env.obs_shape, world)
        value, next_value = networks.critic.apply(params["critic"], jnp.stack([state, final_state]))[..., 0]
        gae = compute_gae(tr.reward, value, next_value, tr.terminated, tr.done, hp.gamma, hp.gae_lambda)
        batch = Batch(tr.obs, state, tr.action, tr.log_prob, value, *gae)
        return jax.tree.map(lambda x: x.reshape(T * N * A, *x.shape[3:]), batch)

    def learn(params, opt_state, batch: Batch, key: jax.Array, hp: HParams):
        """`update_epochs` passes of shuffled minibatch steps over the batch."""
        optimizer = make_optimizer(config, hp)

        def minibatch_step(train, inputs):
            (params, opt_state), (minibatch, key) = train, inputs
            grads, stats = jax.grad(ppo_loss, argnums=2, has_aux=True)(config, networks, params, minibatch, hp, key)
            updates, opt_state = optimizer.update(grads, opt_state)
            return (optax.apply_updates(params, updates), opt_state), {**stats, "grad_norm": optax.tree.norm(grads)}

        def epoch(train, key):
            order_key, loss_key = jax.random.split(key)
            order = jax.random.permutation(order_key, T * N * A)
            minibatches = jax.tree.map(lambda x: x[order].reshape(M, T * N * A // M, *x.shape[1:]), batch)
            return jax.lax.scan(minibatch_step, train, (minibatches, jax.random.split(loss_key, M)))

        return jax.lax.scan(epoch, (params, opt_state), jax.random.split(key, config.update_epochs))

    def update(runner: Runner, update_index: jax.Array):
        hp = runner.hparams
        rng, rollout_key, learn_key = jax.random.split(runner.rng, 3)
        episodes, transitions = rollout(runner.params, runner.episodes, shaping(update_index * T * N), rollout_key)
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
def sample_action(logits: jax.Array, key: jax.Array):
    """An action drawn from softmax(logits), and its log-probability, for each row of logits."""
    action = jax.random.categorical(key, logits)
    return action, jnp.take_along_axis(jax.nn.log_softmax(logits), action[..., None], -1)[..., 0]


def make_act(config: Config, greedy: bool = True, env: "VecEnv | None" = None) -> Callable:
    """`act(params, obs, key) -> actions` for one env's observations [num_agents, *obs_shape] (vmap it for a batch):
    each agent's most probable action under the shared actor, or (greedy=False) one drawn from its softmax."""
    env = env or VecEnv(config.env_name, 1)
    networks = make_networks(
        config, env.num_actions, env.obs_shape, env.num_agents, env.masks_actions, env.world_state_size
    )

    def act(params, obs: jax.Array, key: jax.Array) -> jax.Array:
        logits = networks.actor.apply(params["actor"], obs)
        return jnp.argmax(logits, -1) if greedy else jax.random.categorical(key, logits)

    return act


def saved_params(runner: Runner) -> dict:
    return runner.params  # what params.msgpack holds and `make_evaluate` takes: the actor's and critic's parameters


# --------------------------------------------------------------------------------------
# Running a multi-agent file (the same in every multi-agent file: tests/test_files.py): checks, env loop, eval, CLI
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
    obs: jax.Array  # [num_envs, num_agents, *obs_shape] after auto-reset, agents in env.agents' order
    state: Any
    reward: jax.Array  # [num_envs] float32: the agents' mean reward (what an episode's return sums)
    terminated: jax.Array  # [num_envs] bool: the episode reached a terminal state (for all its agents)
    truncated: jax.Array  # [num_envs] bool: the episode hit its time limit
    final_obs: jax.Array  # [num_envs, num_agents, *obs_shape] the true next observations, before auto-reset
    agent_reward: jax.Array  # [num_envs, num_agents] float32: each agent's own reward
    final_world_state: jax.Array  # [num_envs, world_state_size] the env's global state before auto-reset (SMAX's)
    shaped_reward: jax.Array  # [num_envs, num_agents] the env's shaped reward (Overcooked's info; 0 where none)


def import_jaxmarl():
    """jaxmarl, imported here (importing it computes with JAX, which must wait for configure_xla's flags) and quietly:
    it prints at import, and its MABrax module points sys.stdout and sys.stderr at the process's own."""
    streams = sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__
    sys.stdout = sys.stderr = sys.__stdout__ = sys.__stderr__ = io.StringIO()
    try:
        import jaxmarl
    except ImportError as error:
        raise ConfigError(f"{os.path.basename(__file__)} needs jaxmarl ({error}): pip install jaxmarl") from None
    finally:
        sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__ = streams
    return jaxmarl


SMAX_OPTIONS = dict(see_enemy_actions=True, walls_cause_death=True, attack_mode="closest")  # JaxMARL's baselines'
VARIANTS = ("SMAX-", "overcooked-")  # env names that pick a SMAX map or an Overcooked layout (make_jaxmarl_env)


def make_jaxmarl_env(jaxmarl, env_name: str):
    """JaxMARL's env of that name; `SMAX-<map>` (SMAX-3m, SMAX-2s3z, ...: a map of smax.map_name_to_scenario) is
    SMAX on that map against JaxMARL's heuristic enemy, with the options of JaxMARL's SMAX baselines;
    `overcooked-<layout>` (overcooked-cramped_room, overcooked-counter_circuit, ...) Overcooked on that layout."""
    if env_name.startswith("SMAX-"):
        scenario = jaxmarl.environments.smax.map_name_to_scenario(env_name.removeprefix("SMAX-"))
        return jaxmarl.make("HeuristicEnemySMAX", scenario=scenario, **SMAX_OPTIONS)
    if env_name.startswith("overcooked-"):
        layouts = jaxmarl.environments.overcooked.overcooked_layouts
        return jaxmarl.make("overcooked", layout=layouts[env_name.removeprefix("overcooked-")])
    return jaxmarl.make(env_name)


class VecEnv:
    """`num_envs` copies of a JaxMARL env (or `env`, one of your own) under `jax.vmap` of its `step_env`, reset here so
    an episode's last observations stay. Its agents are an axis: observations [num_envs, num_agents, *obs_shape],
    actions [num_envs, num_agents]. An episode ends for all its agents at once (dones["__all__"]), truncated where
    the state's step count has reached the env's max_steps (its time limit: MPE's only end), else terminated. Where
    the env masks actions (SMAX, Hanabi), each agent's observation ends with its legal actions (1/0): `masks_actions`.
    """

    def __init__(self, env_name: str, num_envs: int, env: Any = None):
        jaxmarl = import_jaxmarl()
        ok = env is not None or env_name in jaxmarl.registered_envs or env_name.startswith(VARIANTS)
        why = "nor SMAX-<map> (e.g. SMAX-3m) nor overcooked-<layout> (e.g. overcooked-cramped_room)"
        require(ok, f"--env-name {env_name!r} is not in jaxmarl.registered_envs ({why})")
        try:  # a download without a network, a missing package, a factory that raises: refused in one line
            self.env, self.params = make_jaxmarl_env(jaxmarl, env_name) if env is None else env, None  # none in JaxMARL
            agents, spaces = self.env.agents, [self.env.action_space(agent) for agent in self.env.agents]
            obs, state = jax.eval_shape(self.env.reset, jax.random.PRNGKey(0))  # one env's, per agent
            obs = [(obs[agent].shape, obs[agent].dtype) for agent in agents]
            self.world_state_size = jax.eval_shape(self.world_state, state).size  # 0: the env has none
        except Exception as error:
            reason = f"{type(error).__name__}: {' '.join(str(error).split())}"
            raise ConfigError(f"--env-name {env_name} cannot be built: {reason}") from None
        kind = "discrete" if all(hasattr(space, "n") for space in spaces) else "continuous"
        require(kind == ACTIONS, f"--env-name {env_name} has {kind} actions; this file takes {ACTIONS} actions")
        alike = len({(*agent_obs, space.n) for agent_obs, space in zip(obs, spaces, strict=True)}) == 1
        require(alike, f"--env-name {env_name}: its agents' observations or actions differ; this file takes alike ones")
        own = type(self.env).get_avail_actions is not jaxmarl.environments.MultiAgentEnv.get_avail_actions
        self.masks_actions = own or hasattr(self.env, "get_legal_moves")  # Hanabi's name for them
        flat = len(obs[0][0]) == 1
        require(flat or not self.masks_actions, f"--env-name {env_name}: masked actions need flat observations")
        self.num_envs, self.num_agents, self.num_actions = num_envs, len(agents), spaces[0].n
        self.action_shape = (self.num_agents,)  # one env's action: every agent's
        self.obs_shape, self.obs_dtype = obs[0][0], jnp.float32  # one agent's, with its legal actions where masked
        self.obs_shape = (int(self.obs_shape[0]) + self.num_actions,) if self.masks_actions else self.obs_shape
        self.time_limit = getattr(self.env, "max_steps", 10**6)  # an episode ending at this step count is truncated
        self.max_episode_steps = self.time_limit + 1  # MPE's check reads the count before its step: one step more

    def reset(self, key: jax.Array):
        obs, state = jax.vmap(self.env.reset)(jax.random.split(key, self.num_envs))
        return jax.vmap(self.observe)(obs, state), state

    def observe(self, obs: dict, state: Any) -> jax.Array:
        """One env's observations [num_agents, *obs_shape]: each agent's, then its legal actions where masked."""
        # As floats: a torso reads uint8 as pixels (/ 255), and JaxMARL's uint8 (Overcooked's 0/1 planes) are not.
        obs = jnp.stack([obs[agent] for agent in self.env.agents]).astype(jnp.float32)
        if not self.masks_actions:
            return obs
        legal = getattr(self.env, "get_legal_moves", self.env.get_avail_actions)(state)
        return jnp.concatenate([obs, jnp.stack([legal[agent] for agent in self.env.agents]).astype(obs.dtype)], -1)

    def shapes_reward(self) -> bool:  # whether the env's info has a shaped reward (Overcooked's: EnvStep's)
        state = jax.eval_shape(self.env.reset, jax.random.PRNGKey(0))[1]
        step = jax.eval_shape(self.env.step_env, jax.random.PRNGKey(0), state, dict.fromkeys(self.env.agents, 0))
        return "shaped_reward" in step[4]

    def world_state(self, state: Any) -> jax.Array:  # one env's global state (SMAX's world_state), else [0] features
        world = getattr(self.env, "get_world_state", lambda state: jnp.zeros(0))
        return world(state).reshape(-1).astype(jnp.float32)

    @staticmethod
    def step_count(state: Any) -> jax.Array:  # MPE's state.step; SMAX's in its enemy's wrapper, state.state.step
        while not hasattr(state, "step") and hasattr(state, "state"):
            state = state.state
        return getattr(state, "step", -1)

    def step(self, key: jax.Array, state: Any, action: jax.Array) -> EnvStep:
        action = action.reshape(self.num_envs, *self.action_shape)
        return jax.vmap(self.step_one)(jax.random.split(key, self.num_envs), state, action)

    def step_one(self, key: jax.Array, state: Any, action: jax.Array) -> EnvStep:  # one env: step, then reset if done
        step_key, reset_key, actions = *jax.random.split(key), dict(zip(self.env.agents, action, strict=True))
        obs, state, reward, done, info = self.env.step_env(step_key, state, actions)
        reset_obs, reset_state = self.env.reset(reset_key)
        ended, truncated = done["__all__"], done["__all__"] & (self.step_count(state) >= self.time_limit)
        next_state = jax.tree.map(lambda new, old: jnp.where(ended, new, old), reset_state, state)
        obs, reward = self.observe(obs, state), jnp.stack([reward[agent] for agent in self.env.agents])
        next_obs, reward = jnp.where(ended, self.observe(reset_obs, reset_state), obs), reward.astype(jnp.float32)
        final, shaped = self.world_state(state), info.get("shaped_reward", dict.fromkeys(self.env.agents, 0.0))
        shaped = jnp.stack([shaped[agent] for agent in self.env.agents]).astype(jnp.float32)
        return EnvStep(next_obs, next_state, reward.mean(), ended & ~truncated, truncated, obs, reward, final, shaped)


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
