"""The prepare stage: put a base MoE into a run (init, upcycle) and cut it into paths (decompose)."""
