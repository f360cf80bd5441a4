"""The one reader of environment variables: torchrun's (WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR) and integer settings such as the tuner's, each raising `EnvironmentVariableError` with the
variable, its value and who sets it."""

from __future__ import annotations

import os
from typing import overload

from ..errors import EnvironmentVariableError

# torchrun's variables (https://pytorch.org/docs/stable/elastic/run.html#environment-variables)
WORLD_SIZE = "WORLD_SIZE"  # processes in the job
RANK = "RANK"  # this process's global rank
LOCAL_RANK = "LOCAL_RANK"  # this process's index on its node
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"  # processes on this node
MASTER_ADDR = "MASTER_ADDR"  # the rendezvous host of the default process group

#: Who sets a variable, as error messages say it: "... must be an integer (torchrun sets it)."
TORCHRUN = "torchrun sets it"


@overload
def env_int(name: str, default: int, *, minimum: int | None = None, set_by: str = TORCHRUN) -> int: ...
@overload
def env_int(name: str, default: None, *, minimum: int | None = None, set_by: str = TORCHRUN) -> int | None: ...
def env_int(name: str, default: int | None, *, minimum: int | None = None, set_by: str = TORCHRUN) -> int | None:
    """Environment variable `name` as an integer; `default` when it is unset or blank.

    Raises `EnvironmentVariableError` (a ValueError) when it is set to something that is not an integer,
    or to one below `minimum`; the message names the variable, its value and `set_by`.
    """
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise _invalid(name, raw, minimum, set_by) from None
    if minimum is not None and value < minimum:
        raise _invalid(name, raw, minimum, set_by)
    return value


def env_positive_int(name: str, *, set_by: str = TORCHRUN) -> int | None:
    """Environment variable `name` as an integer of at least 1; None when it is unset or blank."""
    return env_int(name, None, minimum=1, set_by=set_by)


def env_is_set(name: str) -> bool:
    """Whether environment variable `name` is set (to anything, even blank)."""
    return name in os.environ


def _invalid(name: str, raw: str, minimum: int | None, set_by: str) -> EnvironmentVariableError:
    if minimum is None:
        kind = "an integer"
    elif minimum == 1:
        kind = "a positive integer"
    elif minimum == 0:
        kind = "a non-negative integer"
    else:
        kind = f"an integer of at least {minimum}"
    return EnvironmentVariableError(f"environment variable {name}={raw!r} must be {kind} ({set_by}).")
