"""How many threads a `paths` process computes with on a CPU shared with other jobs
(bench/shared_cpu.py measures it).

torch starts one thread a core, and OpenMP's threads spin for a while when they wait for each
other. Where other processes want the cores too, every parallel region waits for its slowest
thread, which the kernel has just descheduled, while the others spin on time the neighbours need:
the quickstart's GRPO step went 20x slower beside 4 busy processes on 2 cores, where a fair share
costs 5x. One thread has nobody to wait for. So the trainer and the rollout worker set torch's
thread count to the cores other processes leave free (at least one), read from the kernel's count
of running tasks, at start and again every `every` seconds; alone on the machine they keep one
thread a core. PATHS_THREADS=N sets N threads instead, PATHS_THREADS=fixed (or setting
OMP_NUM_THREADS) leaves torch's count alone.
"""

from __future__ import annotations

import os
import time

from paths.errors import ConfigurationError


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _running_here() -> int:
    """This process's threads running or runnable now (its own OpenMP threads may be spinning)."""
    n = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                n += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):
            continue
    return n


def running_elsewhere(reads: int = 3, interval: float = 0.005) -> float | None:
    """Tasks of other processes running or runnable now: the mean of a few reads of the kernel's
    instant count (/proc/loadavg) less this process's own; None where it cannot be read."""
    counts = []
    for i in range(reads):
        try:
            with open("/proc/loadavg") as f:
                total = int(f.read().split()[3].split("/")[0])
            counts.append(max(0, total - _running_here()))
        except (OSError, ValueError, IndexError):
            return None
        if i + 1 < reads:
            time.sleep(interval)
    return sum(counts) / len(counts)


def threads_for(n_cores: int, others: float) -> int:
    """One thread a core the other processes leave free, at least one."""
    return max(1, min(n_cores, n_cores - round(others)))


def setting() -> str | int:
    """PATHS_THREADS: `auto` (the default: adapted to the load), `fixed` (torch's own count, never
    changed; also whenever OMP_NUM_THREADS is set) or a count of threads."""
    value = os.environ.get("PATHS_THREADS", "auto").strip().lower() or "auto"
    if value.isdigit() and int(value) > 0:
        return int(value)
    if value not in ("auto", "fixed"):
        raise ConfigurationError(f"PATHS_THREADS must be auto, fixed or a number of threads, got {value!r}")
    return "fixed" if value == "fixed" or os.environ.get("OMP_NUM_THREADS") else value


class Threads:
    """torch's thread count, kept to the cores others leave free (or set once to PATHS_THREADS):
    `check()` is cheap to call often (it looks every `every` seconds)."""

    def __init__(self, every: float = 10.0):
        self.every, self.due = every, 0.0
        self.mode = setting()

    def check(self) -> None:
        if self.mode == "fixed" or time.monotonic() < self.due:
            return
        import torch

        if isinstance(self.mode, int):
            torch.set_num_threads(self.mode)
            self.mode = "fixed"
            return
        self.due = time.monotonic() + self.every
        others = running_elsewhere()
        if others is None:
            self.mode = "fixed"  # not Linux: torch's default stays
            return
        n = threads_for(cores(), others)
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
