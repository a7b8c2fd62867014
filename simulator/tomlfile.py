"""Reading the simulator's TOML inputs (cost models, model and cluster descriptions)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipedsl.errors import PipedslError

__all__ = ["read_toml"]


def read_toml(path: Path, *, what: str, error: type[PipedslError]) -> dict[str, Any]:
    """The table of TOML file ``path`` (a ``what`` file); an unreadable or malformed file
    raises ``error`` naming it."""
    # Loaded here: a simulation without a cost file never reads TOML.
    import tomllib

    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except OSError as err:
        raise error(f"cannot read {what} file {path}: {err.strerror or err}") from None
    except tomllib.TOMLDecodeError as err:
        raise error(f"{path}: not valid TOML: {err}") from None
    except UnicodeDecodeError as err:
        raise error(
            f"{path}: not UTF-8 text (byte {err.start} is {err.object[err.start]:#04x}); save it as UTF-8"
        ) from None
    except RecursionError:
        raise error(f"{path}: not valid TOML: arrays or tables nested too deeply") from None
