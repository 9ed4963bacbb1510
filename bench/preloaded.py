"""Python commands forked from one process that has imported torch, DeepSpeed, transformers and the trainer once.

The dry GPU round (bench/gpu_round.py --dry, which tests/test_gpu_round.py runs) starts ~25 tiny Python commands; a
fresh interpreter spends ~4.5 of such a run's ~5 CPU-seconds importing. Each command here is the same script or
module run as `__main__` with its own argv, environment, working directory and output file, in a process forked
from a single-threaded forkserver (no CUDA there: the dry round is CPU only), and it ends as the interpreter would:
its exit code, atexit handlers run, or a traceback on stderr and 1.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRELOAD = ["torch", "torch.distributed", "deepspeed", "transformers", "trainer3d.train.loop", "bench.preloaded"]


def _run_as_main(argv: list[str], env: dict[str, str], log_path: str) -> None:
    """In the forked process: argv is the interpreter, then `-c code`, `-m module` or a script, then its arguments."""
    import atexit
    import runpy
    import traceback

    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout.reconfigure(line_buffering=True)  # both streams share one file: whole lines, in the order written
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    code = 0
    try:
        if argv[1] == "-c":
            sys.argv = ["-c", *argv[3:]]
            exec(compile(argv[2], "<string>", "exec"), {"__name__": "__main__"})
        elif argv[1] == "-m":
            sys.argv = [argv[2], *argv[3:]]
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv[1:]
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[1])))
            runpy.run_path(argv[1], run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - what the interpreter prints for an uncaught exception
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def start_forkserver(preload: list[str], paths: list[str]) -> None:
    """Start the forkserver (if it is not running) importing `preload`, with `paths` first on its PYTHONPATH: Python
    3.11's forkserver imports its preload with the sys.path of its own command line, not its parent's, and skips a
    module that fails to import without a word."""
    from multiprocessing import forkserver

    mp.get_context("forkserver").set_forkserver_preload(preload)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + ([saved] if saved else []))
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


class Preloaded:
    """Starts the forkserver (its imports: ~5 CPU-seconds, once); run() forks a command from it."""

    def __init__(self):
        self.ctx = mp.get_context("forkserver")
        start_forkserver(PRELOAD, [ROOT])

    def run(self, cmd: list[str], env: dict[str, str], timeout_s: float, log_path: str) -> int:
        """cmd's exit code (minus the signal's number if one ended it), or 124 after timeout_s (it is killed)."""
        p = self.ctx.Process(target=_run_as_main, args=(cmd, env, log_path))
        p.start()
        p.join(timeout_s)
        if p.is_alive():
            p.kill()
            p.join()
            return 124
        return p.exitcode
