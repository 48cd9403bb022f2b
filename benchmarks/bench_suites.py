"""What the suite adapters cost: env steps/s of `--env-name SUITE/NAME` (registered with gymnax by the run
harness, stepped by the algorithm files' VecEnv, auto-reset from fresh episodes included) against the
suite's own vmapped step without any reset, at the same number of envs, random actions.

    python benchmarks/bench_suites.py                       # every suite installed, 16 and 256 envs
    python benchmarks/bench_suites.py --envs xminigrid/MiniGrid-DoorKey-5x5 --num-envs 256,1024

Per env and env count, in one process, alternating for --rounds rounds (the table keeps each
one's best round):
  suite      the suite's raw env: `jax.vmap` of its step over the envs, 64 steps in a `lax.scan`,
             no resets (episodes that end keep stepping, as cheap as any step), keys split per step
  adapter    the harness's pooled env (suites.vec_env) over algorithms/ppo.py's VecEnv
             (ppo_continuous.py for Brax): 64 steps in a `lax.scan` as a rollout steps them, every
             ended episode replaced by the env's reserved fresh episode, one reserve redrawn per
             `envs_per_reset` envs at every step (at least one)
  per-env    the file's own VecEnv (gymnax's auto-reset: a fresh episode per env per step), for
             what the reserves save
And the mean return of a uniformly random policy on each env, the floor learning must beat.
Writes results/suites_<backend>.{md,jsonl}.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, describe, load_algorithm, machine, suites, write_markdown, xla  # noqa: E402

STEPS = 64
DEFAULT_ENVS = (
    "xminigrid/MiniGrid-DoorKey-5x5",
    "brax/inverted_pendulum",
    "brax/hopper",
    "craftax/Craftax-Classic-Symbolic-v1",
)


def raw_suite(env_name: str):
    """(reset(key) -> state, step(key, state, action) -> state, action sampler) of the suite itself."""
    import jax

    suite, _, name = env_name.partition("/")
    if suite == "brax":
        from brax import envs

        base, _, backend = name.partition(":")
        env = envs.get_environment(base, **({"backend": backend} if backend else {}))
        sample = lambda key, n: jax.random.uniform(key, (n, env.action_size), minval=-1, maxval=1)  # noqa: E731
        return env.reset, lambda key, state, action: env.step(state, action), sample
    sample_discrete = lambda num_actions: lambda key, n: jax.random.randint(key, (n,), 0, num_actions)  # noqa: E731
    if suite == "craftax":
        from craftax.craftax_env import make_craftax_env_from_name

        env = make_craftax_env_from_name(name, auto_reset=False)
        params = env.default_params
        reset = lambda key: env.reset_env(key, params)[1]  # noqa: E731
        return reset, lambda key, state, action: env.step_env(key, state, action, params)[1], sample_discrete(17)
    import xminigrid

    env, params = xminigrid.make(name)
    reset = lambda key: env.reset(params, key)  # noqa: E731
    step = lambda key, timestep, action: env.step(params, timestep, action)  # noqa: E731
    return reset, step, sample_discrete(env.num_actions(params))


def suite_program(env_name: str, num_envs: int):
    import jax

    reset, step, sample = raw_suite(env_name)

    def run(state, key):
        def body(state, key):
            action_key, step_key = jax.random.split(key)
            keys = jax.random.split(step_key, num_envs)
            return jax.vmap(step)(keys, state, sample(action_key, num_envs)), None

        return jax.lax.scan(body, state, jax.random.split(key, STEPS))[0]

    state = jax.jit(jax.vmap(reset))(jax.random.split(jax.random.PRNGKey(0), num_envs))
    return jax.jit(run), state


def adapter_program(env_name: str, num_envs: int, pool: bool):
    import jax

    module = load_algorithm("ppo_continuous" if env_name.startswith("brax/") else "ppo")
    suites.register(env_name)
    # pooled: the harness's env (one reserve redrawn per envs_per_reset envs and step); else the
    # file's own VecEnv, gymnax's auto-reset: a fresh episode for every env at every step.
    vec = suites.vec_env(module, env_name, num_envs) if pool else module.VecEnv(env_name, num_envs)
    _, _, sample = raw_suite(env_name)

    def run(state, key):
        step_key, action_key = jax.random.split(key)
        actions = jax.vmap(sample, in_axes=(0, None))(jax.random.split(action_key, STEPS), num_envs)

        def body(state, inputs):
            key_t, action_t = inputs
            return vec.step(key_t, state, action_t).state, None

        return jax.lax.scan(body, state, (jax.random.split(step_key, STEPS), actions))[0]

    _, state = jax.jit(vec.reset)(jax.random.PRNGKey(0))
    return jax.jit(run), state, getattr(vec, "num_resets", num_envs)


def timed(program, state, rounds_key):
    import jax

    start = time.perf_counter()
    jax.block_until_ready(program(state, rounds_key))
    return time.perf_counter() - start


def measure(env_name: str, num_envs: int, rounds: int) -> dict:
    import jax

    programs = {"suite": suite_program(env_name, num_envs)}
    adapter, state, fresh_per_step = adapter_program(env_name, num_envs, pool=True)
    programs["adapter"] = (adapter, state)
    if fresh_per_step < num_envs:
        per_env, state, _ = adapter_program(env_name, num_envs, pool=False)
        programs["per-env"] = (per_env, state)
    compile_s = {}
    for label, (program, state) in programs.items():
        start = time.perf_counter()
        jax.block_until_ready(program(state, jax.random.PRNGKey(1)))  # compiles
        compile_s[label] = time.perf_counter() - start
    best = {label: float("inf") for label in programs}
    for r in range(rounds):
        for label, (program, state) in programs.items():
            best[label] = min(best[label], timed(program, state, jax.random.PRNGKey(2 + r)))
    steps = {label: STEPS * num_envs / seconds for label, seconds in best.items()}
    record = {
        "env_name": env_name,
        "num_envs": num_envs,
        "fresh_episodes_per_step": fresh_per_step,
        "steps_per_s": steps,
        "compile_s": compile_s,
        "adapter_cost": 1 - steps["adapter"] / steps["suite"],
    }
    print(json.dumps(record), flush=True)
    return record


def random_policy_return(env_name: str, num_envs: int = 64, num_steps: int = 5_000) -> dict:
    """Mean return of the episodes a uniformly random policy finishes in `num_steps` steps of
    `num_envs` envs (through VecEnv, as the algorithms see the env): the floor a learner must beat."""
    import jax
    import jax.numpy as jnp

    module = load_algorithm("ppo_continuous" if env_name.startswith("brax/") else "ppo")
    suites.register(env_name)
    vec = suites.vec_env(module, env_name, num_envs)
    _, _, sample = raw_suite(env_name)
    chunk = 100

    def run(carry, key):
        state, episode_return, total, finished = carry
        step_key, action_key = jax.random.split(key)
        actions = jax.vmap(sample, in_axes=(0, None))(jax.random.split(action_key, chunk), num_envs)

        def body(carry, inputs):
            state, episode_return, total, finished = carry
            step = vec.step(inputs[0], state, inputs[1])
            episode_return = episode_return + step.reward
            done = step.terminated | step.truncated
            total = total + jnp.where(done, episode_return, 0.0).sum()
            return (step.state, jnp.where(done, 0.0, episode_return), total, finished + done.sum()), None

        keys = jax.random.split(step_key, chunk)
        return jax.lax.scan(body, (state, episode_return, total, finished), (keys, actions))[0], None

    _, state = vec.reset(jax.random.PRNGKey(0))
    carry = (state, jnp.zeros(num_envs), jnp.float32(0), jnp.int32(0))
    keys = jax.random.split(jax.random.PRNGKey(1), num_steps // chunk)
    _, _, total, finished = jax.jit(lambda c, k: jax.lax.scan(run, c, k)[0])(carry, keys)
    record = {"env_name": env_name, "random_return": float(total / finished), "episodes": int(finished)}
    print(json.dumps(record), flush=True)
    return record


def per_step(fresh: float) -> str:
    """Fresh episodes per vectorized step as the pool draws them: "8", or "1/4" (one every 4 steps)."""
    return f"{fresh:g}" if fresh >= 1 else f"1/{round(1 / fresh)}"


def write_table(records: list, randoms: list, path: str, about: str) -> None:
    lines = [
        "# Suite adapters: env steps/s",
        "",
        about + ".",
        "",
        f"Random actions, {STEPS} steps per jitted call (best of the rounds, compile apart). suite: the raw env's "
        "vmapped step, no resets, its keys split at every step. adapter: `--env-name SUITE/NAME` through the "
        "harness's pooled env, auto-reset included, each env starting its reserved fresh episode, one reserve "
        "redrawn per `envs_per_reset` envs at every step. per-env: the file's VecEnv, gymnax's auto-reset, a fresh "
        "episode drawn for every env at every step. Cost: 1 - adapter / suite.",
        "",
        "| env | envs | fresh episodes per step | suite steps/s | adapter steps/s | cost | per-env steps/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        s = r["steps_per_s"]
        per_env = f"{s['per-env']:,.0f}" if "per-env" in s else "–"
        lines.append(
            f"| {r['env_name']} | {r['num_envs']} | {per_step(r['fresh_episodes_per_step'])} | {s['suite']:,.0f} | "
            f"{s['adapter']:,.0f} | {100 * r['adapter_cost']:.0f}% | {per_env} |"
        )
    if randoms:
        lines += [
            "",
            "Uniformly random actions through VecEnv, 64 envs x 5,000 steps: the mean return of the episodes that "
            "ended (the floor a learner must beat).",
            "",
            "| env | random policy return | episodes |",
            "|---|---|---|",
            *(f"| {r['env_name']} | {r['random_return']:.2f} | {r['episodes']:,} |" for r in randoms),
        ]
    write_markdown(path, lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", default=",".join(DEFAULT_ENVS), help="comma-separated SUITE/NAME list")
    parser.add_argument("--num-envs", default="16,256", help="comma-separated env counts")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args()
    xla.configure()
    import importlib.util

    import jax

    records, randoms = [], []
    for env_name in args.envs.split(","):
        if importlib.util.find_spec(env_name.split("/")[0]) is None:
            print(f"skipping {env_name}: not installed (pip install -r requirements-envs.txt)", flush=True)
            continue
        for num_envs in map(int, args.num_envs.split(",")):
            records.append(measure(env_name, num_envs, args.rounds))
        randoms.append(random_policy_return(env_name))
    info = machine()
    backend = jax.default_backend()
    with open(os.path.join(args.out, f"suites_{backend}.jsonl"), "w") as f:
        for record in records + randoms:
            f.write(json.dumps({**record, "machine": info}) + "\n")
    write_table(records, randoms, os.path.join(args.out, f"suites_{backend}.md"), describe(info))


if __name__ == "__main__":
    main()
