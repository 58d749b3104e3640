"""Sandbox lifecycle benchmark: create from the template, command round trip, pause, resume to the first command,
fork of N children, snapshot size and host memory per paused and per forked sandbox, beside AgentENV's published
numbers (133 ms checkpoint, 49 ms resume, 6.5x memory overcommit; Firecracker on hardware KVM with incremental
dirty-page snapshots).

Manager-level (no HTTP): :class:`openk3.sandbox.SandboxManager` directly, commands through the guest agent
(``/bin/true`` as the round trip; ``bash -l -c true`` is what every e2b SDK ``commands.run`` costs on top).

* create: restore from the template (qcow2 overlay, RAM file mapped copy-on-write, device state) until the
  agent answers and ``/init`` has set the clock.
* pause: ``cow`` is the first pause of a sandbox created from a template (its memory is private, so every
  non-zero page is written: a full stream); ``own`` is a later pause (RAM is the sandbox's own shared file: device
  state only). Resume to first command: restore + agent ready + one ``/bin/true``.
* fork N: the parent's snapshot plus N children restored one after another (serialised), until each answers.
  Memory: with the N children alive, the sum of their VMM processes' PSS (shared pages counted once across
  processes) against the sum of their RSS; overcommit = N x guest RAM / sum PSS.
* paused: a paused sandbox has no process (0 resident bytes); what it keeps is on disk (allocated bytes).

Each timing is the median of ``--repeats`` rounds (min and max in brackets). The machine is shared: other
jobs slow TCG guests.

    python benchmarks/sandbox.py --out benchmarks/results/sandbox_cpu.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from openk3.sandbox import agent_client
from openk3.sandbox.image import build_image
from openk3.sandbox.manager import ManagerConfig, SandboxManager
from openk3.sandbox.vmm import MachineSpec

OWNER = "bench"


def _mem(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in bytes of a process, from /proc/PID/smaps_rollup."""
    rss = pss = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Rss:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("Pss:"):
            pss = int(line.split()[1]) * 1024
    return rss, pss


def _allocated(directory: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in directory.rglob("*") if p.is_file())


def _fmt(xs: list[float]) -> str:
    ms = [1000 * x for x in xs]
    return f"{statistics.median(ms):.0f} ms [{min(ms):.0f}-{max(ms):.0f}]"


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _true(m: SandboxManager, sid: str) -> None:
    code, _, err = agent_client.run(m.agent_port(sid, OWNER)[1], ["/bin/true"])
    if code != 0:
        raise RuntimeError(f"/bin/true failed in {sid}: {err!r}")


def _lifecycle_round(m: SandboxManager, root: Path, rows: dict, sizes: dict) -> None:
    """One create -> commands -> pause (cow) -> resume -> pause (own) -> resume -> snapshot -> kill."""
    t, r = _timed(lambda: m.create("base", OWNER))
    rows["create"].append(t)
    sid = r.sandbox_id
    port = m.agent_port(sid, OWNER)[1]
    _true(m, sid)
    rows["true"] += [_timed(lambda: _true(m, sid))[0] for _ in range(5)]
    rows["bash"] += [
        _timed(lambda: agent_client.run(port, ["/bin/bash", "-l", "-c", "true"]))[0] for _ in range(3)
    ]
    t, st = _timed(lambda: m.pause(sid, OWNER))
    rows["pause_cow"].append(t)
    sizes["full stream"] = st.stream.stat().st_size
    rows["resume_full"].append(_timed(lambda: (m.resume(sid, OWNER), _true(m, sid)))[0])
    t, st = _timed(lambda: m.pause(sid, OWNER))
    rows["pause_own"].append(t)
    sizes["device state"] = st.stream.stat().st_size
    sizes["paused sandbox on disk"] = _allocated(root / "sandboxes" / sid)
    rows["resume_dev"].append(_timed(lambda: (m.resume(sid, OWNER), _true(m, sid)))[0])
    t, snap = _timed(lambda: m.snapshot(sid, OWNER, None, "fork"))
    rows["snapshot"].append(t)
    sizes["snapshot"] = snap.size_bytes()
    m.kill(sid, OWNER)


def _fork_round(m: SandboxManager, n: int) -> tuple[int, int, float, int, int]:
    """Fork ``n`` children of a paused parent that dirtied 32 MiB; returns (n, ok, seconds, sum RSS, sum PSS)."""
    parent = m.create("base", OWNER)
    cmd = ["/bin/sh", "-c", "head -c 32M /dev/urandom > /dev/shm/work"]
    agent_client.run(m.agent_port(parent.sandbox_id, OWNER)[1], cmd)
    m.pause(parent.sandbox_id, OWNER)  # fork from a paused parent: only the children run
    t, kids = _timed(lambda: m.fork(parent.sandbox_id, OWNER, n))
    ok = [k for k in kids if not isinstance(k, Exception)]
    for k in ok:
        _true(m, k.sandbox_id)
    mems = [_mem(m._live[k.sandbox_id].vm.pid) for k in ok]
    for k in ok:
        m.kill(k.sandbox_id, OWNER)
    m.kill(parent.sandbox_id, OWNER)
    return n, len(ok), t, sum(x[0] for x in mems), sum(x[1] for x in mems)


def run(args) -> str:
    load_before = os.getloadavg()[0]
    image = build_image()
    root = Path(tempfile.mkdtemp(prefix="openk3-bench-", dir=args.root))
    m = SandboxManager(ManagerConfig(root=root, spec=MachineSpec(memory_mib=args.memory_mib)), image)
    t_template, tmpl = _timed(lambda: m.build_template("base"))
    rows: dict[str, list[float]] = {k: [] for k in ("create", "true", "bash", "pause_cow", "resume_full",
                                                     "pause_own", "resume_dev", "snapshot")}  # fmt: skip
    sizes: dict = {}
    for _ in range(args.repeats):
        _lifecycle_round(m, root, rows, sizes)
    forks = [_fork_round(m, n) for n in args.forks]
    shutil.rmtree(root, ignore_errors=True)
    qemu = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True, text=True).stdout.split(
        "\n"
    )[0]
    mib = 2**20
    lines = [
        "Command: `python benchmarks/sandbox.py --out benchmarks/results/sandbox_cpu.md`"
        f" (`--repeats {args.repeats} --forks {' '.join(map(str, args.forks))}`)",
        "",
        f"Accelerator: **{m.vmm.accel.upper()}** ({qemu}, `-M microvm`, 1 vCPU, {args.memory_mib} MiB guest, "
        "Debian 12 cloud kernel 6.1, python3 agent). Host: 2 vCPUs shared with other jobs, no hardware KVM; "
        f"1-minute load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
        "(above 2, guests wait for a core and every latency grows).",
        f"Template build (cold boot to agent ready, one warm-up `bash -l`, device-state save): {t_template:.1f} s.",
        "",
        "| step | openk3 (TCG) | AgentENV (published, KVM) |",
        "|---|---|---|",
        f"| create from template, until the agent answers | {_fmt(rows['create'])} | |",
        f"| command round trip, `/bin/true` via the agent | {_fmt(rows['true'])} | |",
        f"| command round trip, `bash -l -c true` (what e2b `commands.run` does) | {_fmt(rows['bash'])} | |",
        f"| pause, first (copy-on-write RAM: full stream) | {_fmt(rows['pause_cow'])} | 133 ms checkpoint |",
        f"| pause, later (own RAM file: device state only) | {_fmt(rows['pause_own'])} | 133 ms checkpoint |",
        f"| resume to first command, from the full stream | {_fmt(rows['resume_full'])} | 49 ms resume |",
        f"| resume to first command, from device state | {_fmt(rows['resume_dev'])} | 49 ms resume |",
        f"| snapshot of a running sandbox (it goes on as a child) | {_fmt(rows['snapshot'])} | |",
    ]
    for n, ok, t, _, _ in forks:
        lines.append(
            f"| fork N={n} (serialised), until every child answers | {1000 * t:.0f} ms total, "
            f"{1000 * t / max(ok, 1):.0f} ms per child ({ok}/{n} ok) | |"
        )
    s = sizes["snapshot"]
    lines += [
        "",
        "| memory and disk | bytes |",
        "|---|---|",
        f"| snapshot: RAM file allocated / device state / disk layer | {s['ram'] / mib:.1f} MiB / {s['state'] / 1024:.0f} KiB / {s['disk'] / mib:.2f} MiB |",
        f"| full stream (first pause) / device state (later pause) | {sizes['full stream'] / mib:.1f} MiB / {sizes['device state'] / 1024:.0f} KiB |",
        f"| paused sandbox: resident memory / allocated on disk | 0 (no VMM process) / {sizes['paused sandbox on disk'] / mib:.1f} MiB |",
    ]
    for n, ok, _, rss, pss in forks:
        over = n * args.memory_mib * mib / pss if pss else float("nan")
        lines.append(
            f"| fork N={n}: per child RSS / PSS (shared counted once) | {rss / ok / mib:.1f} / {pss / ok / mib:.1f} MiB; "
            f"overcommit {n} x {args.memory_mib} MiB / {pss / mib:.0f} MiB = {over:.1f}x (AgentENV: 6.5x) |"
        )
    lines += [
        "",
        "The parent of each fork wrote 32 MiB of random data to /dev/shm before pausing, so the shared snapshot "
        "holds real guest memory; children share its clean pages through the page cache (MAP_PRIVATE) and "
        "own only what they dirty plus QEMU's TCG translation cache (capped at 64 MiB).",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--forks", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--memory-mib", type=int, default=256)
    p.add_argument("--root", type=Path, default=None, help="where the benchmark's state directory goes")
    p.add_argument("--out", type=Path, default=None, help="write the Markdown report here too")
    args = p.parse_args(argv)
    report = run(args)
    print(report)
    if args.out:
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
