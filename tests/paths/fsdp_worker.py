"""One rank of an lm run (no claim: `train` with no lease), for the FSDP tests:
`python tests/paths/fsdp_worker.py RUN PATH STEPS BATCH_SIZE FSDP(0|1) [KEY=VALUE ...]` with torchrun's variables set."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from paths.train_config import load_config  # noqa: E402
from paths.work.train import train  # noqa: E402
from storage.layout import open_run  # noqa: E402

url, path, steps, batch, fsdp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
cfg = load_config(sets=["seq_len=16", f"batch_size={batch}", "warmup_steps=1", "min_lr_ratio=1.0", "checkpoint_every=2", f"fsdp={fsdp}", *sys.argv[6:]], steps=steps)
summary = train(open_run(url), path, "lm", "lm", cfg, None, show_progress=False)
print(json.dumps({k: summary[k] for k in ("steps", "resumed_from", "tokens")}))
