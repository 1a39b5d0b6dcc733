"""Where chainD's py-spy samples of the job went: per thread, its share of the sampled seconds,
then its functions that held the most samples (inclusive).

    python docs/data/quality_2026-12-04_session29/spy_summary.py runs/quality_gpu.spy370.gil.txt \\
        runs/quality_gpu.spy370.cpu.txt [--top 12]

Each file is ``py-spy record --threads [--subprocesses] -r 50 -d 10 -f raw`` output (one line
per distinct stack: ``[process PID:"command";...]thread (id): name;frame;...;frame count``): with
``--gil`` (``.gil``) only the thread holding the interpreter lock is sampled, so a thread's share
is how long it held the lock; without it (``.cpu``) every thread on a CPU is, so its share is how
busy it was. A thread of a spawned stage process (``--subprocesses``) is named with its pid.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--rate", type=float, default=50, help="py-spy's samples a second")
    ap.add_argument("--seconds", type=float, default=10, help="how long it sampled")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    expected = args.rate * args.seconds
    for path in args.files:
        per_thread: Counter[str] = Counter()
        frames: dict[str, Counter[str]] = defaultdict(Counter)
        for line in open(path):
            stack, _, count = line.rstrip("\n").rpartition(" ")
            thread, calls = _thread_of(stack)
            per_thread[thread] += int(count)
            for call in set(calls):
                frames[thread][call] += int(count)
        print(f"== {path}: {sum(per_thread.values())} samples of {expected:.0f} a thread")
        for thread, n in per_thread.most_common():
            print(f"{thread[:70]:70s} {n / expected:6.1%}")
            for call, m in frames[thread].most_common(args.top):
                print(f"    {m / expected:6.1%}  {call[:110]}")


PROCESS = re.compile(r'process (\d+):".*?";(?=process |thread )')
"""One process of a ``--subprocesses`` stack; its quoted command line may hold ``;``."""


def _thread_of(stack: str) -> tuple[str, list[str]]:
    """(thread, its frames) of a stack. With ``--subprocesses`` a stack starts with the processes
    down to the thread's (``process PID:"command";``): the thread is then named with the pid of
    the process it runs in."""
    pids = []
    while m := PROCESS.match(stack):
        pids.append(m.group(1))
        stack = stack[m.end():]
    thread, *calls = stack.split(";")
    return (f"pid {pids[-1]} {thread}" if pids else thread), calls


if __name__ == "__main__":
    main()
