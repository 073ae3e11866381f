"""Checkpoint operations on a session: save and load its state, resume it in a new kernel, and save the
policy's adapter for samplers.

    p = sess.policy.save_state("step-20").result().path     # <run_dir>/checkpoints/step-20
    sess.policy.load_state(p).result()                      # or load_state("step-20")
    sess2 = wb.Session.from_checkpoint(p)                   # a new kernel continues the same run
    sess.policy.save_weights_for_sampler("step-20")         # <run_dir>/sampler_weights/step-20: a peft folder

A state checkpoint holds the whole session (policy and critic, optimizers, counters, RNG states, config),
whichever training client saved it; `workbench.session_state` lists its files. A sampler checkpoint is the
policy's adapter alone, in peft's format. Both are written atomically (`workbench.checkpoint_store`).

Saves run on the worker thread, so they capture the state between two operations, never in the middle
of one. A load reads and verifies every file first, in the caller's thread, and changes the session only
on the worker once everything has been checked against it.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench import checkpoint_store, session_state
from workbench.checkpoint_store import CheckpointError, check_name, kind_dir
from workbench.futures import APIFuture
from workbench.metrics import WandbSetting
from workbench.types import LoadWeightsResponse, SaveWeightsForSamplerResponse, SaveWeightsResponse

if TYPE_CHECKING:
    from workbench.session import Session

SAMPLER_ROLE = "policy"


def _log_event(sess: Session, kind: str, name: str, path: Path) -> None:
    """Tell W&B about the checkpoint; a W&B failure warns and never fails the save."""
    if sess.wandb_run is None:
        return
    payload = {"name": name, "kind": kind, "path": str(path), "step": sess.step}
    try:
        sess.wandb_run.log_event("checkpoint", payload)
    except Exception as error:
        warnings.warn(f"W&B did not record checkpoint {name!r}: {error!r}", RuntimeWarning, stacklevel=2)


def save_state(sess: Session, name: str, overwrite: bool) -> APIFuture[SaveWeightsResponse]:
    """Queue a save of the whole session state to `<run_dir>/checkpoints/<name>`."""
    sess._check_open()
    target = (kind_dir(sess.run_dir, "state") / check_name(name)).absolute()
    checkpoint_store.check_free(target, overwrite)

    def run() -> SaveWeightsResponse:
        checkpoint_store.write_atomically(target, session_state.capture(sess, name), overwrite)
        _log_event(sess, "state", name, target)
        return SaveWeightsResponse(path=str(target))

    return sess._worker.submit(run)


def resolve(sess: Session, path_or_name: str | Path) -> Path:
    """A checkpoint name of this session's run (`"step-20"`), else a folder path."""
    if isinstance(path_or_name, str) and checkpoint_store.is_name(path_or_name):
        own = kind_dir(sess.run_dir, "state") / path_or_name
        if own.is_dir():
            return checkpoint_store.require_checkpoint_folder(own)
    folder = Path(path_or_name).expanduser()
    if not folder.is_dir():
        names = [info.name for info in checkpoint_store.list_checkpoints(sess.run_dir) if info.kind == "state"]
        raise CheckpointError(
            f"Can't find a valid checkpoint at {str(path_or_name)!r}: no such folder, and no checkpoint of this "
            f"run has that name (this run has {names})"
        )
    return checkpoint_store.require_checkpoint_folder(folder)


def load_state(sess: Session, path_or_name: str | Path) -> APIFuture[LoadWeightsResponse]:
    """Verify and parse a state checkpoint now, then queue its restore into `sess` (see
    `session_state.restore` for how weight versions are set)."""
    sess._check_open()
    folder = resolve(sess, path_or_name)
    saved = session_state.read(folder)

    def run() -> LoadWeightsResponse:
        session_state.restore(saved, sess, exact_versions=False)
        return LoadWeightsResponse(path=str(folder.absolute()))

    return sess._worker.submit(run)


def from_checkpoint(
    session_class: type[Session],
    path: str | Path,
    device: str | None,
    run_dir: str | Path | None,
    wandb: WandbSetting,
) -> Session:
    """A new Session with the checkpoint's configuration and exact state (versions included).

    The run continues: the session's run folder is the checkpoint's own (`<run_dir>` for a checkpoint at
    `<run_dir>/checkpoints/<name>`) when that folder carries the saved run id as its name, else
    `<runs root>/<saved run id>`; the W&B run id is that folder's name, so W&B resumes the same run.
    """
    folder = checkpoint_store.require_checkpoint_folder(Path(path).expanduser())
    saved = session_state.read(folder)
    if run_dir is None:
        own = folder.absolute().parent.parent
        if folder.absolute().parent.name == checkpoint_store.STATE_DIR and own.name == saved.run_id:
            run_dir = own
        else:
            from workbench.session import default_run_dir

            run_dir = default_run_dir(saved.session_arguments["base_model"]).parent / saved.run_id
    sess = session_class(**saved.session_arguments, device=device, run_dir=run_dir, wandb=wandb)
    try:
        sess._worker.submit(lambda: session_state.restore(saved, sess, exact_versions=True)).result()
    except BaseException:
        sess.close()
        raise
    return sess


def save_weights_for_sampler(sess: Session, role: str, name: str, overwrite: bool) -> APIFuture[SaveWeightsForSamplerResponse]:
    """Queue a save of the policy's adapter to `<run_dir>/sampler_weights/<name>`: peft's
    `adapter_config.json` + `adapter_model.safetensors` (what `PeftModel.from_pretrained` and vLLM's
    `LoRARequest` load; the config names the base as the local folder or HF id it was loaded from),
    plus `sampler.json` (step, weights version, time) and the manifest, which both ignore."""
    sess._check_open()
    if role != SAMPLER_ROLE:
        raise ValueError(f"only the policy has sampler weights; the {role} has none")
    target = (kind_dir(sess.run_dir, "sampler") / check_name(name)).absolute()
    checkpoint_store.check_free(target, overwrite)

    def run() -> SaveWeightsForSamplerResponse:
        adapter = sess._adapters[role]
        info: Mapping[str, Any] = {
            "format_version": checkpoint_store.FORMAT_VERSION,
            "kind": "sampler",
            "name": name,
            "saved_at": time.time(),
            "step": adapter.step,
            "weights_version": adapter.weights_version,
            "run_id": sess.run_dir.name,
            "base_model": sess.base_info.identity(),
        }
        files = session_state.peft_adapter_files(sess._model, role, sess.base_info.path)
        files["sampler.json"] = checkpoint_store.json_bytes(info)
        checkpoint_store.write_atomically(target, files, overwrite)
        _log_event(sess, "sampler", name, target)
        return SaveWeightsForSamplerResponse(path=str(target))

    return sess._worker.submit(run)
