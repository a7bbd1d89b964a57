"""Shared fixtures: small synthetic traces written once per session."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import importlib.abc  # noqa: E402
import importlib.util  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hypothesis import Phase, settings  # noqa: E402

# scripts/mutation_test.sh runs the tests with --hypothesis-profile=mutation: a mutant that fails
# a property test is caught by its first failing example, and shrinking that example on a
# loaded machine can outlast mutmut's time limit (a "timeout" where the mutant was killed)
settings.register_profile("mutation", phases=[Phase.explicit, Phase.reuse, Phase.generate])

#: the repository's top-level rooms and the names they install as (pyproject.toml)
_ROOMS = {"kvsim.policies": "policies", "kvsim.tracer": "tracer", "kvsim.live": "live",
          "kvsim.studies": "studies", "kvsim.minivox": "minivox"}


class _ThisCheckout(importlib.abc.MetaPathFinder):
    """Import ``kvsim.policies``, ``kvsim.live``, ... from the checkout these tests are in,
    whatever an editable install maps them to: a second checkout, or mutmut's copy of the
    source under ``mutants/``, then tests its own code. Rooms missing here fall through."""

    root = Path(__file__).resolve().parents[1]

    def find_spec(self, fullname, path=None, target=None):
        folder = _ROOMS.get(fullname)
        init = self.root / folder / "__init__.py" if folder else None
        if init is None or not init.is_file():
            return None
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=[str(init.parent)])


sys.meta_path.insert(0, _ThisCheckout())

from kvsim.synth import SynthConfig, synthesize  # noqa: E402
from kvsim.trace import Trace, write_trace  # noqa: E402


@pytest.fixture(scope="session")
def small_trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 'small'-shape synthetic trace (4 layers, 8 q / 2 kv heads, D=32), with values."""
    d = tmp_path_factory.mktemp("traces")
    return write_trace(d / "small.kvtrace",
                       synthesize(SynthConfig(preset="small", audio_seconds=24, decode_steps=40, seed=3)))


@pytest.fixture()
def small_trace(small_trace_path: Path) -> Trace:
    return Trace(small_trace_path)


def load_script(name: str):
    """The module of ``scripts/<name>.py`` (registered in ``sys.modules`` under ``name``, as a
    dataclass in it needs)."""
    spec = importlib.util.spec_from_file_location(name, _ThisCheckout.root / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def make_trace(path: Path, preset: str = "tiny", seconds: float = 8, steps: int = 12, seed: int = 0,
               values: bool = True) -> Path:
    return write_trace(path, synthesize(SynthConfig(preset=preset, audio_seconds=seconds,
                                                    decode_steps=steps, seed=seed, store_values=values)))
