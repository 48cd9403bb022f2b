"""Times rejax (pip package, 0.1.3) at rejax's own gymnax configs: SAC and TD3 on Pendulum-v1, PPO and DQN
on CartPole-v1.

    python benchmarks/peers/rejax_driver.py sac --rejax /path/to/rejax --seeds 1
    python benchmarks/peers/rejax_driver.py td3 --rejax /path/to/rejax --total-timesteps 5000
    python benchmarks/peers/rejax_driver.py ppo --rejax /path/to/rejax          # CartPole-v1

--rejax is the root of a clone of https://github.com/keraJLi/rejax (tag v0.1.3). The pip package does
not ship the configs, so the hyperparameters are read from the checkout's
configs/gymnax/<env-config>.yaml, section <algorithm> (pendulum.yaml for sac/td3, cartpole.yaml for
ppo/dqn unless --env-config says otherwise), and passed unchanged to `rejax.get_algo(name).create`,
eval_freq included, apart from --total-timesteps / --eval-freq / --set KEY=VALUE (listed in RESULT).

Timing, one configuration per process, as benchmarks/peers/purejaxrl_driver.py times PureJAXRL:
  compile_s   = jax.jit(jax.vmap(algo.train)).lower(keys).compile()
  run_s       = the compiled call until jax.block_until_ready. rejax evaluates inside train: every
                eval_freq env steps it runs 128 episodes (200 steps each on Pendulum), so at the
                yaml's eval_freq of 100 on Pendulum a run of 10k training steps also takes 2.6M
                evaluation steps. eval_env_steps_per_seed counts them; `--eval-freq final` keeps
                only one evaluation, at the end.
  steps_per_s = training env steps of all seeds / run_s (evaluation steps not counted)
  final_return_mean: per seed, the mean return of the 128 episodes of the last evaluation; then
                the mean over seeds.

Adapter: rejax 0.1.3 unpacks five values from `env.step`, while gymnax >= 1.0 returns six
(terminated and truncated apart) and rejax fails with "too many values to unpack". On gymnax >= 1.0
the env is therefore made here with gymnax.make and handed to rejax wrapped in FiveValueStep below
(done = terminated | truncated, gymnax's pre-1.0 meaning). gymnax's own LegacyStepAPIWrapper cannot
be used: rejax deep-copies its config, env included, and that wrapper's attribute forwarding
recurses without end under copy.deepcopy. Only gymnax environment names are supported.
XLA_FLAGS gets what the algorithm files' configure_xla() sets (xla_setup.py, beside this file).
The script imports no algorithm file; it runs under any interpreter with rejax.

Prints one line `RESULT {json}`.
"""

import argparse
import json
import os
import platform
import subprocess
import time

from xla_setup import set_xla_flags

DEFAULT_ENV_CONFIG = {"sac": "pendulum", "td3": "pendulum", "ppo": "cartpole", "dqn": "cartpole"}


class FiveValueStep:
    """gymnax >= 1.0 env with the pre-1.0 `step`: (obs, state, reward, done, info)."""

    def __init__(self, env):
        self._env = env

    def __getattr__(self, name):
        if name.startswith("__") or name == "_env":  # copy/deepcopy look these up before _env exists
            raise AttributeError(name)
        return getattr(self._env, name)

    def reset(self, key, params=None):
        return self._env.reset(key, params)

    def step(self, key, state, action, params=None):
        import jax.numpy as jnp

        obs, state, reward, terminated, truncated, info = self._env.step(key, state, action, params)
        return obs, state, reward, jnp.logical_or(terminated, truncated), info


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version(), "cpu_cores": os.cpu_count()}
    for package in ("rejax", "jax", "jaxlib", "flax", "optax", "gymnax", "distrax", "chex"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return out


def checkout_commit(path: str):
    try:
        out = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("algorithm", choices=sorted(DEFAULT_ENV_CONFIG))
    parser.add_argument("--rejax", required=True, help="root of a clone of github.com/keraJLi/rejax (for configs/)")
    parser.add_argument(
        "--env-config",
        default=None,
        help="configs/gymnax/<NAME>.yaml (default: pendulum for sac/td3, cartpole for ppo/dqn)",
    )
    parser.add_argument("--seeds", type=int, default=1, help="seeds vmapped in one jitted call")
    parser.add_argument("--seed", type=int, default=0, help="PRNG seed the per-seed keys are split from")
    parser.add_argument("--total-timesteps", type=int, default=None, help="override total_timesteps")
    parser.add_argument(
        "--eval-freq",
        default=None,
        help="override eval_freq: a number of env steps, or `final` for one evaluation at the end",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override one config entry (VALUE read as YAML)"
    )
    args = parser.parse_args()

    import yaml

    name = args.env_config or DEFAULT_ENV_CONFIG[args.algorithm]
    path = os.path.join(os.path.abspath(args.rejax), "configs", "gymnax", f"{name}.yaml")
    if not os.path.isfile(path):
        raise SystemExit(f"{path} not found: --rejax must be the root of a rejax checkout")
    with open(path) as f:
        sections = yaml.safe_load(f)
    if args.algorithm not in sections:
        raise SystemExit(f"{path} has no `{args.algorithm}` section (it has {sorted(sections)})")
    defaults = sections[args.algorithm]
    config = dict(defaults)
    if args.total_timesteps is not None:
        config["total_timesteps"] = args.total_timesteps
    if args.eval_freq == "final":
        config["eval_freq"] = config["total_timesteps"]
        config["skip_initial_evaluation"] = True
    elif args.eval_freq is not None:
        config["eval_freq"] = int(args.eval_freq)
    for item in args.set:
        key, _, value = item.partition("=")
        config[key] = yaml.safe_load(value)
    changed = {k: v for k, v in config.items() if k not in defaults or defaults[k] != v}

    set_xla_flags()
    adapters = [f"XLA_FLAGS={os.environ['XLA_FLAGS']}"]
    from importlib import metadata

    import gymnax
    import jax
    import numpy as np
    import rejax

    env_name = config["env"]
    if int(metadata.version("gymnax").split(".")[0]) >= 1:
        env, env_params = gymnax.make(config.pop("env"))
        env_params = env_params.replace(**config.pop("env_params", {}))
        config["env"], config["env_params"] = FiveValueStep(env), env_params
        adapters.append(f"env=FiveValueStep(gymnax.make({env_name!r}))")
    algo = rejax.get_algo(args.algorithm).create(**config)

    keys = jax.random.split(jax.random.PRNGKey(args.seed), args.seeds)
    start = time.perf_counter()
    lowered = jax.jit(jax.vmap(algo.train)).lower(keys)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    state, (lengths, returns) = jax.block_until_ready(compiled(keys))
    run_s = time.perf_counter() - compiled_at

    lengths, returns = np.asarray(lengths), np.asarray(returns)  # [seeds, evaluations, 128 episodes]
    steps_per_seed = int(np.asarray(state.global_step)[0])
    final = returns[:, -1].mean(axis=-1)
    result = {
        "bench": f"rejax_{args.algorithm}",
        "env": env_name,
        "num_seeds": args.seeds,
        "env_steps_per_seed": steps_per_seed,
        "eval_env_steps_per_seed": int(lengths[0].sum()),
        "num_evals": int(returns.shape[1]),
        "lower_s": lowered_at - start,
        "compile_s": compiled_at - start,
        "run_s": run_s,
        "steps_per_s": steps_per_seed * args.seeds / run_s,
        "final_return_mean": float(np.mean(final)),
        "final_return_per_seed": [float(x) for x in final],
        "config_file": f"configs/gymnax/{name}.yaml",
        "config_changes": {k: repr(v) for k, v in changed.items()},
        "adapters": adapters,
        "rejax_commit": checkout_commit(args.rejax),
        **versions(),
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
