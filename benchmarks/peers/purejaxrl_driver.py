"""Times PureJAXRL's own ppo.py or dqn.py on its CartPole-v1 config, as bench_speed.py times ours,
or its ppo_continuous_action.py on its Brax config (hopper), as bench_brax.py times ours.

    python benchmarks/peers/purejaxrl_driver.py ppo --purejaxrl /path/to/purejaxrl --seeds 8
    python benchmarks/peers/purejaxrl_driver.py dqn --purejaxrl /path/to/purejaxrl --total-timesteps 1e5
    python benchmarks/peers/purejaxrl_driver.py ppo_continuous_action --purejaxrl PATH --total-timesteps 2e6

--purejaxrl is the root of a clone of https://github.com/luchris429/purejaxrl (measured at commit
31756b1). The driver imports `make_train` from its unmodified purejaxrl/ppo.py or dqn.py and uses
the `config = {...}` dict written in that same file (read with `ast`, not copied here). Changes to
that config: DEBUG=False for ppo.py (its default prints every finished episode from inside the
jitted loop), and whatever --total-timesteps / --set KEY=VALUE give; the RESULT line lists them.

Timing, one configuration per process:
  compile_s   = jax.jit(jax.vmap(train)).lower(keys).compile()   (lower_s: the tracing part)
  run_s       = the compiled call until jax.block_until_ready
  steps_per_s = env steps of all seeds / run_s
  final_return_mean: per seed, ppo: the mean return of the episodes that ended in the last 5% of
  updates (as algorithms/*.py's final_returns); dqn: its "returns" metric (the return of each env's
  last finished episode, averaged over envs) averaged over the last 5% of updates; then the mean.

Adapters, all on the driver side (no file of the checkout is edited):
  * gymnax >= 1.0 returns six values from `step` (terminated and truncated apart); PureJAXRL
    unpacks five. ppo.py wraps gymnax.make's env in its own 5-value wrappers, so the env it gets
    is wrapped in a 5-value adapter; dqn.py uses gymnax's own (6-value) LogWrapper, so the adapter
    goes around that. done = terminated | truncated, gymnax's pre-1.0 meaning. The adapter is
    gymnax.wrappers.LegacyStepAPIWrapper where gymnax has it, else the small one below.
  * ppo_continuous_action.py steps Brax through its own BraxGymnaxWrapper (no adapter): it reports
    done = termination or time limit and bootstraps through neither (our brax/NAME does through
    the time limit). Its `config` targets hopper with Brax's positional backend.
  * `jax.tree_map` (removed from jax) is aliased to `jax.tree_util.tree_map` if missing.
  * wrappers.py imports brax and navix, dqn.py imports wandb, all at module level and unused on
    CartPole: empty stand-in modules are inserted for those that are not installed.
  * dqn.py needs flashbax (`pip install flashbax`).
  * XLA_FLAGS gets what the algorithm files' configure_xla() sets (xla_setup.py): XLA's default
    CPU scheduler has deadlocked vmapped PureJAXRL PPO on CPU.

Prints one line `RESULT {json}`.
"""

import argparse
import ast
import importlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
import types

from stand_ins import stand_in
from xla_setup import set_xla_flags

FINAL_FRACTION = 0.05


def insert_stand_ins() -> list:
    """Empty modules for brax, navix and wandb when they are not installed (imported, never used)."""
    inserted = []
    for package, submodules in (
        ("brax", ["brax.envs", "brax.envs.wrappers", "brax.envs.wrappers.training"]),
        ("navix", []),
        ("wandb", []),
    ):
        if importlib.util.find_spec(package) is None:
            for name in [package, *submodules]:
                stand_in(name)
            inserted.append(package)
    return inserted


def legacy_step_wrapper():
    """gymnax's 5-value adapter if it ships one, else an equivalent."""
    try:
        from gymnax.wrappers import LegacyStepAPIWrapper

        return LegacyStepAPIWrapper
    except ImportError:
        pass
    import jax.numpy as jnp

    class FiveValueStep:
        def __init__(self, env):
            self._env = env

        def __getattr__(self, name):
            if name.startswith("__") or name == "_env":
                raise AttributeError(name)
            return getattr(self._env, name)

        def reset(self, key, params=None):
            return self._env.reset(key, params)

        def step(self, key, state, action, params=None):
            obs, state, reward, terminated, truncated, info = self._env.step(key, state, action, params)
            return obs, state, reward, jnp.logical_or(terminated, truncated), info

    return FiveValueStep


def file_config(path: str) -> dict:
    """The one `config = {...}` literal in a PureJAXRL file."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Dict)
        and any(isinstance(t, ast.Name) and t.id == "config" for t in node.targets)
    ]
    if len(found) != 1:
        raise SystemExit(f"expected one `config = {{...}}` dict in {path}, found {len(found)}")
    return ast.literal_eval(found[0])


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version(), "cpu_cores": os.cpu_count()}
    for package in ("jax", "jaxlib", "flax", "optax", "gymnax", "distrax", "chex", "flashbax"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return out


def checkout_commit(path: str):
    """The clone's commit; None when `path` is no git checkout of its own (not the repository around it)."""
    try:
        git = ["git", "-C", path, "rev-parse", "--show-toplevel", "HEAD"]
        out = subprocess.run(git, capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    if len(out) != 2 or os.path.realpath(out[0]) != os.path.realpath(path):
        return None
    return out[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("algorithm", choices=["ppo", "dqn", "ppo_continuous_action"])
    parser.add_argument("--purejaxrl", required=True, help="root of a clone of github.com/luchris429/purejaxrl")
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
    parser.add_argument("--debug", action="store_true", help="keep ppo.py's DEBUG printing")
    args = parser.parse_args()

    source = os.path.abspath(args.purejaxrl)
    if os.path.isfile(os.path.join(source, "purejaxrl", f"{args.algorithm}.py")):
        source = os.path.join(source, "purejaxrl")
    path = os.path.join(source, f"{args.algorithm}.py")
    if not os.path.isfile(path):
        raise SystemExit(f"{path} not found: --purejaxrl must be the root of a PureJAXRL checkout")
    if args.algorithm == "dqn" and importlib.util.find_spec("flashbax") is None:
        raise SystemExit("PureJAXRL's dqn.py needs flashbax: pip install flashbax")

    set_xla_flags()
    adapters = [f"XLA_FLAGS={os.environ['XLA_FLAGS']}"]
    adapters += [f"stand-in module {name}" for name in insert_stand_ins()]
    import jax
    import numpy as np

    if not hasattr(jax, "tree_map"):
        jax.tree_map = jax.tree_util.tree_map
        adapters.append("jax.tree_map = jax.tree_util.tree_map")

    sys.path.insert(0, source)  # ppo.py does `from wrappers import ...`
    module = importlib.import_module(args.algorithm)

    from importlib import metadata

    if int(metadata.version("gymnax").split(".")[0]) >= 1 and args.algorithm != "ppo_continuous_action":
        legacy = legacy_step_wrapper()
        if args.algorithm == "ppo":
            real_gymnax = module.gymnax

            def make(*a, **k):
                env, params = real_gymnax.make(*a, **k)
                return legacy(env), params

            module.gymnax = types.SimpleNamespace(**{**vars(real_gymnax), "make": make})
            adapters.append(f"ppo.gymnax.make -> {legacy.__name__}(env)")
        else:
            log_wrapper = module.LogWrapper
            module.LogWrapper = lambda env: legacy(log_wrapper(env))
            adapters.append(f"dqn.LogWrapper -> {legacy.__name__}(LogWrapper(env))")

    defaults = file_config(path)
    config = dict(defaults)
    if args.algorithm in ("ppo", "ppo_continuous_action") and not args.debug:
        config["DEBUG"] = False
    if args.total_timesteps is not None:
        config["TOTAL_TIMESTEPS"] = args.total_timesteps
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass
        config[key] = value
    if "NUM_SEEDS" in config:  # dqn.py's main() reads it; make_train does not
        config["NUM_SEEDS"] = args.seeds
    changed = {k: v for k, v in config.items() if k not in defaults or defaults[k] != v}

    keys = jax.random.split(jax.random.PRNGKey(args.seed), args.seeds)
    train = module.make_train(dict(config))  # make_train adds entries to the dict it is given
    start = time.perf_counter()
    lowered = jax.jit(jax.vmap(train)).lower(keys)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    out = jax.block_until_ready(compiled(keys))
    run_s = time.perf_counter() - compiled_at

    metrics = jax.tree_util.tree_map(np.asarray, out["metrics"])
    if args.algorithm in ("ppo", "ppo_continuous_action"):
        returns = metrics["returned_episode_returns"]  # [seeds, updates, steps, envs]
        ended = metrics["returned_episode"].astype(bool)
        steps_per_seed = int(np.prod(returns.shape[1:]))
        last = max(1, int(np.ceil(returns.shape[1] * FINAL_FRACTION)))
        returns, ended = returns[:, -last:], ended[:, -last:]
        with np.errstate(invalid="ignore", divide="ignore"):
            final = np.where(ended, returns, 0.0).sum(axis=(1, 2, 3)) / ended.sum(axis=(1, 2, 3))
    else:
        returns = metrics["returns"]  # [seeds, updates]
        steps_per_seed = int(metrics["timesteps"][0, -1])
        last = max(1, int(np.ceil(returns.shape[1] * FINAL_FRACTION)))
        final = returns[:, -last:].mean(axis=1)
    result = {
        "bench": f"purejaxrl_{args.algorithm}",
        "env": config["ENV_NAME"],
        "num_seeds": args.seeds,
        "env_steps_per_seed": steps_per_seed,
        "lower_s": lowered_at - start,
        "compile_s": compiled_at - start,
        "run_s": run_s,
        "steps_per_s": steps_per_seed * args.seeds / run_s,
        "final_return_mean": float(np.mean(final)),
        "final_return_per_seed": [float(x) for x in final],
        "config_changes": {k: repr(v) for k, v in changed.items()},
        "adapters": adapters,
        "purejaxrl_commit": checkout_commit(os.path.dirname(source)),
        **versions(),
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
