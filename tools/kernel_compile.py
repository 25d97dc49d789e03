"""Every Triton kernel of the engine compiled ahead of time for the GPUs it claims, on a machine
without one: each kernel is launched through its own wrapper on meta tensors at the shapes it
serves, with the jitted function swapped for a recorder (so the real grid, arguments and the
JIT's specialisation: dtypes, 16-divisibility, ints equal to 1), then compiled for each target
by Triton's own launch path under a stand-in driver; ptxas reports registers and spills, Triton
the shared memory. A kernel fails on a compile error on a target it claims (its module's
CAPABILITIES), any spill, shared memory over the target's limit, or more than MAX_REGISTERS a
thread unless JUSTIFIED says why.

    python -m tools.kernel_compile                       # the check, a table on stdout
    python -m tools.kernel_compile --json out.json --docs docs/gpu.md   # also the JSON, the docs table
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

MAX_REGISTERS = 128
JUSTIFIED: dict[str, tuple[int, str]] = {}  # kernel -> (registers allowed, why, with its figure)
# shared memory a block may use (opt-in maximum), by compute capability
TARGETS = {80: ("A100", 166912), 86: ("A10, RTX 30", 101376), 89: ("L4, L40S, RTX 40", 101376),
           90: ("H100, H200", 232448), 100: ("B200", 232448)}
META = "meta"
SMS = 132  # an H100 / H200: the SM count the quantized kernels' K splits are sized by


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    qk_norm: bool = False
    experts: int = 0
    top_k: int = 0


SHAPES = (Shape("Llama-3.2-1B", 2048, 8192, 32, 8, 64), Shape("Llama-3.1-8B", 4096, 14336, 32, 8, 128),
          Shape("Qwen3-32B", 5120, 25600, 64, 8, 128, qk_norm=True),
          Shape("Qwen3-30B-A3B", 2048, 768, 32, 4, 128, qk_norm=True, experts=128, top_k=8))
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROWS = (1, 5, 16)  # a pass's tokens as the JIT tells them apart: 1, any, a multiple of 16


@dataclass
class Launch:
    kernel: str  # module.function
    fn: object  # the JITFunction
    grid: tuple
    args: tuple
    kwargs: dict
    min_capability: tuple[int, int]

    def key(self) -> tuple:
        """The JIT's specialisation of this launch (what a compiled kernel is cached by)."""
        params = self.fn.params

        def spec(i, a):
            if isinstance(a, int) and not isinstance(a, bool) and params[i].do_not_specialize:
                return "int"
            if isinstance(a, torch.Tensor):
                return str(a.dtype)
            if isinstance(a, bool) or a is None or isinstance(a, str):
                return a
            if isinstance(a, int):
                return "1" if a == 1 else "div16" if a % 16 == 0 else "i64" if abs(a) >= 2**31 else "i32"
            return type(a).__name__
        return (self.kernel, tuple(spec(i, a) for i, a in enumerate(self.args)), tuple(sorted(self.kwargs.items())))

    def label(self) -> str:
        """The kernel, its input's dtype and the constexprs that select a variant."""
        dtype = str(next(a.dtype for a in self.args if isinstance(a, torch.Tensor))).removeprefix("torch.")
        variant = "".join(f", {k}" if v is True else "" for k, v in sorted(self.kwargs.items()))
        consts = ", ".join(f"{k}={v}" for k, v in sorted(self.kwargs.items()))
        return f"{self.kernel} [{dtype}{variant}] {consts}"


@dataclass
class Result:
    registers: int | None = None
    spill_bytes: int = 0
    shared: int | None = None
    error: str | None = None
    tf32: bool = False  # the PTX multiplies in TF32
    problems: list[str] = field(default_factory=list)


class _Recorder:
    """Stands for a jitted kernel: `kernel[grid](...)` records the launch (capabilities: the
    module's CAPABILITIES, `capability(kwargs)` the key a launch claims)."""

    def __init__(self, name: str, fn, capabilities: dict, capability, launches: list[Launch]):
        self.name, self.fn, self.launches = name, fn, launches
        self.capabilities, self.capability = capabilities, capability

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            needs = self.capabilities[self.capability(kwargs)]
            self.launches.append(Launch(self.name, self.fn, tuple(grid), args, kwargs, needs))
        return launch


def record(shapes=SHAPES, dtypes=DTYPES, rows=ROWS) -> list[Launch]:
    """Every kernel launched through its wrapper at `shapes`, `dtypes` and pass widths, recorded."""
    from engine.model.kernels import fused, invariant, moe, quant

    launches: list[Launch] = []
    fp8, int4, split_sum = quant.kernels()
    add_rms, rope, silu = fused.kernels()
    grouped = moe.kernel()
    dense, attention = invariant.kernels()
    def recorders(module, names: tuple[str, ...], fns: tuple, pick=None):
        return tuple(_Recorder(f"{module.__name__.rsplit('.', 1)[1]}.{n}", f, module.CAPABILITIES,
                               (lambda kw, n=n: pick(n, kw)) if pick else (lambda kw, n=n: n), launches)
                     for n, f in zip(names, fns))
    quant_recorders = recorders(quant, ("fp8", "int4", "split_sum"), (fp8, int4, split_sum),
                                lambda n, kw: "fp8_from_bits" if n == "fp8" and not kw["NATIVE"] else n)
    fused_recorders = recorders(fused, ("add_rms_norm", "rope_qk_write", "silu_mul"), (add_rms, rope, silu))
    moe_recorder = recorders(moe, ("grouped",), (grouped,))[0]
    invariant_recorders = recorders(invariant, ("dense", "attention"), (dense, attention))
    patches = [(quant, "kernels", lambda: quant_recorders), (fused, "kernels", lambda: fused_recorders),
               (moe, "kernel", lambda: moe_recorder), (invariant, "kernels", lambda: invariant_recorders),
               (quant, "sm_count", lambda device: SMS)]
    saved = [(m, n, getattr(m, n)) for m, n, _ in patches]
    try:
        for m, n, f in patches:
            setattr(m, n, f)
        for shape in shapes:
            for dtype in dtypes:
                for t in rows:
                    _launch_all(shape, dtype, t)
    finally:
        for m, n, f in saved:
            setattr(m, n, f)
    return launches


def _launch_all(s: Shape, dtype: torch.dtype, t: int) -> None:
    from engine.model.kernels import fused, invariant, moe, quant
    from engine.model.quant.linear import QuantLinear

    def empty(*shape, dt=dtype):
        return torch.empty(*shape, dtype=dt, device=META)
    q_width = (s.heads + 2 * s.kv_heads) * s.head_dim
    fused.add_rms_norm(empty(t, s.hidden), empty(t, s.hidden), empty(s.hidden), 1e-6)
    fused.add_rms_norm(empty(t, s.hidden), None, empty(s.hidden), 1e-6)
    fused.rope_qk_write(empty(1, t, q_width), empty(1, t, dt=torch.int64), empty(4096, s.head_dim),
                        empty(4096, s.head_dim), empty(s.heads + s.kv_heads, s.head_dim) if s.qk_norm else None,
                        empty(2, s.kv_heads, 4096, s.head_dim), empty(t, dt=torch.int64), s.heads, s.kv_heads, 1e-6)
    keys = 300  # batch_invariant's CUDA rule (kernels/invariant.py): attention over a pool's slice, the linears
    pool = empty(2, s.kv_heads, 2, keys, s.head_dim)
    invariant.fixed_order_attention(empty(2, s.heads, t, s.head_dim), pool[0], pool[1],
                                    empty(2, 1, t, keys, dt=torch.bool), s.head_dim ** -0.5)
    for N, K in ((q_width, s.hidden), (s.hidden, s.heads * s.head_dim)) + (
            () if s.experts else ((2 * s.intermediate, s.hidden), (s.hidden, s.intermediate))):
        invariant.dense_linear(empty(t, K), empty(N, K))
    if s.experts:
        moe.experts(empty(t, s.hidden), empty(t, s.top_k, dt=torch.int64), empty(s.experts, 2 * s.intermediate, s.hidden),
                    empty(s.experts, s.hidden, s.intermediate))
        return
    fused.silu_mul(empty(t, 2 * s.intermediate))
    for N, K in ((q_width, s.hidden), (s.hidden, s.heads * s.head_dim), (2 * s.intermediate, s.hidden),
                 (s.hidden, s.intermediate)):
        fp8 = QuantLinear("fp8", empty(N, K, dt=torch.float8_e4m3fn), empty(-(-N // 128), -(-K // 128), dt=torch.float32),
                          (N, K), block=(128, 128))
        quant.fp8_linear(empty(t, K), fp8, native=True)
        quant.fp8_linear(empty(t, K), fp8, native=False)
        int4 = QuantLinear("int", empty(N, K // 8, dt=torch.int32), empty(N, K // 128, dt=torch.bfloat16), (N, K),
                           bits=4, zero=empty(N, K // 128, dt=torch.uint8), group=128)
        quant.int4_linear(empty(t, K), int4)
        if N == q_width:  # the other forms, once a shape: fp8 a scale a channel, int4 groups of 32 (GPTQ)
            channel = QuantLinear("fp8", fp8.data, empty(N, 1, dt=torch.float32), (N, K), block=(1, K))
            quant.fp8_linear(empty(t, K), channel, native=False)
            small = QuantLinear("int", int4.data, empty(N, K // 32, dt=torch.float16), (N, K), bits=4,
                                zero=empty(N, K // 32, dt=torch.uint8), group=32)
            quant.int4_linear(empty(t, K), small)


class _Driver:
    """Triton's launch path needs a device, a stream and a target: this one has only the target."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device(META)


def compile_for(launch: Launch, capability: int) -> Result:
    """`launch` compiled for sm_<capability>: registers, spills, shared memory, or the error."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    fn = launch.fn
    driver.set_active(_Driver(GPUTarget("cuda", capability, 32)))
    fn.device_caches = defaultdict(fn.create_binder)  # the binder is made per target
    knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    result = Result()
    try:
        with contextlib.redirect_stdout(log):
            compiled = fn.warmup(*launch.args, grid=launch.grid, **launch.kwargs)
        result.shared = int(compiled.metadata.shared)
        result.tf32 = ".tf32" in compiled.asm["ptx"]
    except Exception as e:  # a kernel that does not compile for this target
        text = str(e)
        if "stderr:" in text:  # ptxas: what it said, not the repro command after it
            text = text.split("stderr:", 1)[1].split("Repro command", 1)[0]
        lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
        result.error = f"{type(e).__name__}: {' / '.join(lines[-3:])[:400]}"
        return result
    finally:
        driver._active = None  # the real driver again, made when next asked (none here)
    text = log.getvalue()
    used = re.search(r"Used (\d+) registers", text)
    result.registers = int(used.group(1)) if used else None
    result.spill_bytes = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", text))
    return result


def judge(launch: Launch, capability: int, result: Result) -> list[str]:
    """What fails the check for this launch on this target."""
    name = launch.kernel
    if result.error:
        return [f"does not compile: {result.error}"]
    problems = []
    if result.tf32 and "[float32" in launch.label():
        problems.append("multiplies float32 inputs in TF32")
    if result.spill_bytes:
        problems.append(f"spills {result.spill_bytes} bytes a thread")
    if result.shared is not None and result.shared > TARGETS[capability][1]:
        problems.append(f"shared memory {result.shared} over the target's {TARGETS[capability][1]}")
    allowed = JUSTIFIED.get(name, (MAX_REGISTERS, ""))[0]
    if result.registers is not None and result.registers > allowed:
        problems.append(f"{result.registers} registers a thread (over {allowed})")
    return problems


def targets() -> list[int]:
    """The targets the installed Triton can compile for (sm_100 where it knows Blackwell)."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    try:
        CUDABackend(GPUTarget("cuda", 100, 32))
        return [80, 86, 89, 90, 100]
    except Exception:  # an older Triton
        return [80, 86, 89, 90]


_UNIQUE: list[Launch] = []  # the launches a check compiles, read by its forked workers


def _compile_one(job: tuple[int, int]) -> dict:
    i, cap = job
    launch = _UNIQUE[i]
    result = compile_for(launch, cap)
    return {"kernel": launch.kernel, "label": launch.label(), "target": f"sm_{cap}", "registers": result.registers,
            "spill_bytes": result.spill_bytes, "shared": result.shared, "error": result.error, "tf32": result.tf32,
            "problems": judge(launch, cap, result)}


def check(launches: list[Launch], caps: list[int], progress=None, workers: int = 2) -> list[dict]:
    """Each distinct specialisation compiled for each target it claims (in `workers` forked
    processes): one row each."""
    import multiprocessing

    unique: dict[tuple, Launch] = {}
    for launch in launches:
        unique.setdefault(launch.key(), launch)
    _UNIQUE[:] = unique.values()
    jobs = [(i, cap) for i, launch in enumerate(_UNIQUE) for cap in caps
            if (cap // 10, cap % 10) >= launch.min_capability]
    rows = []
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        for row in pool.imap(_compile_one, jobs, chunksize=2):
            rows.append(row)
            if progress:
                progress(len(rows), len(jobs))
    return rows


def table(rows: list[dict], caps: list[int]) -> str:
    """Markdown: kernel (and dtype) x target, the largest registers / shared KB / spill bytes over
    the shapes; a dash where the kernel does not claim the target."""
    cells: dict[str, dict[str, tuple[int, int, int, bool]]] = defaultdict(dict)
    for r in rows:
        name = r["label"].split("] ")[0] + "]"
        old = cells[name].get(r["target"], (0, 0, 0, False))
        cells[name][r["target"]] = (max(old[0], r["registers"] or 0), max(old[1], r["shared"] or 0),
                                    max(old[2], r["spill_bytes"]), old[3] or bool(r["problems"]))
    head = "| kernel [dtypes] | " + " | ".join(f"sm_{c} ({TARGETS[c][0]})" for c in caps) + " |"
    lines = [head, "| --- |" + " --- |" * len(caps)]
    for name in sorted(cells):
        row = []
        for c in caps:
            cell = cells[name].get(f"sm_{c}")
            row.append("—" if cell is None else f"{cell[0]} / {cell[1] / 1024:.0f} / {cell[2]}" + (" **fails**" if cell[3]
                                                                                                   else ""))
        lines.append(f"| `{name}` | " + " | ".join(row) + " |")
    return "\n".join(lines)


DOCS_START, DOCS_END = "<!-- kernel-compile:start -->", "<!-- kernel-compile:end -->"


def write_docs(path: Path, text: str) -> None:
    doc = path.read_text()
    start, end = doc.index(DOCS_START) + len(DOCS_START), doc.index(DOCS_END)
    path.write_text(doc[:start] + "\n" + text + "\n" + doc[end:])


def _progress(done: int, total: int) -> None:
    if done == total or done % 20 == 0:
        print(f"compiled {done}/{total} (specialisation, target) pairs", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    if "triton" in sys.modules:
        raise SystemExit("run it in a process of its own (python -m tools.kernel_compile): Triton is loaded already")
    os.environ.pop("TRITON_INTERPRET", None)  # the compiler, not the interpreter
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kernel_compile_")  # compile afresh: ptxas reports
    import triton

    ap = argparse.ArgumentParser(prog="python -m tools.kernel_compile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--docs", help="rewrite the table between the kernel-compile markers of this file")
    ap.add_argument("--quick", action="store_true",
                    help="the test suite's scope: every kernel, shape and target in bf16 and float32 (fp16 compiles "
                         "as bf16 does), at 1 and 5 rows")
    args = ap.parse_args(argv)
    shapes = SHAPES
    launches = record(shapes, *(((torch.bfloat16, torch.float32), (1, 5)) if args.quick else (DTYPES, ROWS)))
    caps = targets()
    rows = check(launches, caps, progress=_progress)
    print(file=sys.stderr)
    text = (f"Triton {triton.__version__}, {len({r['label'] for r in rows})} specialisations; each cell: registers a "
            f"thread / shared KB / spill bytes, the largest over {', '.join(s.name for s in shapes)}"
            f"{' (quick)' if args.quick else ''}.\n\n" + table(rows, caps))
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"triton": triton.__version__, "rows": rows}, indent=1))
    if args.docs:
        write_docs(Path(args.docs), text)
    failed = [r for r in rows if r["problems"]]
    for r in failed:
        print(f"FAIL {r['label']} {r['target']}: {'; '.join(r['problems'])}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
