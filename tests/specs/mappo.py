"""mappo.py's spec (tests/specs/__init__.py): ippo.py's runs, with a centralised critic."""

import dataclasses

from specs import ippo

# ippo.py's small runs, bad inputs and env; the learning test at the same eighth of the default's steps.
SPEC = dataclasses.replace(ippo.SPEC, built_from="ippo")
