"""Times JaxMARL's own baselines at their own configs, as bench_marl.py times our files (BASELINES): on
MPE_simple_spread_v3 IPPO (baselines/IPPO/ippo_ff_mpe.py, config/ippo_ff_mpe.yaml), PQN-VDN
(baselines/QLearning/pqn_vdn_ff.py, config/alg/pqn_vdn_ff_mpe.yaml) and the recurrent MAPPO
(baselines/MAPPO/mappo_rnn_mpe.py); on SMAX the recurrent IPPO and MAPPO (ippo_rnn_smax.py, mappo_rnn_smax.py, whose
map bench_marl.py sets with --set MAP_NAME='3m'), whose SMAXLogWrapper logs `returns` (per agent) and `win_rate` of
the episodes that ended in each update (nan where none did), and the recurrent PQN-VDN (pqn_vdn_rnn.py,
config/alg/pqn_vdn_rnn_smax.yaml), which logs SMAXLogWrapper's infos averaged (`returned_episode_returns`,
`returned_won_episode`); on Overcooked the CNN IPPO (ippo_cnn_overcooked.py,
its layout set with --set ENV_KWARGS=...), whose LogWrapper's returns are per agent.

    python benchmarks/peers/jaxmarl_driver.py ippo_ff_mpe --jaxmarl /path/to/JaxMARL --seeds 4 --total-timesteps 2e6
    python benchmarks/peers/jaxmarl_driver.py pqn_vdn_ff_mpe --jaxmarl /path/to/JaxMARL --seeds 4 --total-timesteps 1e6

--jaxmarl is the root of a clone of https://github.com/FLAIROx/JaxMARL (its baselines/ are not in the pip
package; the environments and wrappers come from the installed `jaxmarl`, 0.2.0). The driver imports
`make_train` from the clone's unmodified baseline file and reads the config from its unmodified yaml
(with PyYAML when installed, else the small parser below; a number PyYAML leaves a string, as `1e7`, is
read as the number OmegaConf reads). Changes to that config:
--total-timesteps, --set KEY=VALUE, and SEED / NUM_SEEDS set to what runs (main() reads them,
make_train does not); the RESULT line lists them.

Timing, one configuration per process, as purejaxrl_driver.py times PureJAXRL:
  compile_s   = jax.jit(jax.vmap(train)).lower(keys).compile(), keys = split(PRNGKey(--seed), --seeds)
  run_s       = the compiled call until jax.block_until_ready
  steps_per_s = env steps of all seeds / run_s, env steps = TOTAL_TIMESTEPS rounded down to whole
                updates of NUM_ENVS * NUM_STEPS (make_train's NUM_UPDATES), per seed
The run includes ippo_ff_mpe.py's `jax.experimental.io_callback(wandb.log, ...)` of every update (pqn_vdn_ff.py's
`jax.debug.callback`, which it makes only when WANDB_MODE is not "disabled": set to "online" here), host round trips
that are part of JaxMARL's program as written (here wandb.log is the stand-in's). pqn_vdn_ff.py's run also includes
its greedy tests (TEST_DURING_TRAINING: 512 envs for 30 steps every 5% of updates), not counted in env steps.

Returns, from what JaxMARL itself logs. Every update the file passes `metric` to wandb.log: the
rollout's info averaged over its steps and actors (agents x envs), and loss figures. Its
`returned_episode_returns` is jaxmarl.wrappers.baselines.MPELogWrapper's: per agent, the return of
the env's last finished episode with every reward multiplied by the number of agents ("as per the
on-policy codebase"), so the average over agents is the SUM over agents of their returns. The
per-agent return ippo.py reports (the agents' mean reward summed over an episode) is that figure
divided by the number of agents. final_return_per_seed: per seed, the mean over the last 5% of
updates of logged returned_episode_returns / num_agents; final_return_mean / _std: over seeds. pqn_vdn_ff.py
also logs its latest greedy test's `test_returned_episode_returns` (the same sum over agents): eval_return_mean is
the last update's, per agent, averaged over seeds.
(ippo.py's final return is the mean of the episodes that ended in the last 5% of updates; JaxMARL's
figure averages, over every step of those updates, each env's last finished episode, which lags by
up to one episode.) The logged values are checked against the `metrics` make_train
returns (`callback_matches_metrics`; pqn_vdn_ff.py returns none: null).

io_callback under vmap: jax (0.10) batches an unordered io_callback sequentially, so the stand-in's
log is called once per seed per update with that seed's scalars (not once with [seeds] arrays);
records arrive update by update, seed by seed within an update. The driver handles both forms
(`callback_calls` and `callback_shapes` in RESULT say which happened): calls with a leading seeds
axis are one update of all seeds, scalar calls are grouped seeds at a time in arrival order.

Stand-ins, on the driver side (no file of the checkout is edited): `wandb` always (a module whose
`log` records each dict as numpy, and whose other attributes raise); `hydra` (main(...) returns the
function undecorated), `omegaconf` and matplotlib when not installed (imported, unused by make_train).
XLA_FLAGS gets what the algorithm files' configure_xla() sets (xla_setup.py).

Prints one line `RESULT {json}`.
"""

import argparse
import ast
import copy
import importlib
import importlib.util
import json
import os
import platform
import re
import sys
import time
from typing import NamedTuple

from purejaxrl_driver import checkout_commit  # the same question of a clone
from stand_ins import stand_in
from xla_setup import set_xla_flags

FINAL_FRACTION = 0.05


class Peer(NamedTuple):
    source: str  # the baseline file, in the checkout
    config: str  # its yaml
    returns: str = "returned_episode_returns"  # the key its wandb.log call logs the episode returns under
    summed: bool = True  # that figure is MPELogWrapper's, the sum over agents (else per agent: SMAXLogWrapper's)
    win_rate: str = ""  # the key it logs its win rate under (SMAX), if it does
    layout: bool = False  # its main() turns ENV_KWARGS' layout name into that Overcooked layout before make_train


BASELINES = {
    "ippo_ff_mpe": Peer("baselines/IPPO/ippo_ff_mpe.py", "baselines/IPPO/config/ippo_ff_mpe.yaml"),
    "pqn_vdn_ff_mpe": Peer("baselines/QLearning/pqn_vdn_ff.py", "baselines/QLearning/config/alg/pqn_vdn_ff_mpe.yaml"),
    "ippo_rnn_smax": Peer(
        "baselines/IPPO/ippo_rnn_smax.py", "baselines/IPPO/config/ippo_rnn_smax.yaml", "returns", False, "win_rate"
    ),
    # logs `returns`: MPELogWrapper's returned_episode_returns at the rollout's last step, averaged over actors
    "mappo_rnn_mpe": Peer(
        "baselines/MAPPO/mappo_rnn_mpe.py", "baselines/MAPPO/config/mappo_homogenous_rnn_mpe.yaml", "returns"
    ),
    # logs `returned_episode_returns`: LogWrapper's, per agent (Overcooked's agents share the team's reward)
    "ippo_cnn_overcooked": Peer(
        "baselines/IPPO/ippo_cnn_overcooked.py",
        "baselines/IPPO/config/ippo_cnn_overcooked.yaml",
        summed=False,
        layout=True,
    ),
    "mappo_rnn_smax": Peer(
        "baselines/MAPPO/mappo_rnn_smax.py",
        "baselines/MAPPO/config/mappo_homogenous_rnn_smax.yaml",
        "returns",
        False,
        "win_rate",
    ),
    # logs the mean over steps, envs and agents of SMAXLogWrapper's infos: per agent, its won battles as 0/1
    "pqn_vdn_rnn_smax": Peer(
        "baselines/QLearning/pqn_vdn_rnn.py",
        "baselines/QLearning/config/alg/pqn_vdn_rnn_smax.yaml",
        summed=False,
        win_rate="returned_won_episode",
    ),
}
NUMBER = re.compile(r"^[-+]?(\d[\d_]*)?\.?\d*([eE][-+]?\d+)?$")


def insert_stand_ins(logged: list) -> list:
    """wandb always (its log appends to `logged`); hydra, omegaconf, matplotlib when not installed."""
    import numpy as np

    def log(metric, *args, **kwargs):
        logged.append({k: np.asarray(v) for k, v in metric.items()})

    stand_in("wandb", log=log)
    inserted = ["wandb (log records each metric dict)"]
    if importlib.util.find_spec("hydra") is None:
        stand_in("hydra", main=lambda *args, **kwargs: lambda function: function)
        inserted.append("hydra (main returns the function undecorated)")
    if importlib.util.find_spec("omegaconf") is None:
        stand_in("omegaconf")
        inserted.append("omegaconf")
    if importlib.util.find_spec("matplotlib") is None:
        stand_in("matplotlib")
        stand_in("matplotlib.pyplot")
        inserted.append("matplotlib")
    return inserted


def literal(text: str):
    """A yaml scalar as OmegaConf reads it: numbers (1e7 too), booleans, null, quoted strings, {} and []."""
    text = text.strip()
    if NUMBER.match(text) and any(c.isdigit() for c in text):
        value = float(text.replace("_", ""))
        return int(value) if re.fullmatch(r"[-+]?[\d_]+", text) else value
    lowered = {"true": True, "false": False, "null": None, "~": None}
    if text.lower() in lowered:
        return lowered[text.lower()]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def yaml_config(path: str) -> dict:
    """The baseline's yaml: PyYAML when installed (strings that are numbers to OmegaConf made numbers), else
    the flat `"KEY": value` lines JaxMARL's configs are written in."""
    with open(path) as f:
        text = f.read()
    try:
        import yaml
    except ImportError:
        config = {}
        for line in text.splitlines():
            line = line.split(" #")[0].strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition(":")
            config[literal(key)] = literal(value)
        return config
    config = yaml.safe_load(text)
    return {k: literal(v) if isinstance(v, str) and NUMBER.match(v.strip()) else v for k, v in config.items()}


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version(), "cpu_cores": os.cpu_count()}
    for package in ("jax", "jaxlib", "flax", "optax", "distrax", "chex", "jaxmarl"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return out


def blob_id(path: str):
    """`git hash-object` of a file: names the baseline's version even when the clone is no git checkout."""
    import hashlib

    with open(path, "rb") as f:
        data = f.read()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def logged_per_seed(logged: list, seeds: int, updates: int, name: str):
    """The logged `name` as [seeds, updates], from calls with [seeds] arrays or per-seed scalar calls."""
    import numpy as np

    values = [np.asarray(record[name]) for record in logged]
    if values and all(v.shape == (seeds,) for v in values) and len(values) == updates:
        return np.stack(values, 1)  # one call per update, the seeds batched
    if values and all(v.size == 1 for v in values) and len(values) == updates * seeds:
        return np.array([v.item() for v in values]).reshape(updates, seeds).T  # update by update, seed by seed
    shapes = sorted({v.shape for v in values})
    raise SystemExit(
        f"unexpected wandb.log calls: {len(values)} with shapes {shapes} ({seeds} seeds, {updates} updates)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("baseline", choices=sorted(BASELINES))
    parser.add_argument("--jaxmarl", required=True, help="root of a clone of github.com/FLAIROx/JaxMARL")
    parser.add_argument("--seeds", type=int, default=1, help="seeds vmapped in one jitted call")
    parser.add_argument("--seed", type=int, default=0, help="PRNG seed the per-seed keys are split from")
    parser.add_argument("--total-timesteps", type=float, default=None, help="override TOTAL_TIMESTEPS")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config entry (VALUE read as a Python literal when it is one)",
    )
    args = parser.parse_args()

    source = os.path.abspath(args.jaxmarl)
    peer = BASELINES[args.baseline]
    path, config_path = os.path.join(source, peer.source), os.path.join(source, peer.config)
    for needed in (path, config_path):
        if not os.path.isfile(needed):
            raise SystemExit(f"{needed} not found: --jaxmarl must be the root of a JaxMARL checkout")

    set_xla_flags()
    logged = []
    adapters = [f"XLA_FLAGS={os.environ['XLA_FLAGS']}"]
    adapters += [f"stand-in module {name}" for name in insert_stand_ins(logged)]
    import jax
    import jax.experimental  # the baseline calls jax.experimental.io_callback
    import numpy as np

    spec = importlib.util.spec_from_file_location(args.baseline, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[args.baseline] = module
    spec.loader.exec_module(module)

    defaults = yaml_config(config_path)
    config = dict(defaults)
    if args.total_timesteps is not None:
        config["TOTAL_TIMESTEPS"] = args.total_timesteps
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass
        config[key] = value
    config["SEED"], config["NUM_SEEDS"] = args.seed, args.seeds  # main() reads them; make_train does not
    q_learning = args.baseline.startswith("pqn_vdn")
    if q_learning:
        config["WANDB_MODE"] = "online"  # its callback to wandb.log (the stand-in's) is made only then
    changed = {k: v for k, v in config.items() if k not in defaults or defaults[k] != v}

    keys = jax.random.split(jax.random.PRNGKey(args.seed), args.seeds)
    made = copy.deepcopy(config)
    if peer.layout:  # as its main() does
        from jaxmarl.environments.overcooked import Overcooked, overcooked_layouts

        made["ENV_KWARGS"]["layout"] = overcooked_layouts[made["ENV_KWARGS"]["layout"]]
        # The file calls env.action_space() without the agent jaxmarl's Overcooked requires (0.2.0 and the
        # checkout's own): every agent's is the same, so a default agent lets it run as written.
        action_space = Overcooked.action_space
        Overcooked.action_space = lambda self, agent="agent_0": action_space(self, agent)
        adapters.append("Overcooked.action_space(agent='agent_0' by default): the file calls it without an agent")
    if q_learning:  # make_train(config, env), the env as its single_run makes it (MPELogWrapper for MPE)
        env = module.env_from_config(copy.deepcopy(made))[0]
        train, num_agents = module.make_train(made, env), env.num_agents  # make_train adds NUM_UPDATES
    else:
        train = module.make_train(made)  # make_train adds NUM_ACTORS, NUM_UPDATES, MINIBATCH_SIZE to the dict
        num_agents = made["NUM_ACTORS"] // made["NUM_ENVS"]
    updates = int(made["NUM_UPDATES"])
    steps_per_seed = updates * made["NUM_ENVS"] * made["NUM_STEPS"]
    start = time.perf_counter()
    lowered = jax.jit(jax.vmap(train)).lower(keys)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    out = jax.block_until_ready(compiled(keys))
    run_s = time.perf_counter() - compiled_at

    logged_returns = logged_per_seed(logged, args.seeds, updates, peer.returns)
    returned = (
        np.asarray(out["metrics"][peer.returns])
        if isinstance(out, dict) and peer.returns in out.get("metrics", {})
        else None
    )  # [seeds, updates] where make_train returns what it logs (ippo_ff_mpe.py)
    tests = logged_per_seed(logged, args.seeds, updates, "test_returned_episode_returns") if q_learning else None
    per_agent = logged_returns / num_agents if peer.summed else logged_returns
    last = max(1, int(np.ceil(updates * FINAL_FRACTION)))
    final = np.nanmean(per_agent[:, -last:], axis=1)  # SMAX's updates with no episode ended log nan
    win_rates = logged_per_seed(logged, args.seeds, updates, peer.win_rate) if peer.win_rate else None
    wins = None if win_rates is None else np.nanmean(win_rates[:, -last:], axis=1)
    result = {
        "bench": f"jaxmarl_{args.baseline}",
        "env": " ".join(
            [config["ENV_NAME"], config.get("MAP_NAME", config.get("ENV_KWARGS", {}).get("layout", ""))]
        ).strip(),
        "num_seeds": args.seeds,
        "num_agents": int(num_agents),
        "total_timesteps": config["TOTAL_TIMESTEPS"],
        "num_updates": updates,
        "env_steps_per_seed": steps_per_seed,
        "lower_s": lowered_at - start,
        "compile_s": compiled_at - start,
        "run_s": run_s,
        "steps_per_s": steps_per_seed * args.seeds / run_s,
        "final_return_mean": float(np.mean(final)),
        "final_return_std": float(np.std(final)),
        "final_return_per_seed": [float(x) for x in final],
        "final_logged_return_mean": float(np.nanmean(logged_returns[:, -last:])),  # JaxMARL's figure
        "final_win_rate_per_seed": None if wins is None else [float(x) for x in wins],
        "final_win_rate_mean": None if wins is None else float(np.mean(wins)),
        "final_updates": last,
        "eval_return_mean": None
        if tests is None
        else float(np.mean(tests[:, -1]) / (num_agents if peer.summed else 1)),
        "callback_calls": len(logged),
        "callback_shapes": sorted({str(np.shape(r[peer.returns])) for r in logged}),
        "callback_matches_metrics": None
        if returned is None
        else bool(np.allclose(logged_returns, returned, rtol=1e-6, atol=1e-6)),
        "config_changes": {k: repr(v) for k, v in changed.items()},
        "adapters": adapters,
        "jaxmarl_commit": checkout_commit(source),
        "baseline_blob": blob_id(path),
        "backend": jax.default_backend(),
        **versions(),
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
