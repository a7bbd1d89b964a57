"""The trace format: the contract between tracer, replay engine and studies."""

from kvsim.trace.reader import Trace, find_traces
from kvsim.trace.schema import ModelFacts, TraceError, TraceMeta
from kvsim.trace.writer import TraceData, positions_frame, write_trace

__all__ = [
    "ModelFacts",
    "Trace",
    "TraceData",
    "TraceError",
    "TraceMeta",
    "find_traces",
    "positions_frame",
    "write_trace",
]
