"""Every bench script loads as `python bench/X.py` loads it (bench/ first on sys.path): a name one
bench takes from another that moved fails here, not on the next person to run the bench."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


@pytest.mark.parametrize("script", sorted(os.path.basename(p) for p in glob.glob(os.path.join(BENCH, "*.py"))))
def test_a_bench_script_loads(script):
    code = f"import runpy, sys; sys.path.insert(0, {BENCH!r}); runpy.run_path({os.path.join(BENCH, script)!r}, run_name='bench_loaded')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.stdout
