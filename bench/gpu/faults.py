"""The device-fault path, each case in a child process (a device-side assert poisons the CUDA context
for good): an out-of-range device index and an over-allocation raised inside an engine step must
leave the step as an exception the engine recognises as a device fault (engine/faults.py), so the
serving loop stops and the replica is replaced, instead of failing one request and carrying on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.gpu.context import Context, check

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys, torch
from pathlib import Path
from engine import LLM, SamplingParams
from engine.faults import is_device_fault
from tests.helpers import make_model, make_tokenizer

device, case, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
make_tokenizer(work / "tok")
make_model(work / "m", work / "tok", seed=0)
llm = LLM(model=str(work / "m"), dtype="float32", device=device, forward_plan="torch", max_batch_size=2,
          max_seq_len=64, num_kv_blocks=16)
engine = llm.engine

def fault(req):
    if case == "index":  # an index past the end, on the device: a device-side assert on CUDA
        torch.zeros(4, device=device)[torch.tensor([10], device=device)].sum().item()
    else:  # far more memory than the device has
        torch.empty(1 << 50, dtype=torch.uint8, device=device)

engine.fault_hook = fault
rid = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=4))
result = {"case": case, "raised": None, "device_fault": None, "request_finish": None}
try:
    engine.step()
except BaseException as exc:
    result.update(raised=f"{type(exc).__name__}: {str(exc)[:300]}", device_fault=is_device_fault(exc))
req = engine.request(rid)
result["request_finish"] = None if req is None else req.finish_reason
print("RESULT " + json.dumps(result), flush=True)
"""


def run(ctx: Context, out: dict) -> None:
    cuda = ctx.device.startswith("cuda")
    cases = out["cases"] = {}
    procs = {}
    for case in ("index", "oom"):  # both children at once: each spends most of its time starting
        work = ctx.work / f"fault_{case}"
        work.mkdir(parents=True, exist_ok=True)
        procs[case] = subprocess.Popen([sys.executable, "-c", CHILD, ctx.device, case, str(work)], cwd=REPO,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for case, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=max(10, ctx.left() - 2))
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
        r = json.loads(line[7:]) if line else {"case": case, "child_failed": proc.returncode, "stderr": stderr[-1500:]}
        cases[case] = r
        ctx.log(f"fault {case}: {r}")
        if cuda:
            check(out, f"{case}: the step raises and it is recognised as a device fault", bool(r.get("device_fault")), r)
        else:  # CPU raises ordinary errors: the engine isolates them to the request
            check(out, f"{case} (CPU): the child ran and reported", line is not None, r)
    out["summary"] = [f"{case}: raised {r.get('raised')!r}, device fault {r.get('device_fault')}" for case, r in cases.items()]
