"""Run many command lines of the tools/*.py scripts in ONE fresh interpreter, each as `python SCRIPT ARGS...` would.

Used by the bad-flag tests: every case fails in argument parsing, so a process per case spent its whole time
importing torch and the package (3-8 s of CPU each on 2 cores, 45 cases). `run_tools(cases, env)` starts one
interpreter (`python tests/_tool_runs.py REPORT`, with `env` and the repository root as its working directory) that
runs each script with `runpy.run_path(..., run_name="__main__")` (a module given as "-m NAME": `runpy.run_module`),
`sys.argv` = [script, *args] and the script's folder (a module: the working directory) first on `sys.path`, as
the command line would, and reports for each case what the command line
would have: the exit status (SystemExit's code; 1 and the traceback on stderr for any other exception) and its
stdout and stderr (what Python code writes to sys.stdout / sys.stderr, warnings and tracebacks included).
"""

import contextlib
import importlib.util
import io
import json
import os
import runpy
import subprocess
import sys
import tempfile
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tools(cases, env, timeout=300, setup=""):
    """[(script, argv)] (script: a path relative to the repository root, or "-m NAME" for a module run as
    `python -m NAME`) -> [(returncode, stdout, stderr)],
    in order. `setup`: Python code the interpreter runs once before the cases (say a patch every case needs,
    as `python -c "SETUP; runpy.run_path(SCRIPT)"` would have). Raises AssertionError naming the last case
    started when the interpreter does not end within `timeout` seconds or dies (its stderr)."""
    request = json.dumps({"setup": setup, "cases": [[script, list(argv)] for script, argv in cases]})
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), report], input=request, cwd=ROOT,
                               env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"the tool runs did not end within {timeout}s; last started: "
                                 f"{_last_started(e.stderr)}") from None
        if p.returncode != 0:
            raise AssertionError(f"the tool-run interpreter ended with exit code {p.returncode} during "
                                 f"{_last_started(p.stderr)}:\n{p.stderr[-3000:]}")
        with open(report) as f:
            return [tuple(r) for r in json.load(f)]


def _last_started(stderr):
    if isinstance(stderr, bytes):
        stderr = stderr.decode(errors="replace")
    started = [ln for ln in (stderr or "").splitlines() if ln.startswith("_tool_runs: ")]
    return started[-1][len("_tool_runs: "):] if started else "none"


def _run_one(script, argv):
    """(returncode, stdout, stderr) of `python script *argv` (`script` "-m NAME": `python -m NAME *argv`) run in
    this interpreter."""
    module = script[3:] if script.startswith("-m ") else None
    path = importlib.util.find_spec(module).origin if module else os.path.join(ROOT, script)
    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [path, *argv]
    sys.path.insert(0, ROOT if module else os.path.dirname(path))
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                if module:
                    runpy.run_module(module, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(path, run_name="__main__")
            except SystemExit as e:
                if e.code is None:
                    code = 0
                elif isinstance(e.code, int):
                    code = e.code
                else:  # sys.exit("message"): printed to stderr, status 1
                    print(e.code, file=sys.stderr)
                    code = 1
            except BaseException:  # noqa: BLE001 - reported as the interpreter would
                traceback.print_exc()
                code = 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return code, out.getvalue(), err.getvalue()


def _main():
    request = json.loads(sys.stdin.read())
    cases = request["cases"]
    exec(request["setup"], {})
    results = []
    for script, argv in cases:
        print(f"_tool_runs: {script} {' '.join(argv)}", file=sys.stderr, flush=True)
        results.append(_run_one(script, argv))
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    _main()
