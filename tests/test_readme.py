"""README's "Use" snippet is a complete script and runs as written on CPU under torchrun (2 gloo ranks), as the
README says (before: it used q, k_ctx, cp_group, ... without defining them)."""

import ast
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _use_snippet() -> str:
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme.split("\n## Use\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_use_snippet_runs_under_torchrun_on_cpu(tmp_path):
    script = tmp_path / "use_splitkv.py"
    script.write_text(_use_snippet())
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # searched, not matched per line: the two ranks share one pipe, and with PYTHONUNBUFFERED=1 print writes the
    # text and the newline separately, so one rank's record can land between the other's text and newline
    # (one write each, so a record is whole); the bytes dict is compared by its keys, not their order
    records = dict(re.findall(r"rank (\d): out \(64, 4, 32\) torch\.bfloat16, dq \(64, 4, 32\), bytes (\{[^}]*\})",
                              p.stdout))
    assert sorted(records) == ["0", "1"], p.stdout[-3000:]
    for rank, text in records.items():
        sent = ast.literal_eval(text)
        want = {"splitkv.check", "splitkv.fwd.q", "splitkv.fwd.out", "splitkv.bwd.dq"}  # check: the rank agreement
        assert want <= set(sent), (rank, sent)
        assert all(isinstance(v, int) and v > 0 for v in sent.values()), (rank, sent)
