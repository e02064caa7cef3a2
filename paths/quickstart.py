"""The embedded default end to end: a local folder as the object store and a tiny model.

Each stage is a (title, callable) pair; the CLI runs them in order and renders each result, so
later stages (init, decompose, shard, train, compose) are appended here as they exist.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from storage import admin

DEFAULT_ROOT = "runs/quickstart"

Stage = tuple[str, Callable[[], Any]]


def stages(root: str = DEFAULT_ROOT) -> Iterator[Stage]:
    """The quickstart's stages in order, for a run at `root`."""
    run = admin.init(root)
    yield f"paths storage init {root}", lambda: f"run at {run.url}"
    yield f"paths storage ls {root}", lambda: admin.ls(run)
    yield f"paths storage du {root}", lambda: admin.du(run)
    yield f"paths storage verify {root}", lambda: admin.verify(run)
