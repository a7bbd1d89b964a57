"""Live decoding as Ray tasks: ``kvsim live --ray`` and a study's live grid on a cluster.

One task per input decodes every method of the plan on it (all share one prefill, as in
process); each worker process loads the model once and keeps it for the tasks that follow.
The tasks return their rows, step logs and log lines; the driver writes them through the same
:class:`~kvsim.rundir.RunDir` calls as :func:`kvsim.live.run.run_live`, so the run folder
(parts, ``run.json``, ``--resume``, one line per failed input) is the same as a local run's.

Inputs, ``--calibration`` files and model checkpoints are read by the workers at the paths
the driver gives: on a cluster of several machines they must be on a shared file system, and
kvsim installed on every node.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import polars as pl

from kvsim.cluster import connect
from kvsim.live.data import LiveInput
from kvsim.live.decode import LiveRun
from kvsim.live.models import LiveModel
from kvsim.live.run import (
    LiveJob,
    decode_input,
    finish_run,
    pending_inputs,
    record_failure,
    record_input,
)

if TYPE_CHECKING:
    from kvsim.rundir import RunDir

#: The one-line error when Ray is not installed (the same as ``kvsim replay --ray``'s).


@dataclass(frozen=True)
class ModelSpec:
    """The backbone each worker loads: ``--model``, ``--device``, ``--dtype``."""

    name: str
    device: str = "cpu"
    dtype: str = "float32"

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")


@dataclass
class InputOutcome:
    """What one task sends back: the input's rows and step logs, or the one-line error."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    logs: list[tuple[str, LiveRun]] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)  #: the log lines, in order
    error: str | None = None


def check_model(name: str) -> None:
    """Reject an unknown ``--model`` in the driver (one line), without loading it: the
    workers load it."""
    kind, _, arg = name.partition(":")
    if kind == "tiny":
        if arg and not arg.isdigit():
            raise ValueError(f"--model {name}: the tiny backbone's seed must be an integer")
        return
    from kvsim.tracer.backbones import BackboneError, resolve_model

    try:
        resolve_model(name)
    except BackboneError as exc:
        raise ValueError(str(exc)) from None


_WORKER_MODEL: dict[ModelSpec, LiveModel] = {}  #: the model this worker process holds


def worker_model(spec: ModelSpec) -> LiveModel:
    """The backbone of ``spec``, loaded on the first task a worker process runs and kept for
    the next ones (a worker holds one model at a time)."""
    if spec not in _WORKER_MODEL:
        import torch

        from kvsim.live.models import load_backbone

        # Ray sets OMP_NUM_THREADS to the task's CPUs; torch is told the same, as kvsim live is
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        _WORKER_MODEL.clear()
        _WORKER_MODEL[spec] = load_backbone(spec.name, device=spec.device, dtype=spec.dtype)
    return _WORKER_MODEL[spec]


def decode_task(model: ModelSpec, job: LiveJob, item: LiveInput) -> InputOutcome:
    """The Ray task: every method of ``job.plan`` on ``item``, as :func:`run_live` does it
    for one input; an input that cannot be read or decoded comes back as its one-line error."""
    from kvsim.rundir import input_error

    outcome = InputOutcome()
    try:
        lm = worker_model(model)
        outcome.rows, outcome.logs = decode_input(lm, job, item, set(), outcome.messages.append)
    except Exception as exc:  # isolation: this input fails, the others go on
        outcome.rows, outcome.logs = [], []
        outcome.error = input_error(item.audio_path, exc)
    return outcome


def run_live_on_ray(address: str, model: ModelSpec, job: LiveJob, out: RunDir | None = None,
                    log: Callable[[str], None] = print) -> pl.DataFrame:
    """:func:`kvsim.live.run.run_live` with one Ray task per input on the cluster at
    ``address``; each input is kept in ``out`` as its task finishes.

    With ``model.device`` cuda each task requests one GPU (and its worker keeps the model
    across tasks); otherwise one CPU.
    """
    ray = connect(address)
    task = ray.remote(**task_resources(model))(decode_task)
    shared = ray.put(replace(job, inputs=()))  # the plan and config, sent to the store once
    pending = {task.remote(model, shared, item): item for item in pending_inputs(job, out)}
    rows: list[dict[str, Any]] = []
    shown: set[str] = set()
    while pending:
        [ref], _ = ray.wait(list(pending), num_returns=1)
        item = pending.pop(ref)
        outcome = _collect(ray, ref, item)
        _relay(outcome.messages, shown, log)
        if outcome.error is not None:
            record_failure(out, item, outcome.error, log)
            continue
        rows += outcome.rows
        record_input(out, item, outcome.rows, outcome.logs)
    return finish_run(out, rows, job)


def task_resources(model: ModelSpec) -> dict[str, int]:
    """What each task asks Ray for: one GPU when the model runs on cuda, else one CPU.
    ``max_calls=0`` keeps a GPU worker alive between tasks (Ray's default for GPU tasks, one
    call per worker, would load the model again for every input)."""
    return {"num_gpus": 1, "max_calls": 0} if model.on_gpu else {"num_cpus": 1}


def _collect(ray: Any, ref: Any, item: LiveInput) -> InputOutcome:
    """The task's outcome; a task whose worker died (killed, out of memory) is the input's
    failure, in one line."""
    try:
        return ray.get(ref)
    except Exception as exc:
        return InputOutcome(error=f"{item.audio_path}: the Ray task failed ({type(exc).__name__})")


def _relay(messages: list[str], shown: set[str], log: Callable[[str], None]) -> None:
    """Pass a task's log lines on; a policy skipped for want of calibration is reported once
    over the run, as in process (every task finds it anew)."""
    for message in messages:
        if message.startswith("skipping "):
            if message in shown:
                continue
            shown.add(message)
        log(message)
