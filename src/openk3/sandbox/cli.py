"""``openk3 sandbox build-image`` and ``openk3 sandbox serve``. Heavy imports happen when a command runs."""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import sys
import threading
import time
from pathlib import Path


def add_sandbox_parser(sub) -> None:
    p = sub.add_parser("sandbox", help="microVM agent sandboxes behind an E2B-compatible API")
    ssub = p.add_subparsers(dest="sandbox_command", required=True)

    b = ssub.add_parser(
        "build-image", help="build (or find in the cache) the guest image from Debian packages"
    )
    b.add_argument(
        "--cache-dir", type=Path, default=None, help="image cache (default ~/.cache/openk3/sandbox/images)"
    )
    b.add_argument("--force", action="store_true", help="rebuild even if a cached image matches")
    b.set_defaults(func=cmd_build_image)

    s = ssub.add_parser("serve", help="serve sandboxes over the E2B API (point the e2b SDK at it)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=_port, default=3000, help="port to listen on (0: any free port)")
    s.add_argument(
        "--root", type=Path, default=None, help="state directory (default ~/.cache/openk3/sandbox/state)"
    )
    s.add_argument(
        "--cache-dir", type=Path, default=None, help="image cache (default ~/.cache/openk3/sandbox/images)"
    )
    s.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="an accepted API key (repeatable; default: $OPENK3_SANDBOX_API_KEYS, comma-separated, else one new key)",
    )
    s.add_argument("--memory-mib", type=int, default=256, help="guest RAM per sandbox in MiB")
    s.add_argument(
        "--accel",
        choices=["auto", "kvm", "tcg"],
        default="auto",
        help="QEMU accelerator (auto: KVM when it runs)",
    )
    s.add_argument("--template", default="base", help="name of the template booted at start")
    s.add_argument("--health-interval", type=float, default=30.0, help="seconds between guest health probes")
    s.set_defaults(func=cmd_serve)


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {port}")
    return port


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (uvicorn listens on it), made before the slow template boot so a port
    in use fails at once. Raises OSError naming the address."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: no wait on TIME_WAIT
        try:
            sock.bind(addr)
        except OSError:
            sock.close()
            raise
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    return sock


def _image_config(cache_dir: Path | None):
    from openk3.sandbox.image import ImageConfig

    return ImageConfig() if cache_dir is None else ImageConfig(cache_dir=cache_dir)


def cmd_build_image(args: argparse.Namespace) -> int:
    from openk3.sandbox.image import build_image

    try:
        image = build_image(_image_config(args.cache_dir), force=args.force)
    except RuntimeError as e:
        print(f"openk3 sandbox: error: {e}", file=sys.stderr)
        return 1
    print(f"image {image.key}: {image.kernel}, {image.initrd}, {image.rootfs}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from openk3.sandbox.api import create_app
    from openk3.sandbox.image import build_image, default_cache_dir
    from openk3.sandbox.lock import RootBusyError, hold_root, release_root
    from openk3.sandbox.manager import ManagerConfig, SandboxError, SandboxManager
    from openk3.sandbox.vmm import MachineSpec

    keys = args.api_key or [k for k in os.environ.get("OPENK3_SANDBOX_API_KEYS", "").split(",") if k]
    root = args.root or default_cache_dir() / "state"
    spec = MachineSpec(memory_mib=args.memory_mib, accel=args.accel)  # bad flags fail before any work
    try:
        lock, stale = hold_root(root, args.host, args.port)  # one server per state root
    except RootBusyError as e:
        print(f"openk3 sandbox: error: {e}", file=sys.stderr)
        return 1
    try:
        sock = _listen(args.host, args.port)
    except OSError as e:
        release_root(lock)
        print(f"openk3 sandbox: error: {e}", file=sys.stderr)
        return 1
    try:
        if stale:
            print(f"taking over the state root {root} from a server that exited without unlocking "
                  f"(pid host port: {stale})", flush=True)  # fmt: skip
        if not keys:
            keys = ["openk3_" + secrets.token_hex(16)]
            print(f"no --api-key given; generated one: {keys[0]}", flush=True)
        try:
            image = build_image(_image_config(args.cache_dir))
            manager = SandboxManager(ManagerConfig(root=root, spec=spec), image)
            t0 = time.monotonic()
            manager.build_template(args.template)
            boot_s = time.monotonic() - t0
        except (RuntimeError, SandboxError) as e:
            print(f"openk3 sandbox: error: {e}", file=sys.stderr)
            return 1
        url = f"http://{args.host}:{sock.getsockname()[1]}"
        print(f"accelerator {manager.vmm.accel}; E2B_API_URL={url} E2B_SANDBOX_URL={url}", flush=True)

        # SIGINT or SIGTERM: running sandboxes are paused (they survive the restart) and the root unlocked here,
        # since after SIGTERM uvicorn's re-raise of the signal ends the process before `finally`
        def on_shutdown() -> None:
            manager.shutdown(pause_running=True)
            release_root(lock)

        app = create_app(manager, keys, health_interval_s=args.health_interval, on_shutdown=on_shutdown)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))

        def announce() -> None:  # once uvicorn accepts connections
            while not server.started:
                if server.should_exit:
                    return
                time.sleep(0.05)
            print(f"ready: {url} (template {args.template} booted in {boot_s:.1f} s)", flush=True)

        threading.Thread(target=announce, daemon=True).start()
        server.run(sockets=[sock])
        return 0
    finally:
        sock.close()
        release_root(lock)
