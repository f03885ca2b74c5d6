"""``--device`` for engines that run torch: one reading of it, one set of errors.

Kept apart from ``base`` so that engines without torch (``synthetic``) and the
interface itself never import it.
"""

from __future__ import annotations

import torch

from trio_vstream.engines.contract import EngineConfigError


def resolve_device(engine: str, spec: str, *, allow_mps: bool = False) -> torch.device:
    """``auto`` (CUDA when there is one), ``cpu``, ``cuda[:N]`` (which must exist here),
    and ``mps`` where the engine allows it; anything else is an ``EngineConfigError``
    naming the engine."""
    text = (spec or "auto").strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    choices = "auto, cpu, cuda[:N] or mps" if allow_mps else "auto, cpu or cuda[:N]"
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        message = f"{engine} engine: unknown device {spec!r}: use {choices}"
        raise EngineConfigError(message) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise EngineConfigError(f"{engine} engine: device {spec!r} asked for, but no CUDA here")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise EngineConfigError(
                f"{engine} engine: device {spec!r}: only {torch.cuda.device_count()} "
                "CUDA device(s) here"
            )
    elif device.type != "cpu" and not (allow_mps and device.type == "mps"):
        raise EngineConfigError(f"{engine} engine: unsupported device {spec!r}: use {choices}")
    return device
