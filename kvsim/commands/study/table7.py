"""``kvsim study table7``: WnW hyperparameter sensitivity (WnW App. C, Table 7): chunk size, anchor count, δ, top-k and stride at r_GPU 0.2 as replay proxies and live WER."""

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


def table7(
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
    """WnW hyperparameter sensitivity (WnW App. C, Table 7): chunk size, anchor count, δ, top-k and stride at r_GPU 0.2 as replay proxies and live WER.

    --quick: the first and last setting of each sweep, 2 live clips.
    """
    from kvsim.studies.table7 import table7_report

    t0 = time.perf_counter()
    out = default_out("table7", out)
    args = SweepArgs(traces, calibration, calibration_traces, dataset_root, limit, max_new_tokens,
                     no_live, no_replay, model, device, ray, max_steps, quick, out,
                     lambda_fit=lambda_fit)
    run_sweep_study(table7_report, args, t0)


COMMAND = table7
