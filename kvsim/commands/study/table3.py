"""``kvsim study table3``: WnW ablations A1–A3 (WnW §3.8, Table 3): n_voice, prefill selection and triage signal as replay proxies and live WER, beside the paper."""

from __future__ import annotations

import time
from pathlib import Path

from kvsim.commands.study import OutOption, QuickOption, default_out
from kvsim.commands.study._wnw_sweep import (
    CalibTracesOption,
    DatasetRootOption,
    DeviceOption,
    HeadsOption,
    LambdaFitOption,
    LimitOption,
    MaxNewOption,
    MaxStepsOption,
    ModelOption,
    NoLiveOption,
    NoReplayOption,
    RayOption,
    SweepArgs,
    TracesArg,
    run_sweep_study,
)


def table3(
    traces: TracesArg = None,
    calibration: HeadsOption = None,
    calibration_traces: CalibTracesOption = None,
    lambda_fit: LambdaFitOption = "measured",
    dataset_root: DatasetRootOption = Path("data/minivox"),
    limit: LimitOption = 8,
    max_new_tokens: MaxNewOption = 300,
    no_live: NoLiveOption = False,
    no_replay: NoReplayOption = False,
    model: ModelOption = "minivox",
    device: DeviceOption = "cpu",
    ray: RayOption = None,
    max_steps: MaxStepsOption = None,
    quick: QuickOption = False,
    out: OutOption = None,
) -> None:
    """WnW ablations A1–A3 (WnW §3.8, Table 3): n_voice, prefill selection and triage signal as replay proxies and live WER, beside the paper.

    --quick: the first and last setting of each sweep, 2 live clips.
    """
    from kvsim.studies.table3 import table3_report

    t0 = time.perf_counter()
    out = default_out("table3", out)
    args = SweepArgs(traces, calibration, calibration_traces, dataset_root, limit, max_new_tokens,
                     no_live, no_replay, model, device, ray, max_steps, quick, out,
                     lambda_fit=lambda_fit)
    run_sweep_study(table3_report, args, t0)


COMMAND = table3
