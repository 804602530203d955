"""An optional compiled build of the span path.

    SPANVISOR_COMPILE=1 pip install --no-build-isolation -e .

compiles the modules every span goes through with mypyc (part of mypy, so the
environment needs the test extra installed first). The same sources run
interpreted when it is not set; compiled, they judge ~25-30% more spans per
CPU-second (bench/ingest.py, side by side). Rebuild after editing any of them:
tests/conftest.py refuses to run against a compiled module older than its source.
"""

import os

from setuptools import setup

# Not compiled: supervisor/store.py (SQLite-bound, and tests subclass Store), and the
# settings of breakers, budgets and restart intensity (policies/_limit_settings.py:
# compiled, a dataclass would reject a wrong type with a bare TypeError before its
# own clear check).
COMPILED = [
    "supervisor/normalize/__init__.py",
    "supervisor/normalize/attributes.py",
    "supervisor/normalize/evidence.py",
    "supervisor/normalize/genai.py",
    "supervisor/normalize/http_rpc.py",
    "supervisor/normalize/openinference.py",
    "supervisor/normalize/openllmetry.py",
    "supervisor/normalize/screen.py",
    "supervisor/normalize/walk.py",
    "supervisor/normalize/wire.py",
    "supervisor/pipeline.py",
    "supervisor/runs.py",
    "supervisor/records.py",
    "supervisor/bounded.py",
    "supervisor/failure_log.py",
    "supervisor/act.py",
    "supervisor/commands.py",
    "supervisor/telemetry.py",
    "supervisor/ingest/queue.py",
    "supervisor/ingest/codec.py",
    "policies/_actions.py",
    "policies/_governor.py",
    "policies/_backoff.py",
    "policies/_compile.py",
    "policies/_glob.py",
    "policies/_spend.py",
    "policies/_detectors.py",
    "policies/_breakers.py",
    "policies/_budget.py",
    "policies/_intensity.py",
    "policies/_cascade.py",
    "policies/_match.py",
    "policies/_policy.py",
]

ext_modules = []
if os.environ.get("SPANVISOR_COMPILE", "0") not in ("", "0"):
    from mypyc.build import mypycify

    ext_modules = mypycify(COMPILED, opt_level="3")
    for extension in ext_modules:
        # No compiler here: install the interpreted package rather than fail.
        extension.optional = True

setup(ext_modules=ext_modules)
