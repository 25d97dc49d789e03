"""One section of the GPU check in its own process (`python -m bench.gpu.child`, started by
check.py): it runs the section under its budget, counted from its launch (so its own start-up,
recorded as `startup_s`, is inside it), and writes what it found, also when the budget ends it or
it raises, to the result file."""

from __future__ import annotations

import importlib
import json
import sys
import time
import traceback
from pathlib import Path

from bench.gpu.check import BY_NAME
from bench.gpu.context import Context, SectionTimeout, time_limit


def main(argv: list[str]) -> None:
    name, device, smoke, work, report_in, result, budget, elapsed, launched = argv
    startup = max(time.time() - float(launched), 0.0)  # python, torch and bench.gpu's imports
    section = BY_NAME[name]
    module, function = section.target.split(":")
    ctx = Context(device, smoke == "1", Path(work), started=time.perf_counter() - float(elapsed) - startup,
                  report=json.loads(Path(report_in).read_text()))
    out: dict = {"startup_s": round(startup, 1)}
    left = float(budget) - startup
    ctx.deadline = time.perf_counter() + left
    try:
        run = getattr(importlib.import_module(f"bench.gpu.{module}"), function)
        with time_limit(left):
            run(ctx, out)
        failed = [k for k, v in out.get("checks", {}).items() if not v["ok"]]
        out["status"] = "failed" if failed else "ok"
        if failed:
            out["failed_checks"] = failed
    except SectionTimeout as exc:
        out.update(status="timeout", error=str(exc))
    except Exception as exc:  # reported, not raised: the parent carries on with the next section
        out.update(status="error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-4000:])
    Path(result).write_text(json.dumps(out, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
