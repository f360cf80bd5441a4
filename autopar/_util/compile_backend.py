"""The torch.compile backend of a plan that compiles: `AUTOPAR_COMPILE_BACKEND` if set, else inductor; a name torch
does not register is refused where it is read, naming the valid choices."""

from __future__ import annotations

import os
from typing import Any

from ..errors import PlanError

COMPILE_BACKEND_ENV = "AUTOPAR_COMPILE_BACKEND"
DEFAULT_COMPILE_BACKEND = "inductor"


_REGISTERED_BACKENDS: set[str] = {DEFAULT_COMPILE_BACKEND}  # names found registered, so looked up once each


def compile_backends() -> list[str]:
    """torch.compile's registered backends (torch._dynamo.list_backends, every tag), sorted. torch._dynamo is
    imported here, on first use, not when autopar is."""
    import torch._dynamo

    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def compile_backend_refusal(backend: Any, *, source: str) -> str | None:
    """Why `backend` (named by `source`, e.g. "AUTOPAR_COMPILE_BACKEND") is not a torch.compile backend (one line
    naming it and the valid choices), or None when torch registers it."""
    if isinstance(backend, str) and backend in _REGISTERED_BACKENDS:
        return None
    choices = compile_backends()
    if isinstance(backend, str) and backend in choices:
        _REGISTERED_BACKENDS.add(backend)
        return None
    return (f"{source}={backend!r} is not a torch.compile backend: use one of {', '.join(map(repr, choices))} "
            f"(default {DEFAULT_COMPILE_BACKEND!r}).")


def configured_compile_backend() -> str:
    """The backend a compiling plan runs with: AUTOPAR_COMPILE_BACKEND if set, else inductor; a name torch does
    not register is refused (PlanError, naming it and the valid choices)."""
    backend = os.environ.get(COMPILE_BACKEND_ENV) or DEFAULT_COMPILE_BACKEND
    why = compile_backend_refusal(backend, source=COMPILE_BACKEND_ENV)
    if why is not None:
        raise PlanError(why.replace(" (default", ", or unset it (default", 1))
    return backend
