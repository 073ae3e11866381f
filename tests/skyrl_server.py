"""SkyRL's own Tinker server (`skyrl[tinker,jax]==0.4.0`, JAX backend on the CPU) in a subprocess.

`make skyrl-env` installs it into `.cache/skyrl` (its own Python 3.12 environment, made with uv). The
server reads its own command line and starts its engine with the same `uv run` flags, so it is
launched as `uv run --no-project --python <that environment> -m skyrl.tinker.api ...`; the whole
process group (uv, the API server, its engine) is stopped at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
SKYRL_ENV = ROOT / ".cache" / "skyrl"
UV = SKYRL_ENV / "uv" / "bin" / "uv"
PYTHON = SKYRL_ENV / ".venv" / "bin" / "python"
INSTALLED = SKYRL_ENV / ".installed"
START_TIMEOUT_S = 600.0


def skyrl_installed() -> bool:
    return INSTALLED.exists()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class SkyRLServer:
    """`skyrl.tinker.api` on a free port, with its own database and checkpoints under `folder`."""

    def __init__(self, folder: Path, base_model: Path, max_lora_adapters: int = 4):
        self.base_model = str(base_model)
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = folder / "skyrl-server.log"
        command = [str(UV), "run", "--no-project", "--python", str(PYTHON), "-m", "skyrl.tinker.api"]
        command += ["--base-model", self.base_model, "--backend", "jax"]
        command += [
            "--backend-config",
            json.dumps({"max_lora_adapters": max_lora_adapters, "max_lora_rank": 32}),  # its default rank
        ]
        command += ["--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1]]
        command += ["--database-url", f"sqlite:///{folder / 'skyrl.sqlite'}"]
        command += ["--checkpoints-base", str(folder / "checkpoints")]
        env = {**os.environ, "PATH": f"{UV.parent}{os.pathsep}{os.environ['PATH']}", "JAX_PLATFORMS": "cpu"}
        env.pop("VIRTUAL_ENV", None)
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"SkyRL's server exited ({self.process.returncode}):\n{self.log_tail()}")
            try:
                httpx.get(f"{self.url}/api/v1/healthz", timeout=2).raise_for_status()
                return
            except httpx.HTTPError:
                time.sleep(1)
        self.stop()
        raise RuntimeError(f"SkyRL's server did not answer within {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM to the process group (uv, the API server, its engine), then SIGKILL to what is left."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)
