"""Every fenced ``python`` and ``r`` block of the user docs runs as written.

The docs are README.md, docs/*.md and r/ampkit/README.md. A block is a fence whose info
string starts with ``python`` or ``r``; words after the language mark how it runs:

- ``cuda``: needs a CUDA GPU (```` ```python cuda ````): run where there is one, skipped
  without;
- ``torchrun``: a script for ``torchrun`` (it calls ``dist.init_process_group()``): run as
  the one rank of a one-process job (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT`` set, as torchrun sets them).

Any other word fails the inventory test, so a typo cannot hide a block. Every block runs on
its own: a Python block in a fresh process forked from one that has imported torch and
ampkit (a ``cuda`` block in a new interpreter: CUDA cannot start in a forked child), an R block in a fresh process forked from an R that has loaded (not attached) this
worktree's R package, installed in a temporary library, and started its Python. Forking
keeps the whole file fast: the blocks pay for their own work, not for starting torch. Shell, YAML and plain fences are
not run. R blocks are skipped (saying so) only where R is not installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")), "r/ampkit/README.md"]
LANGUAGES = ("python", "r")
MARKS = ("cuda", "torchrun")
BLOCK_SECONDS = 300  # a block that runs longer is killed and fails (exit 124)
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^`]*)$")


@dataclass(frozen=True)
class Block:
    id: str  # "docs/autocast.md:42", the line of the opening fence
    language: str
    marks: tuple[str, ...]
    code: str


def read_blocks(doc: str) -> list[Block]:
    """The python and r blocks of one doc, in order, with the line of each opening fence."""
    blocks, lines = [], (REPO / doc).read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.group(1), m.group(2), m.group(3).split()
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence) and not lines[i].strip().strip(fence[0])):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        if info and info[0] in LANGUAGES:
            blocks.append(Block(f"{doc}:{start}", info[0], tuple(info[1:]), "\n".join(body) + "\n"))
    return blocks


BLOCKS = [b for doc in DOCS for b in read_blocks(doc)]
CUDA = [b for b in BLOCKS if "cuda" in b.marks]
RUN = [b for b in BLOCKS if "cuda" not in b.marks]


def fence_lines(doc: str) -> int:
    """python and r opening fences counted without the parser (which must find each one)."""
    return sum(bool(re.match(r"^\s*(`{3,}|~{3,})\s*(python|r)(\s|$)", line)) for line in (REPO / doc).read_text().splitlines())


def test_every_block_is_found_and_its_marks_are_known():
    listing = "\n".join(f"  {b.id} {b.language} {' '.join(b.marks)}" for b in BLOCKS)
    print(f"{len(BLOCKS)} blocks ({len(RUN)} to run on a CPU, {len(CUDA)} marked cuda):\n{listing}")
    assert len(BLOCKS) == sum(fence_lines(doc) for doc in DOCS)
    unknown = {b.id: m for b in BLOCKS for m in b.marks if m not in MARKS}
    assert not unknown, f"unknown marks (valid: {MARKS}): {unknown}"
    assert all(b.code.strip() for b in BLOCKS), "an empty block"
    assert len(RUN) >= 20 and any(b.language == "r" for b in RUN)  # the docs' examples, not a parse gone wrong


# ---- Python: one server process imports torch and ampkit, then forks a child per block


def serve() -> None:
    """Read one JSON request a line ({code, id, env, cwd}); answer {rc, output} for each."""
    import signal
    import tempfile
    import time

    import torch  # noqa: F401  (imported once, before the forks)

    import ampkit  # noqa: F401

    for line in sys.stdin:
        req = json.loads(line)
        with tempfile.TemporaryFile() as out:
            pid = os.fork()
            if pid == 0:  # the child: a fresh __main__ namespace, its output in the file
                os.dup2(out.fileno(), 1)
                os.dup2(out.fileno(), 2)
                os.environ.update(req["env"])
                os.chdir(req["cwd"])
                rc = 0
                try:
                    exec(compile(req["code"], req["id"], "exec"), {"__name__": "__main__"})
                except SystemExit as e:
                    rc = e.code if isinstance(e.code, int) else 1
                except BaseException:
                    import traceback

                    traceback.print_exc()
                    rc = 1
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)
            deadline, rc = time.monotonic() + BLOCK_SECONDS, None
            while rc is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    rc = os.waitstatus_to_exitcode(status)
                elif time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    rc = 124
                else:
                    time.sleep(0.01)
            out.seek(0)
            text = out.read().decode(errors="replace")
        if rc == 124:
            text += f"\n(killed after {BLOCK_SECONDS} s)"
        print(json.dumps({"rc": rc, "output": text}), flush=True)


def child_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "python"), os.environ.get("PYTHONPATH")])))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["MPLBACKEND"] = "Agg"
    return env


@pytest.fixture(scope="module")
def python_server():
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=child_env(), cwd=REPO,
    )
    yield proc
    proc.stdin.close()
    proc.wait(timeout=60)


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run_python(server, block: Block, tmp_path: Path) -> tuple[int, str]:
    env = {}
    if "torchrun" in block.marks:
        env |= {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port()}
    if "cuda" in block.marks:  # CUDA cannot start in a child forked after its parent started it
        script = tmp_path / "block.py"
        script.write_text(block.code)
        try:
            done = subprocess.run([sys.executable, str(script)], env=child_env() | env, cwd=tmp_path,
                                  capture_output=True, text=True, timeout=BLOCK_SECONDS)
        except subprocess.TimeoutExpired as e:
            return 124, f"{e.stdout or ''}{e.stderr or ''}\n(killed after {BLOCK_SECONDS} s)"
        return done.returncode, done.stdout + done.stderr
    request = {"code": block.code, "id": block.id, "env": env, "cwd": str(tmp_path)}
    server.stdin.write(json.dumps(request) + "\n")
    server.stdin.flush()
    answer = json.loads(server.stdout.readline())
    return answer["rc"], answer["output"]


# ---- R: this worktree's package installed once into a temporary library; one R server
# (doc_blocks_server.R) that has loaded it forks a child per block


@pytest.fixture(scope="module")
def r_server(tmp_path_factory):
    if shutil.which("Rscript") is None:
        pytest.skip("R is not installed (Rscript not on the PATH): the R blocks cannot run")
    lib = tmp_path_factory.mktemp("rlib")
    env = dict(child_env(), R_LIBS=os.pathsep.join(filter(None, [str(lib), os.environ.get("R_LIBS")])),
               RETICULATE_PYTHON=sys.executable, AMPKIT_REPO=str(REPO))
    done = subprocess.run(["R", "CMD", "INSTALL", "--no-multiarch", "-l", str(lib), str(REPO / "r" / "ampkit")],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    log = lib / "server.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(["Rscript", str(Path(__file__).with_name("doc_blocks_server.R"))],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=REPO)
    proc.log = log
    yield proc
    proc.stdin.close()
    proc.wait(timeout=60)


def run_r(server, block: Block, tmp_path: Path) -> tuple[int, str]:
    script, output = tmp_path / "block.R", tmp_path / "output.txt"
    script.write_text(block.code)
    server.stdin.write(f"{script}\t{output}\t{tmp_path}\t{BLOCK_SECONDS}\n")
    server.stdin.flush()
    answer = server.stdout.readline()
    if not answer:
        pytest.fail(f"the R block server stopped:\n{server.log.read_text()}")
    return int(answer), output.read_text() if output.exists() else ""


def block_params(blocks):
    return [pytest.param(b, id=b.id, marks=[pytest.mark.cuda] if "cuda" in b.marks else []) for b in blocks]


RAN: set[str] = set()  # the blocks that ran and passed in this session


@pytest.mark.parametrize("block", block_params([b for b in BLOCKS if b.language == "python"]))
def test_python_block_runs(block, python_server, tmp_path):
    rc, output = run_python(python_server, block, tmp_path)
    assert rc == 0, f"{block.id} failed (exit {rc}):\n{block.code}\n--- output ---\n{output}"
    RAN.add(block.id)


@pytest.mark.parametrize("block", block_params([b for b in BLOCKS if b.language == "r"]))
def test_r_block_runs(block, r_server, tmp_path):
    rc, output = run_r(r_server, block, tmp_path)
    assert rc == 0, f"{block.id} failed (exit {rc}):\n{block.code}\n--- output ---\n{output}"
    RAN.add(block.id)


def test_the_blocks_found_are_the_blocks_run_plus_those_marked_cuda(request):
    """Last in the file: no block was skipped silently (R's absent only where R is not installed)."""
    selected = {item.callspec.params["block"].id for item in request.session.items
                if getattr(item, "callspec", None) and "block" in item.callspec.params}
    if len(selected) < len(BLOCKS):
        pytest.skip(f"{len(selected)} of the {len(BLOCKS)} block tests were selected")
    cuda_not_run = [b.id for b in CUDA if b.id not in RAN]
    no_r = [b.id for b in RUN if b.language == "r" and shutil.which("Rscript") is None]
    print(f"found {len(BLOCKS)}: ran {len(RAN)}, marked cuda and not run {len(cuda_not_run)}, R absent {len(no_r)}")
    assert sorted(RAN) == sorted(b.id for b in BLOCKS if b.id not in cuda_not_run and b.id not in no_r)
    assert len(BLOCKS) == len(RAN) + len(cuda_not_run) + len(no_r)


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    serve()
