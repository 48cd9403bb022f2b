"""Where one env step of sac.py goes at rejax's Pendulum config (one env, a gradient step per env
step, batch 256, 64-unit networks), on one device:

    python benchmarks/sac_step.py              # about a minute on 2 CPU cores
    XLA_FLAGS=--xla_cpu_prefer_vector_width=512 python benchmarks/sac_step.py

  training       the whole compiled run of 10,000 env steps (as bench_rejax.py times it), per env step
  no gradients   the same with learning_starts past the end: acting, env and replay buffer alone
  loss + grad    SAC's loss and its gradient alone on a fixed batch and loss key, 2,000 in a `lax.scan`:
                 the networks' arithmetic (and the loss's two normal draws), with no replay sampling,
                 optimizer, target update or env
Best of 3 timings of each compiled program. The gap between the first and the last is everything
the training loop adds to the arithmetic that every SAC implementation does at this config.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rejax import REJAX_CONFIG  # noqa: E402

from common import load_algorithm, xla  # noqa: E402

ENV_STEPS = REJAX_CONFIG["sac"]["total_timesteps"]
GRAD_STEPS = 2_000


def best_seconds(program, *args, rounds: int = 3) -> float:
    import jax

    jax.block_until_ready(program(*args))  # compiles
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(program(*args))
        best = min(best, time.perf_counter() - start)
    return best


def training_us(sac, **overrides) -> float:
    import jax

    config = sac.Config(**{**REJAX_CONFIG["sac"], **overrides}, num_seeds=1)
    keys = jax.random.split(jax.random.PRNGKey(0), 1)
    return best_seconds(jax.jit(jax.vmap(sac.make_train(config))), keys) / ENV_STEPS * 1e6


def loss_and_grad_us(sac) -> float:
    import jax

    config = sac.Config(**REJAX_CONFIG["sac"], num_seeds=1)
    env = sac.VecEnv(config.env_name, 1)
    networks, scale = sac.make_networks(config, env.action_dim, env.obs_shape), sac.action_scale(env)
    runner = sac.make_train(config).init(jax.random.PRNGKey(0))  # the parameters a run starts from
    B, A, O = config.batch_size, env.action_dim, env.obs_shape
    keys = jax.random.split(jax.random.PRNGKey(1), 5)
    batch = sac.Transition(
        obs=jax.random.normal(keys[0], (B, *O)),
        action=jax.random.uniform(keys[1], (B, A), minval=-1, maxval=1),
        reward=jax.random.normal(keys[2], (B,)),
        terminated=jax.numpy.zeros(B, bool),
        final_obs=jax.random.normal(keys[3], (B, *O)),
    )
    target = runner.target_params["critic"]
    loss = lambda params: sac.sac_loss(config, networks, params, target, batch, scale, runner.hparams, keys[4])[0]  # noqa: E731

    def step(params, _):  # a tiny step keeps every iteration dependent on the last
        return jax.tree.map(lambda p, g: p - 1e-6 * g, params, jax.grad(loss)(params)), None

    program = jax.jit(lambda params: jax.lax.scan(step, params, None, length=GRAD_STEPS)[0])
    return best_seconds(program, runner.params) / GRAD_STEPS * 1e6


def main() -> None:
    sac = load_algorithm("sac")
    xla.configure()
    print(f"XLA_FLAGS: {os.environ.get('XLA_FLAGS', '')}")
    rows = [
        ("training", training_us(sac)),
        ("no gradients", training_us(sac, learning_starts=ENV_STEPS + 1)),
        ("loss + grad", loss_and_grad_us(sac)),
    ]
    for label, us in rows:
        print(f"{label:14s} {us:7.1f} us per env step  ({1e6 / us:,.0f} per second)")


if __name__ == "__main__":
    main()
