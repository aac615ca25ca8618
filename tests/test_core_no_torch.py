"""core/ and sampling_params are pure Python: importing them must not pull in torch (or numpy)."""

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import sys
import flint_sched.core
import flint_sched.core.kv_allocator, flint_sched.core.plan, flint_sched.core.request
import flint_sched.core.scheduler, flint_sched.core.scheduler_config
import flint_sched.sampling_params
heavy = sorted(name for name in ("torch", "numpy") if name in sys.modules)
print(",".join(heavy))
"""


def test_importing_core_does_not_import_torch():
    python_path = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=python_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"core imported {result.stdout.strip()}"
