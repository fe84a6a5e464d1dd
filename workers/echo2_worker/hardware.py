"""What this machine offers, found without importing torch (so `join` starts fast): GPUs via
nvidia-smi, the backends installed, and the address peers would reach the relay at."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
from dataclasses import dataclass
from urllib.parse import urlparse

MAX_GPUS, MAX_VRAM_GB = 64, 4096  # the bounds registration accepts (echo2.protocol.WorkerRegister)


@dataclass
class Gpus:
    model: str = "cpu"
    count: int = 0
    vram_gb: float = 0.0


def detect_gpus() -> Gpus:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return Gpus()
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return Gpus()
    rows = [[c.strip() for c in line.split(",")] for line in out.strip().splitlines() if line.strip()]
    if not rows:
        return Gpus()
    name = rows[0][0].removeprefix("NVIDIA ").strip()[:64] or "gpu"
    try:
        vram = float(rows[0][1]) / 1024
    except (IndexError, ValueError):
        vram = 0.0
    return Gpus(model=name, count=len(rows), vram_gb=round(vram, 1))


def with_memory(gpus: Gpus) -> Gpus:
    """A CPU worker generates in RAM: it offers the machine's memory where a GPU worker offers VRAM
    (jobs state the memory a worker needs; `--gpus cpu:0:GB` offers less)."""
    if gpus.count == 0 and not gpus.vram_gb:
        gpus.vram_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return gpus


def parse_gpus(spec: str) -> Gpus:
    """`auto`, `none`/`cpu`, `N`, `MODEL`, `MODELxN` or `MODEL:N[:VRAM_GB]` (e.g. `H100:8:80`). A GPU's VRAM
    left out is taken from nvidia-smi: registered with none, the scheduler would never give the worker a job."""
    spec = spec.strip()
    if spec == "auto":
        return _with_vram(spec, detect_gpus())
    if spec.lower() in ("none", "cpu", "0"):
        return Gpus()
    if spec.isdigit():
        found = detect_gpus()
        return _with_vram(spec, Gpus(found.model if found.count else "gpu", int(spec), found.vram_gb))
    parts = spec.split(":")
    if len(parts) == 1 and "x" in spec and spec.rsplit("x", 1)[1].isdigit():
        model, count = spec.rsplit("x", 1)
        return _with_vram(spec, Gpus(model.strip(), int(count)))
    try:
        count = int(parts[1]) if len(parts) > 1 else 1
        vram = float(parts[2]) if len(parts) > 2 else 0.0
    except ValueError:
        raise ValueError(f"--gpus {spec!r}: expected MODEL:COUNT[:VRAM_GB], e.g. H100:8:80") from None
    return _with_vram(spec, Gpus(parts[0].strip()[:64], count, vram))


def _with_vram(spec: str, gpus: Gpus) -> Gpus:
    """The spec's GPUs with their VRAM, from nvidia-smi where the spec leaves it out; refused without any, and
    outside what registration accepts (WorkerRegister: 0-64 GPUs, 0-4096 GiB)."""
    if not 0 <= gpus.count <= MAX_GPUS or not 0 <= gpus.vram_gb <= MAX_VRAM_GB:
        raise ValueError(f"--gpus {spec!r}: expected 0 to {MAX_GPUS} GPUs of 0 to {MAX_VRAM_GB} GiB each, "
                         "e.g. H100:8:80")
    if gpus.count and not gpus.vram_gb:
        gpus.vram_gb = detect_gpus().vram_gb
    if gpus.count and not gpus.vram_gb:
        raise ValueError(f"--gpus {spec!r}: nvidia-smi reports no GPU memory on this machine, so say how much each "
                         f"GPU has: --gpus MODEL:COUNT:VRAM_GB, e.g. --gpus {gpus.model}:{gpus.count}:80 (or "
                         "--gpus none for a CPU worker)")
    return gpus


def installed_backends() -> list[str]:
    names = []
    if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
        names.append("transformers")
    if importlib.util.find_spec("vllm"):
        names.append("vllm")
    return names


def choose_backend(requested: str, gpus: Gpus) -> str:
    have = installed_backends()
    if requested == "auto":
        if "vllm" in have and gpus.count > 0:
            return "vllm"
        if "transformers" in have:
            return "transformers"
        if "vllm" in have:
            return "vllm"
        raise ValueError("no generation backend installed: pip install 'echo2-worker[cpu]' or 'echo2-worker[vllm]'")
    if requested not in have:
        extra = "cpu" if requested == "transformers" else "vllm"
        raise ValueError(f"backend {requested} is not installed: pip install 'echo2-worker[{extra}]'")
    return requested


def reachable_host(server_url: str) -> str:
    """The local address that routes to the server: where peers on the same network reach us."""
    parsed = urlparse(server_url)
    host = parsed.hostname or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, parsed.port or 80))  # no packet is sent for UDP connect
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"
