"""One CPU-threads setting for every command, chosen from the machine's state when not given.

torch starts one intra-op thread per physical core. On a machine other jobs keep busy those
threads wait on each other at every operation: measured on 2 cores at load 4-12, training ran
263 s instead of 33 s with one thread, eval 61 s instead of 7.7 s. So without `--threads` (or
OMP_NUM_THREADS) a command takes only the cores the load average leaves free, at least one.

Bench timings are also checked against the machine: `CpuMonitor` measures how many CPUs other
processes kept busy during a measurement (Linux /proc/stat minus this process's CPU time, so it
sees a job that started a second ago, unlike the one-minute load average).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

BUSY_MARGIN = 0.25  # CPUs of slack before a timing counts as measured on an oversubscribed machine


@dataclass(frozen=True)
class ThreadChoice:
    """How many torch CPU threads a command runs and why (`line` is printed once)."""

    threads: int
    why: str  # "as asked", "OMP_NUM_THREADS", or the load it was chosen from
    asked: bool = False  # given by --threads / the config (no "--threads N to choose" hint then)

    @property
    def line(self) -> str:
        return f"CPU threads: {self.threads} ({self.why}{'' if self.asked else '; --threads N to choose'})"


def machine_cpus() -> int:
    """Logical CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:
        return os.cpu_count() or 1


def load_average() -> float:
    """The one-minute load average (0 where the OS has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def choose_threads(cpus: int, load: float, requested: int | None, max_threads: int | None = None,
                   processes: int = 1, env: str | None = None) -> ThreadChoice:
    """Threads for one of `processes` processes on a machine with `cpus` logical CPUs at `load`.

    `requested` (--threads / the config's `threads`) wins, then `env` (OMP_NUM_THREADS); otherwise
    the CPUs the load leaves free, shared among the processes, rounded, at least 1 and at most
    `max_threads` (torch's default: the physical cores). Pure: no clocks, no OS calls.
    """
    cap = max(1, min(cpus, max_threads or cpus))
    if requested is not None:
        return ThreadChoice(requested, "as asked", asked=True)
    if env is not None and env.strip().isdigit() and int(env) >= 1:
        return ThreadChoice(int(env), "OMP_NUM_THREADS")
    free = int((cpus - load) / max(1, processes) + 0.5)  # CPUs the load leaves free, per process
    threads = max(1, min(cap, free))
    why = (f"load average {load:.1f} on {cpus} CPUs" + (f", {processes} processes" if processes > 1 else ""))
    if free >= cap:
        why += f": all {cap} cores" if processes == 1 else f": {cap} per process"
    else:
        why += f", so {threads} of {cap} cores: other jobs keep the rest busy"
    return ThreadChoice(threads, why)


_applied: ThreadChoice | None = None
_torch_default: int | None = None


def apply_threads(requested: int | None = None, processes: int = 1) -> ThreadChoice:
    """Choose (see `choose_threads`) and set torch's CPU threads for this process; return the choice.

    Called once at the start of a command; the choice is kept for `applied()`.
    """
    global _applied, _torch_default
    import torch

    if _torch_default is None:  # torch's own default (one thread per physical core), before we change it
        _torch_default = torch.get_num_threads()
    choice = choose_threads(machine_cpus(), load_average(), requested, _torch_default, processes,
                            os.environ.get("OMP_NUM_THREADS"))
    torch.set_num_threads(choice.threads)
    _applied = choice
    return choice


def available_memory() -> int:
    """Bytes of memory available to a new allocation (MemAvailable on Linux, else physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def keep_freed_memory() -> bool:
    """On glibc, keep the memory a training step frees for the next step instead of returning it to the
    system: measured on the demo's trainer (2 cores), the default gave every step's activations back
    and faulted them in again (1.33 M page faults and 2.5 s of system time per 400K tokens; with
    these settings 0.12 M and 0.5 s, 5-7% more tokens/s). Blocks over 32 MiB (glibc's largest
    threshold) still come from and go back to the system. A user's MALLOC_* environment wins.
    Returns whether the settings were applied (False elsewhere than glibc)."""
    import ctypes

    if any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without it)
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    mib = 1 << 20
    return bool(mallopt(m_mmap_threshold, 32 * mib) and mallopt(m_trim_threshold, 1024 * mib)
                and mallopt(m_top_pad, 64 * mib))


def start_threads(requested: int | None) -> ThreadChoice:
    """`apply_threads` for a command-line tool, first thing, so that all its work runs with them;
    `announce_threads` prints the choice once the input is checked (a bad input stays one line)."""
    global _announced
    _announced = False
    return apply_threads(requested)


_announced = False


def announce_threads(stdout: bool = False) -> None:
    """Print the choice `start_threads` made (on stderr, or stdout, e.g. as part of a plan), once."""
    global _announced
    import sys

    if _applied is not None and not _announced:
        print(_applied.line, file=sys.stdout if stdout else sys.stderr, flush=True)
        _announced = True


def applied() -> ThreadChoice | None:
    """The last choice `apply_threads` made in this process (None: never called)."""
    return _applied


def add_threads_arg(parser, what: str = "all of this command's work") -> None:
    """`--threads N` on an argparse parser (None: chosen from the load, see `choose_threads`)."""
    from uptrain.cli import positive_int

    parser.add_argument("--threads", type=positive_int, default=None,
                        help=f"torch CPU threads for {what} (default: the cores the load average leaves "
                             "free, at least 1; OMP_NUM_THREADS is honoured)")


def _proc_stat_busy() -> float | None:
    """Seconds the CPUs this process may use spent busy since boot (Linux /proc/stat), None elsewhere.

    Per-CPU lines of the affinity mask only: in a container pinned to some of the host's CPUs
    the total line would count the whole host.
    """
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu") and line[3:4].isdigit()]
        mine = os.sched_getaffinity(0)
    except (OSError, AttributeError):
        return None
    busy = 0
    for fields in lines:
        if int(fields[0][3:]) in mine:
            # user nice system idle iowait irq softirq steal: busy = all but idle and iowait
            ticks = [int(x) for x in fields[1:9]]
            busy += sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK") if lines else None


def _own_cpu() -> float:
    """CPU seconds of this process (all threads) and its waited-for children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def others_busy(busy_delta: float, own_delta: float, wall: float) -> float:
    """Average CPUs other processes kept busy over `wall` seconds (>= 0)."""
    return max(0.0, (busy_delta - own_delta) / wall) if wall > 0 else 0.0


def oversubscribed(others: float, cpus: int, threads: int, margin: float = BUSY_MARGIN) -> bool:
    """Whether `threads` of ours plus the CPUs `others` kept busy exceed the machine (+ margin)."""
    return others + threads > cpus + margin


def busy_note(others: float, cpus: int, threads: int) -> str | None:
    """'noisy: CPU busy ...' when a CPU timing was taken on an oversubscribed machine, else None."""
    if not oversubscribed(others, cpus, threads):
        return None
    fewer = " or with fewer --threads" if threads > 1 else ""
    return (f"noisy: CPU busy (other processes kept {others:.1f} of {cpus} CPUs busy while it ran "
            f"with {threads} thread{'s' * (threads > 1)}; rerun on an idle machine{fewer})")


class CpuMonitor:
    """`with CpuMonitor() as m: ...` then `m.others`: CPUs other processes kept busy meanwhile.

    Falls back to the change in the one-minute load average minus our threads where /proc/stat
    is absent (coarse: it lags by tens of seconds).
    """

    def __enter__(self) -> CpuMonitor:
        self._busy, self._own, self._wall = _proc_stat_busy(), _own_cpu(), time.perf_counter()
        self.others: float = 0.0
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._wall
        busy = _proc_stat_busy()
        if busy is None or self._busy is None:
            import torch

            self.others = max(0.0, load_average() - torch.get_num_threads())
        else:
            self.others = others_busy(busy - self._busy, _own_cpu() - self._own, wall)
