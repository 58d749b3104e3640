"""The guest image: a Debian cloud kernel, a busybox initramfs with the virtio modules, and a Debian root
filesystem with python3 and the in-guest agent, all built from Debian packages and cached.

Layout of a built image directory (``ImageConfig.cache_dir / <key>``)::

    vmlinux        the kernel as an uncompressed ELF (booted through its PVH entry, no decompressor)
    initrd.cpio.gz busybox-static, the virtio modules, /init (mounts /dev/vda, switch_root)
    rootfs.qcow2   ext4 root file system (bookworm minbase + python3 + bash), agent in /opt/openk3
    image.json     what went in (package versions, the key)

The key hashes everything that changes the bytes (suite, kernel package, package list, agent and init
sources), so a changed agent rebuilds the ext4 image (seconds) but reuses the mmdebstrap tarball, which is
cached apart under its own key (it is the slow step: about two minutes).

Needs root (mmdebstrap ``--mode=root``, extracting device nodes) and the Debian packages
``qemu-utils mmdebstrap busybox-static cpio lz4 e2fsprogs``; :func:`missing_tools` names what is absent.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from openk3.sandbox import guest_agent

MODULE_ORDER = (
    "virtio_ring",
    "virtio",
    "virtio_mmio",
    "virtio_blk",
    "failover",
    "net_failover",
    "virtio_net",
)
"""Kernel modules the guest needs, in load order (the cloud kernel has no modules.dep; the order follows
each module's ``depends=``)."""

TOOLS = ("apt-get", "dpkg-deb", "mmdebstrap", "mkfs.ext4", "qemu-img", "cpio", "lz4", "busybox")

INIT_INITRAMFS = """#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in {modules}; do insmod /lib/modules/$m.ko; done
mkdir -p /newroot
mount -t ext4 -o rw /dev/vda /newroot || {{ echo "openk3: cannot mount /dev/vda"; poweroff -f; }}
umount /proc /sys /dev
exec switch_root /newroot /sbin/openk3-init
"""

INIT_ROOTFS = """#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
hostname sandbox
ip link set lo up
ip addr add 10.0.2.15/24 dev eth0
ip link set eth0 up
exec /usr/bin/python3 -u /opt/openk3/agent.py
"""


@dataclasses.dataclass(frozen=True)
class ImageConfig:
    """What goes into a guest image.

    suite: Debian release of the kernel and the root file system (``bookworm``).
    kernel_package: the Debian package of the kernel; its ``.deb`` comes from ``apt-get download``.
    packages: extra Debian packages in the root file system (``bash`` is required: the e2b SDK runs every
        command as ``/bin/bash -l -c``; ``python3`` runs the agent).
    disk_mib: size of the guest's ext4 root file system in MiB.
    cache_dir: where built images (and the mmdebstrap tarball) are kept between runs.
    """

    suite: str = "bookworm"
    kernel_package: str = "linux-image-cloud-amd64"
    packages: tuple[str, ...] = ("python3", "bash", "procps", "iproute2", "coreutils")
    disk_mib: int = 1024
    cache_dir: Path = dataclasses.field(default_factory=lambda: default_cache_dir() / "images")

    def __post_init__(self):
        if "bash" not in self.packages or "python3" not in self.packages:
            raise ValueError(f"ImageConfig.packages must include bash and python3, got {self.packages}")
        if self.disk_mib < 512:
            raise ValueError(
                f"ImageConfig.disk_mib must be >= 512 (the root file system is ~300 MiB), got {self.disk_mib}"
            )


@dataclasses.dataclass(frozen=True)
class Image:
    """A built guest image: paths of its three files."""

    root: Path

    @property
    def kernel(self) -> Path:
        return self.root / "vmlinux"

    @property
    def initrd(self) -> Path:
        return self.root / "initrd.cpio.gz"

    @property
    def rootfs(self) -> Path:
        return self.root / "rootfs.qcow2"

    @property
    def key(self) -> str:
        return self.root.name


def default_cache_dir() -> Path:
    """``$OPENK3_SANDBOX_CACHE`` or ``~/.cache/openk3/sandbox``."""
    return Path(os.environ.get("OPENK3_SANDBOX_CACHE", Path.home() / ".cache" / "openk3" / "sandbox"))


def missing_tools() -> list[str]:
    """Host tools the build needs that are not on ``PATH``."""
    return [t for t in TOOLS if shutil.which(t) is None]


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if result.returncode != 0:
        raise RuntimeError(
            f"image build: {' '.join(cmd[:3])} ... failed ({result.returncode}): {result.stderr.strip()[-800:]}"
        )
    return result


def _kernel_version(config: ImageConfig) -> str:
    """The concrete ``linux-image-<abi>-cloud-amd64`` the meta package depends on, e.g. ``6.1.0-57``."""
    out = _run(["apt-cache", "depends", config.kernel_package]).stdout
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("Depends: linux-image-"):
            return line.split(": ", 1)[1]
    raise RuntimeError(
        f"image build: apt-cache knows no kernel behind {config.kernel_package!r} (run apt-get update)"
    )


def image_key(config: ImageConfig, kernel_pkg: str) -> str:
    h = hashlib.sha256()
    for part in (config.suite, kernel_pkg, " ".join(config.packages), str(config.disk_mib)):
        h.update(part.encode() + b"\0")
    h.update(Path(guest_agent.__file__).read_bytes())
    h.update(INIT_INITRAMFS.encode() + INIT_ROOTFS.encode() + " ".join(MODULE_ORDER).encode())
    return h.hexdigest()[:16]


def find_image(config: ImageConfig) -> Image | None:
    """The newest built image for ``config`` without touching apt (``None`` if there is none)."""
    if not config.cache_dir.is_dir():
        return None
    built = [p for p in config.cache_dir.iterdir() if (p / "image.json").is_file()]
    for p in sorted(built, key=lambda p: p.stat().st_mtime, reverse=True):
        meta = json.loads((p / "image.json").read_text())
        if meta.get("packages") == list(config.packages) and meta.get("agent_sha") == _agent_sha():
            return Image(p)
    return None


def _agent_sha() -> str:
    return hashlib.sha256(Path(guest_agent.__file__).read_bytes()).hexdigest()


def _extract_vmlinux(bzimage: Path, out: Path) -> None:
    """The Debian cloud kernel is an LZ4 bzImage: cut the payload at the LZ4 legacy magic and decompress it,
    giving the ELF vmlinux (which QEMU boots through the PVH note)."""
    data = bzimage.read_bytes()
    start = data.find(b"\x02\x21\x4c\x18")
    if start < 0:
        raise RuntimeError(f"image build: {bzimage} holds no LZ4 payload (not a cloud kernel?)")
    with tempfile.NamedTemporaryFile(suffix=".lz4") as f:
        f.write(data[start:])
        f.flush()
        with open(out, "wb") as o:
            # lz4 stops at the end of the frame and complains about the trailing bytes; the ELF is complete.
            subprocess.run(["lz4", "-dc", f.name], stdout=o, stderr=subprocess.DEVNULL)
    if out.read_bytes()[:4] != b"\x7fELF":
        raise RuntimeError(f"image build: decompressing {bzimage} gave no ELF")


def _build_kernel(work: Path, kernel_pkg: str, out: Image) -> str:
    debs = work / "debs"
    debs.mkdir()
    _run(["apt-get", "download", kernel_pkg], cwd=debs)
    deb = next(debs.glob("*.deb"))
    tree = work / "kernel"
    _run(["dpkg-deb", "-x", str(deb), str(tree)])
    _extract_vmlinux(next((tree / "boot").glob("vmlinuz-*")), out.kernel)
    # initramfs: busybox + modules + /init
    ird = work / "initrd"
    for d in ("bin", "proc", "sys", "dev", "lib/modules", "newroot"):
        (ird / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(shutil.which("busybox"), ird / "bin" / "busybox")
    kos = {p.name[:-3]: p for p in (tree / "lib" / "modules").rglob("*.ko")}
    for m in MODULE_ORDER:
        if m not in kos:
            raise RuntimeError(f"image build: module {m}.ko not in {deb.name}")
        shutil.copy2(kos[m], ird / "lib" / "modules" / f"{m}.ko")
    init = ird / "init"
    init.write_text(INIT_INITRAMFS.format(modules=" ".join(MODULE_ORDER)))
    init.chmod(0o755)
    files = "\n".join(str(p.relative_to(ird)) for p in sorted(ird.rglob("*"))) + "\n"
    cpio = subprocess.run(
        ["cpio", "-o", "-H", "newc", "--quiet"], cwd=ird, input=files.encode(), capture_output=True
    )
    if cpio.returncode != 0:
        raise RuntimeError(f"image build: cpio failed: {cpio.stderr.decode()[-400:]}")
    out.initrd.write_bytes(gzip.compress(cpio.stdout, compresslevel=1))
    return deb.name


def _rootfs_tar(config: ImageConfig) -> Path:
    """The mmdebstrap tarball, cached under a key of suite and package list."""
    key = hashlib.sha256((config.suite + " " + " ".join(config.packages)).encode()).hexdigest()[:16]
    tar = config.cache_dir / f"rootfs-{config.suite}-{key}.tar"
    if not tar.exists():
        tmp = tar.with_suffix(".tmp")
        _run(["mmdebstrap", "--variant=minbase", f"--include={','.join(config.packages)}", "--mode=root",
              "--format=tar", config.suite, str(tmp)])  # fmt: skip
        tmp.rename(tar)
    return tar


def _build_rootfs(work: Path, config: ImageConfig, out: Image) -> None:
    root = work / "root"
    root.mkdir()
    _run(["tar", "-C", str(root), "-xf", str(_rootfs_tar(config))])
    (root / "opt" / "openk3").mkdir(parents=True)
    shutil.copy2(guest_agent.__file__, root / "opt" / "openk3" / "agent.py")
    init = root / "sbin" / "openk3-init"
    init.write_text(INIT_ROOTFS)
    init.chmod(0o755)
    raw = work / "rootfs.ext4"
    _run(["mkfs.ext4", "-q", "-F", "-L", "openk3", "-d", str(root), str(raw), f"{config.disk_mib}M"])
    _run(["qemu-img", "convert", "-O", "qcow2", str(raw), str(out.rootfs)])


def build_image(config: ImageConfig | None = None, force: bool = False) -> Image:
    """Build (or reuse from the cache) the guest image for ``config``; returns its paths.

    Raises RuntimeError naming the failed step, or the missing host tools, or that root is needed.
    """
    config = config or ImageConfig()
    missing = missing_tools()
    if missing:
        raise RuntimeError(
            f"image build needs {', '.join(missing)} (apt-get install qemu-utils mmdebstrap busybox-static cpio lz4)"
        )
    kernel_pkg = _kernel_version(config)
    out = Image(config.cache_dir / image_key(config, kernel_pkg))
    if (out.root / "image.json").exists() and not force:
        return out
    if os.geteuid() != 0:
        raise RuntimeError(
            "image build needs root (mmdebstrap --mode=root, device nodes in the root file system)"
        )
    config.cache_dir.mkdir(parents=True, exist_ok=True)
    if out.root.exists():
        shutil.rmtree(out.root)
    staging = Image(Path(tempfile.mkdtemp(prefix="img-", dir=config.cache_dir)))
    with tempfile.TemporaryDirectory(prefix="openk3-image-", dir=config.cache_dir) as tmp:
        deb = _build_kernel(Path(tmp), kernel_pkg, staging)
        _build_rootfs(Path(tmp), config, staging)
    meta = {"key": out.key, "suite": config.suite, "kernel_deb": deb, "packages": list(config.packages),
            "disk_mib": config.disk_mib, "agent_sha": _agent_sha()}  # fmt: skip
    (staging.root / "image.json").write_text(json.dumps(meta, indent=1))
    staging.root.rename(out.root)
    return out
