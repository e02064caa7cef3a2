from tests.sharding.conftest import corpus, run2  # noqa: F401  (shared fixtures)
