"""The XLA flags the peer drivers run under: those the algorithm files' `configure_xla()` sets, so
that a peer and our files are compiled and run alike in a comparison. Set before JAX starts."""

import os
import pkgutil


def set_xla_flags() -> None:
    """XLA's concurrency-optimised CPU scheduler off (it has deadlocked vmapped PPO, PureJAXRL's
    too), and on a CPU-only install backend optimisation level 1; flags already in XLA_FLAGS stay."""
    flags = {"xla_cpu_enable_concurrency_optimized_scheduler": "false"}
    cpu_only = os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu" or not any(
        m.name.startswith(("jax_cuda", "jax_rocm", "libtpu")) for m in pkgutil.iter_modules()
    )
    if cpu_only:
        flags["xla_backend_optimization_level"] = "1"
    for name, value in flags.items():
        if name not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{name}={value}".strip()
