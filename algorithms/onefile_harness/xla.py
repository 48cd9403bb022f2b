"""XLA's set-up for the command line, made before JAX starts its backend."""

import os
import pkgutil
import warnings


def configure() -> None:
    """Sets, for this process, the XLA flags the command line trains with; a flag already in
    XLA_FLAGS is left as it is. XLA reads XLA_FLAGS once, when JAX starts its backend, so this
    runs before the first JAX computation (importing gymnax is one).

    - XLA's concurrency-optimised CPU scheduler (jaxlib 0.10) has deadlocked vmapped PPO here;
      the older scheduler has not. This costs some CPU throughput (benchmarks/README.md).
    - On a CPU-only install, backend optimisation level 1 compiles faster at the same speed,
      and the host is split into one XLA device per core (unless JAX_NUM_CPU_DEVICES says how
      many), over which the runs are spread: XLA:CPU runs one device's small kernels on one core.
    """
    if backend_started():
        warnings.warn(
            "the run harness's XLA set-up: JAX's backend has already started, so XLA flags can no longer "
            "take effect; configure them before the first JAX computation",
            stacklevel=2,
        )
        return
    flags = {"xla_cpu_enable_concurrency_optimized_scheduler": "false"}
    if cpu_only():
        flags["xla_backend_optimization_level"] = "1"
        if cpu_cores() > 1 and "JAX_NUM_CPU_DEVICES" not in os.environ:
            flags["xla_force_host_platform_device_count"] = str(cpu_cores())
    for name, value in flags.items():
        if name not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{name}={value}".strip()


def backend_started() -> bool:
    try:
        from jax._src import xla_bridge  # JAX has no public way to ask whether its backend started

        return xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):
        return False


def cpu_only() -> bool:
    """No accelerator plugin is installed, or JAX_PLATFORMS asks for the CPU; told without
    starting JAX's backend."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return True
    return not any(m.name.startswith(("jax_cuda", "jax_rocm", "libtpu")) for m in pkgutil.iter_modules())


def cpu_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


DEFAULT_COMPILE_CACHE = os.path.expanduser("~/.cache/jax_rl_compile")


def enable_compile_cache() -> None:
    """JAX's persistent compilation cache: a second identical run skips XLA compilation."""
    import jax

    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", DEFAULT_COMPILE_CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
