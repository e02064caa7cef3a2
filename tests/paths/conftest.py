import contextlib

import pytest

from tests.sharding.conftest import corpus, run2  # noqa: F401  (shared fixtures)


@pytest.fixture
def killed_after_first_checkpoint(monkeypatch):
    """A context in which training dies (KeyboardInterrupt) right after committing a checkpoint."""
    from paths import checkpoint

    @contextlib.contextmanager
    def killed():
        real = checkpoint.prune

        def crash(*a, **k):
            real(*a, **k)
            raise KeyboardInterrupt("killed after the first checkpoint")

        monkeypatch.setattr(checkpoint, "prune", crash)
        try:
            with pytest.raises(KeyboardInterrupt):
                yield
        finally:
            monkeypatch.setattr(checkpoint, "prune", real)

    return killed
