"""A test that kills its process (a native crash in llama.cpp, say) is reported, not fatal."""

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_crashing_test_is_reported_and_the_run_goes_on(tmp_path):
    (tmp_path / "test_crash.py").write_text(textwrap.dedent(
        """
        import os, signal

        def test_segfaults():
            os.kill(os.getpid(), signal.SIGSEGV)

        def test_runs_after_the_crash():
            assert True
        """
    ))
    # the repository's own pytest settings (pyproject.toml), applied to the file above
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path),
         "-p", "no:cacheprovider", str(tmp_path / "test_crash.py")],
        capture_output=True, text=True, timeout=300,
    )
    output = result.stdout + result.stderr
    assert "1 failed, 1 passed" in output, output[-3000:]
    assert "crashed" in output, output[-3000:]
