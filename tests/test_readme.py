"""The README's examples, run as written and in order against a live server.

Fenced `sh` and `python` blocks run one after another in one working directory, with `flint-sched`
on PATH (this checkout) and the session's flint-tiny cache. A block after
`<!-- readme-test: background -->` starts the server and the next blocks talk to it; a block after
`<!-- readme-test: skip: REASON -->` is skipped, saying why (a GPU, a 79 GB checkpoint, an install).
The one change: port 8000 becomes a free port, so a server already on 8000 cannot break the test.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from api_server import free_port, session_dir

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(?:<!-- readme-test: (?P<marker>[^>]*?) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)```", re.S)
BLOCK_TIMEOUT_S = 300


@dataclass(frozen=True)
class Snippet:
    index: int
    lang: str
    code: str
    marker: str | None

    @property
    def id(self) -> str:
        first = self.code.strip().splitlines()[0]
        return f"{self.index:02d}-{self.lang}-{first[:40]}"


def snippets() -> list[Snippet]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    found = [Snippet(i, m["lang"], m["code"], m["marker"]) for i, m in enumerate(BLOCK.finditer(text))]
    return [s for s in found if s.lang in ("sh", "python")]


SNIPPETS = snippets()


class Session:
    """The working directory, environment and background server the snippets share."""

    def __init__(self, base: Path, work: Path):
        self.port = free_port()
        self.work = work
        bin_dir = work / ".bin"
        bin_dir.mkdir()
        shim = bin_dir / "flint-sched"
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m flint_sched.cli "$@"\n')
        shim.chmod(0o755)
        self.env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
                    "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                    "FLINT_SCHED_CACHE": str(base / "cache"), "HF_HUB_OFFLINE": "1"}
        self.server: subprocess.Popen | None = None
        self.failed = False

    def code(self, snippet: Snippet) -> str:
        return snippet.code.replace("8000", str(self.port))

    def run(self, snippet: Snippet) -> subprocess.CompletedProcess:
        argv = (["bash", "-euo", "pipefail", "-c", self.code(snippet)] if snippet.lang == "sh"
                else [sys.executable, "-c", self.code(snippet)])
        return subprocess.run(argv, cwd=self.work, env=self.env, capture_output=True, text=True,
                              timeout=BLOCK_TIMEOUT_S, stdin=subprocess.DEVNULL)

    def start(self, snippet: Snippet) -> None:
        with open(self.work / "server.log", "wb") as log:
            self.server = subprocess.Popen(["bash", "-c", self.code(snippet)], cwd=self.work, env=self.env, stdout=log,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True)
        url = f"http://127.0.0.1:{self.port}/health"
        for _ in range(600):
            if self.server.poll() is not None:
                break
            try:
                if httpx.get(url, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"the README's server did not come up:\n{self.log()}")

    def log(self) -> str:
        return (self.work / "server.log").read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.server is not None and self.server.poll() is None:
            os.killpg(self.server.pid, signal.SIGTERM)          # the group this test started
            try:
                self.server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.server.pid, signal.SIGKILL)
                self.server.wait()


@pytest.fixture(scope="module")
def readme_session(request, tmp_path_factory):
    base = session_dir(request.config, tmp_path_factory)          # flint-tiny made once for every server
    session = Session(base, tmp_path_factory.mktemp("readme"))
    yield session
    session.stop()


def test_the_readme_has_runnable_examples():
    assert any(s.marker == "background" for s in SNIPPETS)
    assert sum(s.marker is None for s in SNIPPETS) >= 4
    for s in SNIPPETS:
        assert s.marker in (None, "background") or s.marker.startswith("skip: "), s.marker


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_readme_snippet(snippet: Snippet, readme_session: Session):
    if snippet.marker and snippet.marker.startswith("skip: "):
        pytest.skip(snippet.marker.removeprefix("skip: "))
    if readme_session.failed:
        pytest.fail("an earlier README example failed; the ones after it depend on it")
    if "curl " in snippet.code and shutil.which("curl") is None:
        pytest.skip("curl is not installed on this machine")
    readme_session.failed = True
    if snippet.marker == "background":
        readme_session.start(snippet)
        assert "KV cache" in readme_session.log() and "random weights" in readme_session.log()   # the summary
    else:
        result = readme_session.run(snippet)
        server = f"\nserver log:\n{readme_session.log()}" if readme_session.server else ""
        assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}{server}"
    readme_session.failed = False
