"""torchrun worker of tests/test_teardown.py (not collected: leading underscore).

MODE=repro (default) makes the gloo teardown abort likely: rank 1 joins an asynchronous all-gather 2 s late
while rank 0 has dropped every Python reference to it (tensors and work) and proceeds to exit; a group is
held to the end as Megatron's are. Without a proper teardown a gloo worker thread then frees the
collective's tensors during interpreter finalisation, needs the GIL and std::terminate()s the process
(SIGABRT, torchrun exit 1; ~1 run in 3 here with a plain `sys.exit`). With TEARDOWN=helper the process ends
with megatron_splitkv.comm.shutdown_distributed + exit_process. MODE=megatron: Megatron's model-parallel
groups, one collective, then the helper; prints one JSON line (rank 0) with the thread counts.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from megatron_splitkv.comm import exit_process, gloo_worker_threads, shutdown_distributed

dist.init_process_group("gloo")
r = dist.get_rank()
if os.environ.get("MODE", "repro") == "repro":
    KEEP = dist.new_group([0, 1])  # a group held to the end, as Megatron's are
    if r == 1:
        time.sleep(2)
    x, out = torch.randn(1 << 16), torch.empty(2 << 16)
    work = dist.all_gather_into_tensor(out, x, group=KEEP, async_op=True)
    del x, out, work  # only the gloo worker holds the tensors now
    if os.environ.get("TEARDOWN") != "helper":
        sys.exit(0)
    shutdown_distributed()
    exit_process(0)
from megatron.core import parallel_state as ps  # noqa: E402

ps.initialize_model_parallel(context_parallel_size=2)
x = torch.full((4,), float(r))
dist.all_reduce(x, group=ps.get_context_parallel_group())
before = gloo_worker_threads()
shutdown_distributed()
leftover = [k for k, v in vars(ps).items() if isinstance(v, dist.ProcessGroup)]
if r == 0:
    print(json.dumps({"sum": x.tolist(), "threads_before": before, "threads_after": gloo_worker_threads(),
                      "leftover_groups": leftover, "initialized": dist.is_initialized()}), flush=True)
exit_process(0)
