"""bench/seed.py's cache: a seed is reused only while its weights match the sha256 it was saved with."""

from __future__ import annotations

import hashlib
import json

from bench.seed import cached


def test_a_seed_cache_is_used_only_while_its_weights_match_their_checksum(tmp_path, capsys):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"weights")
    record = {"steps": 10, "heldout_perplexity": 12.5, "sha256": hashlib.sha256(b"weights").hexdigest()}
    (tmp_path / "seed.json").write_text(json.dumps(record))
    assert cached(str(tmp_path)) == record
    weights.write_bytes(b"weights, changed")
    assert cached(str(tmp_path)) is None
    assert "do not match the sha256 in seed.json: retrained, not used" in capsys.readouterr().out
    assert cached(str(tmp_path / "absent")) is None
