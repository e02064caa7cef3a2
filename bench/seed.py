"""The trained seed every language-modelling bench starts from, as DiPaCo, Branch-Train-MiX and
FlexOlmo start from a trained model rather than a random init.

    .venv/bin/python bench/seed.py [--preset mini-mixtral] [--steps 1000] [--lr 2e-3]

A dense model of path size (path p00-00 of the preset, a plain Hugging Face checkpoint) trained
`--steps` steps of 8 x 128 tokens on the benches' corpus (bench/dipaco.py `documents`: code,
prose and arithmetic found on the machine; held-out documents chosen by a hash of their id, the
same ones every bench scores). Cached under bench/out/seed/<preset>-s<steps>-lr<lr>/ with
seed.json: the sha256 of its weights and its held-out perplexity. A cache whose weights do not
match that checksum is retrained, not used. Benches upcycle it (`paths upcycle --from SEED`):
every expert a copy of its MLP, so the MoE starts as the seed, the Branch-Train-MiX recipe
(seed, upcycle, branch, train, mix).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CACHE = os.path.join(ROOT, "bench", "out", "seed")


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def cached(folder: str) -> dict | None:
    """seed.json of a cached seed whose weights match its checksum, else None (and why, printed)."""
    record_path = os.path.join(folder, "seed.json")
    if not os.path.exists(record_path):
        return None
    record = json.load(open(record_path))
    weights = os.path.join(folder, "model.safetensors")
    if not os.path.exists(weights) or _sha256(weights) != record.get("sha256"):
        print(f"seed cache {folder}: its weights do not match the sha256 in seed.json: retrained, not used", flush=True)
        return None
    return record


def trained_seed(preset: str = "mini-mixtral", steps: int = 1000, lr: float = 2e-3, max_len: int = 256) -> tuple[str, dict]:
    """(folder of the trained dense seed, its seed.json), trained once and cached."""
    from bench.dipaco import dense, document_nll, documents, heldout_documents

    folder = os.path.join(CACHE, f"{preset}-s{steps}-lr{lr:g}")
    record = cached(folder)
    if record is not None:
        print(f"seed: {folder} (cached; held-out perplexity {record['heldout_perplexity']:.2f})", flush=True)
        return folder, record
    work = os.path.join(CACHE, f".work-{preset}-s{steps}")
    shutil.rmtree(work, ignore_errors=True)
    files = documents(os.path.join(work, "corpus"))
    t0 = time.perf_counter()
    trained = dense(os.path.join(work, "run"), preset, files, steps, lr)
    seconds = time.perf_counter() - t0
    from transformers import AutoModelForCausalLM

    from storage.layout import open_run

    heldout = heldout_documents(open_run(os.path.join(work, "run")), "web", max_len)
    model = AutoModelForCausalLM.from_pretrained(trained).eval()
    nll, n = 0.0, 0
    for docs in heldout.values():
        a, b = document_nll(model, docs)
        nll, n = nll + a, n + b
    ppl = math.exp(nll / max(1, n))
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(trained, tmp)
    record = {"preset": preset, "steps": steps, "lr": lr, "batch": "8 x 128 tokens", "heldout_perplexity": ppl, "heldout_documents": sum(map(len, heldout.values())),
              "heldout_tokens": n, "train_seconds": seconds, "sha256": _sha256(os.path.join(tmp, "model.safetensors")), "at": time.time(),
              "reproduce": f".venv/bin/python bench/seed.py --preset {preset} --steps {steps} --lr {lr:g}"}
    with open(os.path.join(tmp, "seed.json"), "w") as f:
        json.dump(record, f, indent=2)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    shutil.rmtree(work, ignore_errors=True)
    print(f"seed: trained {steps} steps in {seconds:.0f}s, held-out perplexity {ppl:.2f}: {folder}", flush=True)
    return folder, record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="mini-mixtral")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=2e-3)
    a = ap.parse_args()
    folder, record = trained_seed(a.preset, a.steps, a.lr)
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
