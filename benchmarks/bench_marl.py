"""Measures a multi-agent file side by side with JaxMARL's own baseline of its algorithm, at that baseline's config
(a yaml of a JaxMARL checkout): on MPE_simple_spread_v3 algorithms/ippo.py beside baselines/IPPO/ippo_ff_mpe.py,
algorithms/mappo.py beside baselines/MAPPO/mappo_rnn_mpe.py (recurrent) and algorithms/pqn_vdn.py beside
baselines/QLearning/pqn_vdn_ff.py; on SMAX-3m ippo.py and mappo.py (feed-forward) beside baselines/IPPO/ippo_rnn_smax.py
and baselines/MAPPO/mappo_rnn_smax.py (recurrent), ippo_rnn.py and mappo_rnn.py (recurrent) beside those two, and
pqn_vdn.py beside baselines/QLearning/pqn_vdn_rnn.py (recurrent), their yamls' map set to 3m on both sides; on
Overcooked's cramped_room ippo.py (--network cnn) beside baselines/IPPO/ippo_cnn_overcooked.py, its yaml's layout set
to cramped_room on both sides (BASELINES).

    python benchmarks/bench_marl.py --jaxmarl /path/to/JaxMARL                       # ippo.py: 4 seeds, 2e6 steps
    python benchmarks/bench_marl.py --jaxmarl /path/to/JaxMARL --algorithm pqn_vdn --pairs 2     # 4 seeds, 1e6
    python benchmarks/bench_marl.py --jaxmarl /path/to/JaxMARL --algorithm ippo_smax --seeds 2   # SMAX-3m, 2e6
    python benchmarks/bench_marl.py --jaxmarl /path/to/JaxMARL --algorithm ippo_rnn_smax --seeds 2 --total-timesteps 1e6
    python benchmarks/bench_marl.py --jaxmarl /path/to/JaxMARL --algorithm mappo_rnn_smax --seeds 2  # SMAX-3m, 2e6
    python benchmarks/bench_marl.py --jaxmarl /path/to/JaxMARL --algorithm pqn_vdn_smax --seeds 2   # SMAX-3m, 1e6
    python benchmarks/bench_marl.py --jaxmarl /path/to/JaxMARL --algorithm mappo --seeds 2 --total-timesteps 1e6

What it measures, each side in a fresh process with an empty JAX compile cache (JAX_COMPILATION_CACHE_DIR a
new temporary directory, as bench_parity.py does):
  - ours: as bench_rejax.py times ours, in-process through this script's --worker (not the file's command
    line, whose harness spreads seeds over the CPU devices it splits the host into): `jax.jit(jax.vmap(train))`
    of the file's make_train at the yaml's hyperparameters (each key mapped to a Config field, Baseline.fields),
    after the harness's XLA flags (xla.configure()), on one device; compile_s = lower + compile, run_s the
    compiled call, steps/s = env steps of all seeds / run_s. final return: per seed, the mean return of the
    episodes that ended in the last 5% of updates (the harness's final_returns), per agent (the agents' mean
    reward summed over an episode); greedy eval: make_evaluate's 16 episodes after training, not timed.
  - JaxMARL: benchmarks/peers/jaxmarl_driver.py, its unmodified file and yaml, timed the same way; its final
    return is, per seed, the mean over the last 5% of updates of the `returned_episode_returns` the file logs
    through wandb.log (MPELogWrapper's: the sum over agents of each env's last finished episode's returns),
    divided by the number of agents; pqn_vdn_ff.py's greedy test, which it runs every 5% of updates, likewise.
Each pair runs one process of each side, the order alternating between pairs (ours first in the first);
ratios ours / JaxMARL are taken within a pair, then the median over pairs. Results: marl_<algorithm>_<backend>.md
and a .jsonl of every measurement (appended), under --out (default benchmarks/results). On SMAX each side's win rate
is reported too: ours, the greedy win rate of 64 episodes per seed after training (benchmarks/smax_wins.py);
JaxMARL's, its logged win rate of the episodes that ended in the last 5% of updates.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import NamedTuple

from common import ROOT, describe, load_algorithm, machine, run_result, stats, write_markdown, xla

PEERS = os.path.join(ROOT, "benchmarks", "peers")
PEER_DRIVER = os.path.join(PEERS, "jaxmarl_driver.py")


class Baseline(NamedTuple):
    name: str  # the driver's name for it (jaxmarl_driver.BASELINES)
    file: str  # our file, algorithms/<file>.py
    env: str  # the env both sides run, by our name
    source: str  # its file, in the checkout
    config: str  # its yaml, in the checkout
    fields: dict  # the yaml's keys, as the file's Config fields
    fixed: dict  # yaml keys the file has no field for, with the value it does what they say at
    total_timesteps: float  # --total-timesteps' default: the file's default run
    differences: list  # how the two differ, and where they are alike
    overrides: dict = {}  # yaml keys set on both sides (the driver's --set)
    ours: dict = {}  # Config fields of the file the yaml has no key for, and the value they run at
    unlike: dict = {}  # yaml keys at values the file has no counterpart for (each one of the differences)


NOT_HYPERPARAMETERS = {"SEED", "NUM_SEEDS", "ENTITY", "PROJECT", "WANDB_MODE", "ENV_KWARGS"}  # seeds are set here
INTEGERS = {"num_envs", "num_steps", "total_timesteps", "update_epochs", "num_minibatches", "hidden_size", "num_layers"}
INTEGERS |= {"shaping_horizon"}
FINAL_RETURN = (
    "the final return: ours averages the episodes that ended in the last 5% of updates; JaxMARL's logged figure "
    "averages, over every step of those updates, each env's last finished episode (lagging by up to one episode), "
    "and sums over agents (MPELogWrapper multiplies each reward by the number of agents), so it is divided by the "
    "number of agents here"
)
TIME_LIMIT = (
    "episode ends: MPE's only end is its time limit (max_steps); JaxMARL's {targets} treats it as a termination "
    "(done zeroes the bootstrap value), {file} bootstraps through it from {value} of the true last observation"
)
RECURRENT = (
    "the networks: JaxMARL's actor and critic are recurrent (a dense layer of FC_DIM_SIZE, a GRU of GRU_HIDDEN_DIM, "
    "a dense layer), {file}'s feed-forward (two hidden layers of FC_DIM_SIZE): it has no recurrent torso yet"
)
SMAX_RETURNS = (
    "the final return: ours averages the episodes that ended in the last 5% of updates, JaxMARL's logged `returns` "
    "(SMAXLogWrapper's, per agent) over those updates; win rates: ours greedy after training (64 episodes per "
    "seed), JaxMARL's its logged training win rate over the last 5% of updates"
)
SMAX_KWARGS = dict(see_enemy_actions=True, walls_cause_death=True, attack_mode="closest")
RNN_FIELDS = {
    **{key: key.lower() for key in ("LR", "NUM_ENVS", "NUM_STEPS", "TOTAL_TIMESTEPS", "UPDATE_EPOCHS")},
    **{key: key.lower() for key in ("NUM_MINIBATCHES", "GAMMA", "GAE_LAMBDA", "CLIP_EPS", "ENT_COEF")},
    **{key: key.lower() for key in ("VF_COEF", "MAX_GRAD_NORM", "ACTIVATION", "ANNEAL_LR")},
    "FC_DIM_SIZE": "hidden_size",
}
BASELINES = {
    "ippo": Baseline(
        name="ippo_ff_mpe",
        file="ippo",
        env="MPE_simple_spread_v3",
        source="baselines/IPPO/ippo_ff_mpe.py",
        config=os.path.join("baselines", "IPPO", "config", "ippo_ff_mpe.yaml"),
        fields={
            **{key: key.lower() for key in ("ENV_NAME", "LR", "NUM_ENVS", "NUM_STEPS", "TOTAL_TIMESTEPS")},
            **{key: key.lower() for key in ("UPDATE_EPOCHS", "NUM_MINIBATCHES", "GAMMA", "GAE_LAMBDA", "CLIP_EPS")},
            **{key: key.lower() for key in ("ENT_COEF", "VF_COEF", "MAX_GRAD_NORM", "ACTIVATION", "ANNEAL_LR")},
        },
        fixed={},
        total_timesteps=2e6,
        differences=[
            TIME_LIMIT.format(targets="GAE", file="ippo.py", value="V"),
            "the learning-rate anneal: JaxMARL's falls once per update (count // (minibatches * epochs)), ippo.py's "
            "at every gradient step",
            FINAL_RETURN,
            "the network, the losses (clipped surrogate, clipped value loss, per-minibatch advantage normalisation), "
            "the optimiser (one Adam over actor and critic, global-norm clip) and the per-agent rewards are alike",
        ],
    ),
    "pqn_vdn": Baseline(
        name="pqn_vdn_ff_mpe",
        file="pqn_vdn",
        env="MPE_simple_spread_v3",
        source="baselines/QLearning/pqn_vdn_ff.py",
        config=os.path.join("baselines", "QLearning", "config", "alg", "pqn_vdn_ff_mpe.yaml"),
        fields={
            **{key: key.lower() for key in ("ENV_NAME", "LR", "NUM_ENVS", "NUM_STEPS", "TOTAL_TIMESTEPS")},
            **{key: key.lower() for key in ("HIDDEN_SIZE", "NUM_LAYERS", "NUM_MINIBATCHES", "GAMMA", "EPS_START")},
            **dict(MAX_GRAD_NORM="max_grad_norm", EPS_FINISH="eps_end", EPS_DECAY="eps_fraction"),
            **dict(NUM_EPOCHS="update_epochs", LR_LINEAR_DECAY="anneal_lr", LAMBDA="q_lambda"),
        },
        # Its greedy tests during training (TEST_*) are evaluation, not hyperparameters; ours evaluates after.
        fixed=dict(MEMORY_WINDOW=0, NORM_INPUTS=False, NORM_TYPE="layer_norm", TEST_DURING_TRAINING=True)
        | dict(TEST_INTERVAL=0.05, TEST_NUM_STEPS=30, TEST_NUM_ENVS=512, HYP_TUNE=False, SAVE_PATH="models")
        | dict(WANDB_LOG_ALL_SEEDS=False),
        total_timesteps=1e6,
        differences=[
            TIME_LIMIT.format(targets="Q(lambda) recursion", file="pqn_vdn.py", value="Q_tot"),
            "the optimiser: JaxMARL's RAdam, pqn_vdn.py's Adam (pqn.py's), each after a global-norm clip",
            "JaxMARL's run includes its greedy tests (512 envs x 30 steps every 5% of updates: about 300,000 env "
            "steps per 1M, not counted in its env steps/s); pqn_vdn.py's greedy evaluation runs after training, "
            "untimed",
            FINAL_RETURN,
            "the team's reward (the sum of the agents' rewards), Q_tot (the sum of the agents' Q-values), the "
            "network (shared by the agents, their one-hot ids appended, LayerNorm after each hidden layer) and "
            "epsilon-greedy exploration per agent on an epsilon falling by update are alike",
        ],
    ),
    "ippo_smax": Baseline(
        name="ippo_rnn_smax",
        file="ippo",
        env="SMAX-3m",
        source="baselines/IPPO/ippo_rnn_smax.py",
        config=os.path.join("baselines", "IPPO", "config", "ippo_rnn_smax.yaml"),
        fields=RNN_FIELDS,
        # ippo.py's SMAX-3m is this env on this map with these options; it has no GRU (a difference, below).
        fixed=dict(ENV_NAME="HeuristicEnemySMAX", MAP_NAME="3m", SCALE_CLIP_EPS=False, GRU_HIDDEN_DIM=128)
        | dict(ENV_KWARGS=SMAX_KWARGS),
        total_timesteps=2e6,
        differences=[
            RECURRENT.format(file="ippo.py"),
            "the observations: ippo.py's end with each agent's legal actions (its VecEnv's action mask), which "
            "JaxMARL's actor reads apart; both mask illegal actions' logits",
            "episode ends: SMAX's time limit (101 steps) is a truncation for ippo.py, bootstrapped from V of the "
            "true last observation, and a termination for JaxMARL's GAE",
            "the learning-rate anneal: JaxMARL's falls once per update, ippo.py's at every gradient step",
            SMAX_RETURNS,
        ],
        overrides=dict(MAP_NAME="3m"),
    ),
    "ippo_rnn_smax": Baseline(
        name="ippo_rnn_smax",
        file="ippo_rnn",
        env="SMAX-3m",
        source="baselines/IPPO/ippo_rnn_smax.py",
        config=os.path.join("baselines", "IPPO", "config", "ippo_rnn_smax.yaml"),
        fields=RNN_FIELDS,
        # ippo_rnn.py's SMAX-3m is this env on this map with these options; its GRU is as wide as its Dense layers.
        fixed=dict(ENV_NAME="HeuristicEnemySMAX", MAP_NAME="3m", SCALE_CLIP_EPS=False, GRU_HIDDEN_DIM=128)
        | dict(ENV_KWARGS=SMAX_KWARGS),
        total_timesteps=2e6,
        differences=[
            "the networks alike: a dense layer of FC_DIM_SIZE, a GRU, a dense layer and the output in each head "
            "(ippo_rnn.py's Dense layers orthogonal(sqrt 2), JaxMARL's heads' orthogonal(2)); each agent's GRU state "
            "reset where its episode starts; minibatches of whole agent sequences on both sides",
            "the observations: ippo_rnn.py's end with each agent's legal actions (its VecEnv's action mask), which "
            "JaxMARL's network reads apart; both mask illegal actions' logits",
            "episode ends: SMAX's time limit (101 steps) is a truncation for ippo_rnn.py, bootstrapped from V of the "
            "true last observation and the GRU state after the step, and a termination for JaxMARL's GAE",
            "the learning-rate anneal: JaxMARL's falls once per update, ippo_rnn.py's at every gradient step",
            SMAX_RETURNS,
        ],
        overrides=dict(MAP_NAME="3m"),
    ),
    "pqn_vdn_smax": Baseline(
        name="pqn_vdn_rnn_smax",
        file="pqn_vdn",
        env="SMAX-3m",
        source="baselines/QLearning/pqn_vdn_rnn.py",
        config=os.path.join("baselines", "QLearning", "config", "alg", "pqn_vdn_rnn_smax.yaml"),
        fields={
            **{key: key.lower() for key in ("LR", "NUM_ENVS", "NUM_STEPS", "TOTAL_TIMESTEPS", "HIDDEN_SIZE")},
            **{key: key.lower() for key in ("NUM_LAYERS", "NUM_MINIBATCHES", "GAMMA", "EPS_START")},
            **dict(MAX_GRAD_NORM="max_grad_norm", EPS_FINISH="eps_end", EPS_DECAY="eps_fraction"),
            **dict(NUM_EPOCHS="update_epochs", LR_LINEAR_DECAY="anneal_lr", LAMBDA="q_lambda"),
            **dict(REW_SCALE="reward_scale"),
        },
        fixed=dict(ENV_NAME="HeuristicEnemySMAX", MAP_NAME="3m", ENV_KWARGS=SMAX_KWARGS, TEST_DURING_TRAINING=True)
        | dict(TEST_INTERVAL=0.05, TEST_NUM_STEPS=128, TEST_NUM_ENVS=128),
        unlike=dict(MEMORY_WINDOW=4, NORM_INPUT=True, NORM_TYPE="batch_norm"),
        total_timesteps=1e6,
        differences=[
            "the networks: JaxMARL's is recurrent (NUM_LAYERS dense layers of HIDDEN_SIZE, each batch-normalised, "
            "then a GRU, its state carried across rollouts with a MEMORY_WINDOW of 4 earlier steps replayed before "
            "each sequence), its input batch-normalised (NORM_INPUT); pqn_vdn.py's feed-forward (the same dense "
            "layers, LayerNorm after each: pqn.py's), its input as the env gives it",
            "episode ends: SMAX's time limit (101 steps) is a truncation for pqn_vdn.py, bootstrapped from Q_tot of "
            "the true last observation, and a termination for JaxMARL's Q(lambda) recursion",
            "the optimiser: JaxMARL's RAdam, pqn_vdn.py's Adam (pqn.py's), each after a global-norm clip",
            "JaxMARL's run includes its greedy tests (128 envs x 128 steps every 5% of updates), not counted in its "
            "env steps/s; pqn_vdn.py's greedy evaluation runs after training, untimed",
            "the final return: ours averages the episodes that ended in the last 5% of updates; JaxMARL's logged "
            "`returned_episode_returns` (SMAXLogWrapper's, per agent) is the mean over every step, env and agent of "
            "each env's last finished episode, over those updates; win rates: ours greedy after training (64 "
            "episodes per seed), JaxMARL's the same mean of `returned_won_episode` (its sampling policy's)",
            "the team's reward (the sum of the agents' rewards, scaled by REW_SCALE in the targets), Q_tot (the sum "
            "of the agents' Q-values), agent ids in the input and illegal actions masked are alike",
        ],
        overrides=dict(MAP_NAME="3m"),
    ),
    "ippo_overcooked": Baseline(
        name="ippo_cnn_overcooked",
        file="ippo",
        env="overcooked-cramped_room",
        source="baselines/IPPO/ippo_cnn_overcooked.py",
        config=os.path.join("baselines", "IPPO", "config", "ippo_cnn_overcooked.yaml"),
        fields={
            **{key: key.lower() for key in ("LR", "NUM_ENVS", "NUM_STEPS", "TOTAL_TIMESTEPS", "UPDATE_EPOCHS")},
            **{key: key.lower() for key in ("NUM_MINIBATCHES", "GAMMA", "GAE_LAMBDA", "CLIP_EPS", "ENT_COEF")},
            **{key: key.lower() for key in ("VF_COEF", "MAX_GRAD_NORM", "ACTIVATION", "ANNEAL_LR")},
            "REW_SHAPING_HORIZON": "shaping_horizon",
        },
        fixed=dict(ENV_NAME="overcooked", ENV_KWARGS=dict(layout="cramped_room"), TUNE=False),
        total_timesteps=1e6,
        differences=[
            "the networks: JaxMARL's actor and critic share a torso (three 32-feature convolutions, 5x5 then two "
            "3x3, padded, and a dense layer of 64) and its actor's head reads that torso's output (the 64-unit "
            "dense layer it computes is unused); ippo.py's actor and critic are apart, each a 16-feature 3x3 "
            "convolution, unpadded (--network cnn, MinAtar's), then two hidden layers of 64",
            "episode ends: Overcooked's only end is its time limit (400 steps): a truncation for ippo.py, "
            "bootstrapped from V of the true last observation, a termination for JaxMARL's GAE",
            "the learning-rate anneal: JaxMARL's falls once per update, ippo.py's at every gradient step",
            "the shaped reward: both add Overcooked's, weighted 1 falling linearly to 0 over REW_SHAPING_HORIZON "
            "env steps (--shaping-horizon), to each agent's reward; both report the env's own reward",
            "the final return: ours averages the episodes that ended in the last 5% of updates; JaxMARL's logged "
            "`returned_episode_returns` (LogWrapper's, per agent: both agents get the team's reward) averages, over "
            "every step of those updates, each env's last finished episode",
        ],
        overrides=dict(ENV_KWARGS=dict(layout="cramped_room")),
        ours=dict(network="cnn"),
    ),
    "mappo": Baseline(
        name="mappo_rnn_mpe",
        file="mappo",
        env="MPE_simple_spread_v3",
        source="baselines/MAPPO/mappo_rnn_mpe.py",
        config=os.path.join("baselines", "MAPPO", "config", "mappo_homogenous_rnn_mpe.yaml"),
        fields=RNN_FIELDS | {"ENV_NAME": "env_name"},
        fixed=dict(GRU_HIDDEN_DIM=128, SCALE_CLIP_EPS=False, ENV_KWARGS={}),
        total_timesteps=2e6,
        differences=[
            RECURRENT.format(file="mappo.py"),
            "the critic's input: both read every agent's observation joined (JaxMARL's MPEWorldStateWrapper) and, "
            "mappo.py, the agent's one-hot id",
            TIME_LIMIT.format(targets="GAE", file="mappo.py", value="V"),
            "the optimisers: JaxMARL's actor and critic each have an Adam with its own global-norm clip, mappo.py "
            "one Adam over both after one clip; the learning-rate anneal: JaxMARL's falls once per update, "
            "mappo.py's at every gradient step",
            "the final return: ours averages the episodes that ended in the last 5% of updates; JaxMARL's logged "
            "`returns` is MPELogWrapper's returned_episode_returns at each rollout's last step (the sum over "
            "agents), averaged over actors, divided here by the number of agents",
        ],
    ),
    "mappo_smax": Baseline(
        name="mappo_rnn_smax",
        file="mappo",
        env="SMAX-3m",
        source="baselines/MAPPO/mappo_rnn_smax.py",
        config=os.path.join("baselines", "MAPPO", "config", "mappo_homogenous_rnn_smax.yaml"),
        fields=RNN_FIELDS,
        # mappo.py's SMAX-3m is this env on this map with these options, its critic SMAX's world state and the
        # agent's id (OBS_WITH_AGENT_ID); it has no GRU (a difference, below).
        fixed=dict(ENV_NAME="HeuristicEnemySMAX", MAP_NAME="3m", SCALE_CLIP_EPS=False, GRU_HIDDEN_DIM=128)
        | dict(OBS_WITH_AGENT_ID=True, ENV_KWARGS=SMAX_KWARGS),
        total_timesteps=2e6,
        differences=[
            RECURRENT.format(file="mappo.py"),
            "the critic's input: SMAX's world state (get_world_state) and the agent's one-hot id on both sides",
            "the observations: mappo.py's end with each agent's legal actions (its VecEnv's action mask), which "
            "JaxMARL's actor reads apart; both mask illegal actions' logits",
            "episode ends: SMAX's time limit (101 steps) is a truncation for mappo.py, bootstrapped from V of the "
            "true last state, and a termination for JaxMARL's GAE",
            "the optimisers: JaxMARL's actor and critic each have an Adam with its own global-norm clip, mappo.py "
            "one Adam over both after one clip; the learning-rate anneal: JaxMARL's falls once per update, "
            "mappo.py's at every gradient step",
            SMAX_RETURNS,
        ],
        overrides=dict(MAP_NAME="3m"),
    ),
    "mappo_rnn_smax": Baseline(
        name="mappo_rnn_smax",
        file="mappo_rnn",
        env="SMAX-3m",
        source="baselines/MAPPO/mappo_rnn_smax.py",
        config=os.path.join("baselines", "MAPPO", "config", "mappo_homogenous_rnn_smax.yaml"),
        fields=RNN_FIELDS,
        # mappo_rnn.py's SMAX-3m is this env on this map with these options, its critic SMAX's world state and the
        # agent's id (OBS_WITH_AGENT_ID); its GRUs are as wide as its Dense layers.
        fixed=dict(ENV_NAME="HeuristicEnemySMAX", MAP_NAME="3m", SCALE_CLIP_EPS=False, GRU_HIDDEN_DIM=128)
        | dict(OBS_WITH_AGENT_ID=True, ENV_KWARGS=SMAX_KWARGS),
        total_timesteps=2e6,
        differences=[
            "the networks alike: actor and critic each a dense layer of FC_DIM_SIZE, a GRU, a dense layer and the "
            "output (mappo_rnn.py's Dense layers orthogonal(sqrt 2), JaxMARL's heads' orthogonal(2)); each agent's "
            "GRU states reset where its episode starts; minibatches of whole agent sequences on both sides",
            "the critic's input: SMAX's world state (get_world_state) and the agent's one-hot id on both sides",
            "the observations: mappo_rnn.py's end with each agent's legal actions (its VecEnv's action mask), which "
            "JaxMARL's actor reads apart; both mask illegal actions' logits",
            "episode ends: SMAX's time limit (101 steps) is a truncation for mappo_rnn.py, bootstrapped from V of "
            "the true last state and the critic's GRU state after the step, and a termination for JaxMARL's GAE",
            "the optimisers: JaxMARL's actor and critic each have an Adam with its own global-norm clip, "
            "mappo_rnn.py one Adam over both after one clip; the learning-rate anneal: JaxMARL's falls once per "
            "update, mappo_rnn.py's at every gradient step",
            SMAX_RETURNS,
        ],
        overrides=dict(MAP_NAME="3m"),
    ),
}


def jaxmarl_config(jaxmarl: str, baseline: Baseline) -> dict:
    """The baseline's yaml as the driver reads it."""
    sys.path.insert(0, PEERS)
    from jaxmarl_driver import yaml_config

    return yaml_config(os.path.join(jaxmarl, baseline.config))


def our_config(jaxmarl: str, algorithm: str, total_timesteps: float, seeds: int) -> dict:
    """The file's Config fields for the yaml, at --total-timesteps; refuses a yaml key it cannot map, and a value
    of a key it has no field for that is not the one it does what that key says at."""
    baseline = BASELINES[algorithm]
    yaml = jaxmarl_config(jaxmarl, baseline) | baseline.overrides
    unmapped = set(yaml) - set(baseline.fields) - NOT_HYPERPARAMETERS - set(baseline.fixed) - set(baseline.unlike)
    unmapped |= {key for key, value in (baseline.fixed | baseline.unlike).items() if yaml.get(key, value) != value}
    if unmapped or yaml.get("ENV_KWARGS", {}) != baseline.fixed.get("ENV_KWARGS", {}):
        where = f"{baseline.config}: no Config field of {baseline.file}.py"
        raise SystemExit(f"{where} for {sorted(unmapped) or 'ENV_KWARGS'} at the yaml's values")
    fields = {ours: yaml[key] for key, ours in baseline.fields.items() if key in yaml} | baseline.ours
    fields |= dict(env_name=baseline.env, total_timesteps=total_timesteps, num_seeds=seeds)
    return {k: int(v) if k in INTEGERS else v for k, v in fields.items()}


def worker(jaxmarl: str, algorithm: str, total_timesteps: float, seeds: int) -> None:
    """Times our train as one jitted call on one device, as the peer driver times JaxMARL's."""
    module = load_algorithm(BASELINES[algorithm].file)
    xla.configure()  # the XLA flags the command line sets, before any JAX computation
    import jax
    import numpy as np

    config = module.Config(**our_config(jaxmarl, algorithm, total_timesteps, seeds))
    keys = jax.random.split(jax.random.PRNGKey(0), seeds)
    train = module.make_train(config)
    start = time.perf_counter()
    compiled = jax.jit(jax.vmap(train)).lower(keys).compile()
    compiled_at = time.perf_counter()
    runner, metrics = jax.block_until_ready(compiled(keys))
    run_s = time.perf_counter() - compiled_at
    metrics = {k: np.asarray(v) for k, v in metrics.items()}
    evaluate = jax.jit(jax.vmap(module.make_evaluate(config)))
    greedy = np.asarray(evaluate(module.saved_params(runner), jax.random.split(jax.random.PRNGKey(1), seeds)))
    final = stats.final_returns(metrics)
    steps = int(metrics["env_steps"][0, -1])
    wins = None
    if config.env_name.startswith("SMAX-"):  # each seed's greedy win rate, 64 episodes
        from smax_wins import win_rate

        env, params = module.VecEnv(config.env_name, 64), module.saved_params(runner)
        seed_params = [jax.tree.map(lambda x, i=i: x[i], params) for i in range(seeds)]
        wins = [win_rate(module, config, p, env, jax.random.PRNGKey(2 + i)) for i, p in enumerate(seed_params)]
    print(
        "RESULT "
        + json.dumps(
            {
                "bench": f"ours_{algorithm}",
                "env": config.env_name,
                "num_seeds": seeds,
                "total_timesteps": config.total_timesteps,
                "num_updates": config.num_updates,
                "env_steps_per_seed": steps,
                "compile_s": compiled_at - start,
                "run_s": run_s,
                "steps_per_s": steps * seeds / run_s,
                "final_return_mean": float(np.nanmean(final)),
                "final_return_std": float(np.nanstd(final)),
                "final_return_per_seed": [float(x) for x in final],
                "eval_return_mean": float(np.mean(greedy)),
                "eval_win_rate_per_seed": wins,
                "eval_win_rate_mean": None if wins is None else float(np.mean(wins)),
                "finite": bool(metrics["finite"].all()),
                "xla_flags": os.environ.get("XLA_FLAGS", ""),
            }
        ),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jaxmarl", metavar="PATH", help="root of a JaxMARL checkout (for its baselines/)")
    parser.add_argument("--algorithm", choices=sorted(BASELINES), default="ippo", help="our file (BASELINES)")
    parser.add_argument("--seeds", type=int, default=4, help="vmapped seeds per measurement")
    parser.add_argument("--total-timesteps", type=float, help="env steps per seed (default: the file's default)")
    parser.add_argument("--pairs", type=int, default=1, help="pairs of processes, the order alternating")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--peer-python", default=sys.executable, help="interpreter with jaxmarl installed")
    parser.add_argument("--worker", action="store_true", help="internal: time ours and print RESULT")
    args = parser.parse_args()
    baseline = BASELINES[args.algorithm]
    if not args.jaxmarl or not os.path.isfile(os.path.join(args.jaxmarl, baseline.config)):
        parser.error(f"--jaxmarl PATH: the root of a JaxMARL checkout (with {baseline.config})")
    jaxmarl, steps = os.path.abspath(args.jaxmarl), args.total_timesteps or baseline.total_timesteps
    if args.worker:
        return worker(jaxmarl, args.algorithm, steps, args.seeds)
    config = our_config(jaxmarl, args.algorithm, steps, args.seeds)  # refuses an unmappable yaml before running

    where = machine()
    os.makedirs(args.out, exist_ok=True)
    raw_path = os.path.join(args.out, f"marl_{args.algorithm}_{where['backend']}.jsonl")
    records = []
    for index in range(args.pairs):
        ours = [sys.executable, os.path.abspath(__file__), "--worker", "--jaxmarl", jaxmarl]
        ours += ["--algorithm", args.algorithm, "--seeds", str(args.seeds), "--total-timesteps", repr(steps)]
        peer = [args.peer_python, PEER_DRIVER, baseline.name, "--jaxmarl", jaxmarl]
        peer += ["--seeds", str(args.seeds), "--total-timesteps", repr(steps)]
        peer += [item for key, value in baseline.overrides.items() for item in ("--set", f"{key}={value!r}")]
        jobs = [("ours", ours), ("jaxmarl", peer)][:: -1 if index % 2 else 1]
        for side, command in jobs:
            load_before = os.getloadavg()[0]
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache}
                result = run_result(command, env=env, timeout=3600)
            if not result:
                continue
            result = {
                "side": side,
                "pair": index,
                "seeds": args.seeds,
                "load_1min_before": load_before,
                "load_1min_after": os.getloadavg()[0],
                "unix_time": time.time(),
                **result,
                "machine": where,
            }
            records.append(result)
            with open(raw_path, "a") as f:
                f.write(json.dumps(result) + "\n")
            print(
                f"pair {index + 1} {side:7s} {args.seeds} seed(s): compile {result['compile_s']:.1f} s, "
                f"{result['steps_per_s']:,.0f} env steps/s, return per agent {result['final_return_mean']:.2f} "
                f"(load {load_before:.1f})",
                flush=True,
            )
    path = os.path.join(args.out, f"marl_{args.algorithm}_{where['backend']}.md")
    write_table(records, args.algorithm, config, where, path, raw_path)


def write_table(records: list, algorithm: str, config: dict, where: dict, path: str, raw_path: str) -> None:
    fmt = lambda x, f: "–" if x is None else format(x, f)  # noqa: E731
    med = lambda rs, k: statistics.median([r[k] for r in rs if r.get(k) is not None] or [None])  # noqa: E731
    runs = {side: [r for r in records if r["side"] == side] for side in ("ours", "jaxmarl")}
    pairs = [(o, t) for o in runs["ours"] for t in runs["jaxmarl"] if o["pair"] == t["pair"]]
    ratio = lambda k: statistics.median(o[k] / t[k] for o, t in pairs) if pairs else None  # noqa: E731
    peer = runs["jaxmarl"][0] if runs["jaxmarl"] else {}
    commit, baseline = peer.get("jaxmarl_commit"), BASELINES[algorithm]
    file = os.path.basename(baseline.source)
    version = (
        f"commit {commit}"
        if commit
        else f"commit unknown (the clone is no git checkout; {file} is git blob {peer.get('baseline_blob')})"
        if peer
        else "no JaxMARL measurement"
    )
    logged = (
        "logged `returned_episode_returns` (SMAXLogWrapper's, per agent, averaged over steps, envs and agents; its "
        "`returned_won_episode` likewise, as its win rate)"
        if baseline.name == "pqn_vdn_rnn_smax"
        else "logged `returns` (SMAXLogWrapper's, per agent; its win rate likewise)"
        if baseline.name.endswith("smax")
        else "logged `returns` (MPELogWrapper's returned_episode_returns at each rollout's last step, the sum over "
        "agents, averaged over actors), divided by the number of agents"
        if baseline.name == "mappo_rnn_mpe"
        else "logged `returned_episode_returns` (the sum over agents), divided by the number of agents"
    )
    shown = ", ".join(f"{k} {v}" for k, v in config.items() if k not in ("num_seeds", "total_timesteps"))
    lines = [
        f"# {baseline.file}.py against JaxMARL's {file} on {baseline.env}",
        "",
        f"{describe(where)}. Written by `benchmarks/bench_marl.py`; each measurement is a fresh process with an "
        f"empty compile cache. Every measurement: `{os.path.basename(raw_path)}`.",
        "",
        f"Both at JaxMARL's own config (`{baseline.config}`, JaxMARL {version}): {shown}; "
        f"{config['total_timesteps']:,} env steps per seed (the yaml's TOTAL_TIMESTEPS overridden), "
        f"{config['num_seeds']} seeds vmapped in one `jax.jit(jax.vmap(train))` call, compile (lower + compile) "
        "and run timed apart. "
        f"Ours: {baseline.file}.py's make_train in this script's worker, after the harness's XLA flags, on one device. "
        "JaxMARL: `benchmarks/peers/jaxmarl_driver.py` (the unmodified file; its per-update callback to "
        "`wandb.log` runs, into a stand-in that records what it logs). env steps/s: env steps of all "
        "seeds per second of the compiled run. Final return per agent (the agents' mean reward summed over an "
        "episode), mean ± std over seeds: ours, the episodes that ended in the last 5% of updates; JaxMARL, its "
        f"{logged} over the last 5% of updates. Greedy eval: ours, 16 episodes after training; JaxMARL's (where "
        "it runs one), its last greedy test during training (episodes of its TEST_NUM_ENVS envs), per agent. "
        "Medians over pairs; each ratio is ours / JaxMARL within one pair (order alternating). Load: the 1-minute "
        "load average before each measurement.",
        "",
        "| side | seeds | env steps per seed | final return per agent | greedy eval | win rate | env steps/s "
        "| compile s | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for side, name in (("ours", f"{baseline.file}.py"), ("jaxmarl", f"JaxMARL {file}")):
        rs = runs[side]
        loads = [r["load_1min_before"] for r in rs]
        lines.append(
            f"| {name} | {rs[0]['num_seeds'] if rs else '–'} | {fmt(rs[0]['env_steps_per_seed'] if rs else None, ',')}"
            f" | {fmt(med(rs, 'final_return_mean'), '.2f')} ± {fmt(med(rs, 'final_return_std'), '.2f')} | "
            f"{fmt(med(rs, 'eval_return_mean'), '.2f')} | "
            f"{fmt(med(rs, 'eval_win_rate_mean' if side == 'ours' else 'final_win_rate_mean'), '.0%')} | "
            f"{fmt(med(rs, 'steps_per_s'), ',.0f')} | {fmt(med(rs, 'compile_s'), '.1f')} | "
            f"{fmt(min(loads) if loads else None, '.1f')} to {fmt(max(loads) if loads else None, '.1f')} |"
        )
    lines.append(
        f"| ours / JaxMARL ({len(pairs)} pair(s)) | | | | | | {fmt(ratio('steps_per_s'), '.2f')}x | "
        f"{fmt(ratio('compile_s'), '.2f')}x | |"
    )
    lines += ["", "How the two differ, and where they are alike:", ""] + [f"- {item}" for item in baseline.differences]
    write_markdown(path, lines)


if __name__ == "__main__":
    main()
