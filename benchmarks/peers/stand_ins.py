"""Stand-in modules for what a peer's file imports and a driver does not use (brax, navix, wandb, hydra, ...)."""

import sys
import types


def stand_in(name: str, **attrs) -> types.ModuleType:
    """Registers module `name` (a parent must be registered first): `attrs` as given, any other attribute a function
    that raises when called, so an unused import works and a use says where it failed."""
    module = types.ModuleType(name)

    def missing(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{name}.{attr}: {name.split('.')[0]} is not installed (the driver's stand-in module)")

        return unavailable

    module.__getattr__ = missing
    for key, value in attrs.items():
        setattr(module, key, value)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module
