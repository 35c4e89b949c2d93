"""Bounded grammar compiles: size budgets checked before any work (`check_budget`), and `CompilePool`, worker
processes that prove a constraint compiles within `compile_timeout_s` and are killed when it does not or when
its client leaves. A killed process is replaced at once; small constraints have a lane of their own.

Why a process proves and the engine compiles again: xgrammar 0.2.9 can serialise a `CompiledGrammar`
(`serialize_json` / `deserialize_json`), but its adaptive token-mask cache makes that text huge and slow (on
tandem-tiny's 4,096-token vocabulary a 1,000-property schema compiles in 0.7 s, serialises to 292 MB in 62 s and
deserialises in 28 s), so handing the result back costs far more than compiling it twice. The worker compiles
exactly what the engine will (the same `GrammarCompiler`), so the in-process compile, on a bounded thread pool
of its own (xgrammar releases the GIL while it compiles), takes about as long as the proof did: within budget.
"""

from __future__ import annotations

import collections
import json
import os
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any

from msgspec import Meta, Struct

from engines.structured import InvalidConstraint, StructuredOutput

PositiveInt = Annotated[int, Meta(ge=1)]


class CompileLimits(Struct, kw_only=True, forbid_unknown_fields=True):
    """[preparation]: what one request's constraint may cost (docs/configuration.md)."""

    compile_timeout_s: Annotated[float, Meta(gt=0)] = 10.0  # submission to compiled, queue wait included
    compile_workers: Annotated[int, Meta(ge=1, le=64)] = 2  # processes for constraints over small_constraint_bytes
    small_constraint_bytes: PositiveInt = 4096  # at most this: the small lane (one process of its own)
    max_waiting_compiles: PositiveInt = 64  # per lane; beyond it a 503 compile_pool_busy
    max_schema_bytes: PositiveInt = 64 << 10
    max_schema_properties: PositiveInt = 1000  # summed over every object of the schema
    max_enum_values: PositiveInt = 1000  # in any one enum
    max_schema_depth: PositiveInt = 32  # nested objects and arrays
    max_grammar_bytes: PositiveInt = 64 << 10  # guided_grammar / guided_regex text
    max_grammar_rules: PositiveInt = 1000
    max_choice_options: PositiveInt = 1000
    cache_bytes: PositiveInt = 256 << 20  # compiled grammars kept per engine (xgrammar's memory_size_bytes)
    tokenize_threads: Annotated[int, Meta(ge=1, le=64)] = 2  # the gateway's rendering/tokenising pool
    stall_after_s: Annotated[float, Meta(gt=0)] = 30.0  # /health: a step or pool task older than this is stalled


def _refuse(so: StructuredOutput, what: str, value: int, limit: str, bound: int) -> None:
    raise InvalidConstraint(so.param, f"{so.param}: {what} is {value}, over this server's limit of {bound} "
                            f"([preparation] {limit}); simplify the constraint")


def check_budget(so: StructuredOutput, limits: CompileLimits) -> None:
    """InvalidConstraint (400, naming the field and the limit) for a constraint over a size budget."""
    size = len(so.spec.encode())
    if so.kind == "json":
        if size > limits.max_schema_bytes:
            _refuse(so, "the schema's size in bytes", size, "max_schema_bytes", limits.max_schema_bytes)
        try:
            schema = json.loads(so.spec)
        except ValueError:
            return  # the compiler names the syntax error
        _check_shape(so, [schema], limits)
    elif so.kind == "tool_calls":
        if size > limits.max_schema_bytes:
            _refuse(so, "the tools' parameters size in bytes", size, "max_schema_bytes", limits.max_schema_bytes)
        data = json.loads(so.spec)  # engines/tool_grammar.py `spec`: each schema counted as it stands
        _check_shape(so, [t["parameters"] for t in data["tools"]] + ([data["answer"]] if "answer" in data else []),
                     limits)
    elif so.kind in ("regex", "grammar"):
        if size > limits.max_grammar_bytes:
            _refuse(so, "the constraint's size in bytes", size, "max_grammar_bytes", limits.max_grammar_bytes)
        if so.kind == "grammar":
            rules = sum(1 for line in so.spec.splitlines() if "::=" in line)
            if rules > limits.max_grammar_rules:
                _refuse(so, "the grammar's number of rules", rules, "max_grammar_rules", limits.max_grammar_rules)
    elif so.kind == "choice":
        n = len(json.loads(so.spec))
        if n > limits.max_choice_options:
            _refuse(so, "the number of options", n, "max_choice_options", limits.max_choice_options)
        if size > limits.max_grammar_bytes:
            _refuse(so, "the options' size in bytes", size, "max_grammar_bytes", limits.max_grammar_bytes)


def _check_shape(so: StructuredOutput, schemas: list[Any], limits: CompileLimits) -> None:
    """The property, enum and depth budgets over one constraint's schemas (properties summed over them)."""
    shapes = [_schema_shape(s) for s in schemas] or [(0, 0, 0)]
    props, enum, depth = sum(p for p, _, _ in shapes), max(e for _, e, _ in shapes), max(d for _, _, d in shapes)
    if props > limits.max_schema_properties:
        _refuse(so, "the schema's number of properties", props, "max_schema_properties",
                limits.max_schema_properties)
    if enum > limits.max_enum_values:
        _refuse(so, "the largest enum's size", enum, "max_enum_values", limits.max_enum_values)
    if depth > limits.max_schema_depth:
        _refuse(so, "the schema's nesting depth", depth, "max_schema_depth", limits.max_schema_depth)


def _schema_shape(schema: Any) -> tuple[int, int, int]:
    """(properties summed over every object, the largest enum, the nesting depth) of a JSON schema."""
    props = enum = depth = 0
    stack = [(schema, 1)]
    while stack:
        node, d = stack.pop()
        depth = max(depth, d)
        if isinstance(node, dict):
            p = node.get("properties")
            if isinstance(p, dict):
                props += len(p)
            e = node.get("enum")
            if isinstance(e, list):
                enum = max(enum, len(e))
            stack.extend((v, d + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, d + 1) for v in node if isinstance(v, (dict, list)))
    return props, enum, depth


class CompileBusy(RuntimeError):
    """Every compile slot of the lane is taken and its queue is full (a 503: retry later)."""


class _Job:
    __slots__ = ("info", "so", "deadline", "future", "abandoned", "started", "cold")

    def __init__(self, info: tuple[str, str], so: StructuredOutput, deadline: float):
        self.info, self.so, self.deadline = info, so, deadline  # info: (its key, TokenizerInfo JSON)
        self.future: Future = Future()
        self.abandoned = threading.Event()
        self.started: float | None = None
        self.cold = False  # submitted while no worker of its lane was up: the budget starts once one is


# The worker imports `engines.structured` without running engines/__init__.py (the model, the kernels).
_BOOT = ("import sys, types; pkg = types.ModuleType('engines'); pkg.__path__ = [sys.argv[1]]; "
         "sys.modules['engines'] = pkg; from engines.compile_pool import _worker_main; _worker_main()")


class _Slot:
    """One worker process and the thread that feeds it jobs from its lane, one at a time."""

    def __init__(self, lane: _Lane, name: str):
        self.lane = lane
        self.proc: subprocess.Popen | None = None
        self.ready = False
        self.infos: set[str] = set()
        self.job: _Job | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _spawn(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, str(Path(__file__).parent)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.ready, self.infos = False, set()

    def kill(self) -> None:
        self.ready = False
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def _read(self, deadline: float, job: _Job | None) -> dict | None:
        """The worker's next line, or None at the deadline, when `job` is abandoned or the worker died."""
        fd = self.proc.stdout
        while not self.lane.pool.closed:
            if job is not None and job.abandoned.is_set():
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if select.select([fd], [], [], min(left, 0.05))[0]:
                line = fd.readline()
                return json.loads(line) if line else None
        return None

    def _run(self) -> None:
        pool = self.lane.pool
        while not pool.closed:
            if self.proc is None:
                self._spawn()
                hello = self._read(time.monotonic() + 300, None)  # importing torch and xgrammar
                if not hello or not hello.get("ready"):
                    self.kill()
                    time.sleep(1)
                    continue
                self.ready = True
                self.lane.warmed()
            job = self.lane.take(self)
            if job is None:
                break
            self.job = job
            try:
                self._serve(job)
            except Exception as exc:  # a broken pipe: the worker died; the next job gets a fresh one
                self.kill()
                if not job.future.done():
                    job.future.set_exception(InvalidConstraint(job.so.param, f"{job.so.param}: the compile "
                                                               f"worker failed ({type(exc).__name__}); retry"))
            finally:
                self.job = None
        self.kill()

    def _serve(self, job: _Job) -> None:
        so = job.so
        key, info_json = job.info
        msg = {"kind": so.kind, "spec": so.spec, "param": so.param, "info": key}
        if key not in self.infos:
            msg["info_json"] = info_json
        job.started = time.monotonic()
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        self.proc.stdin.flush()
        self.infos.add(key)
        reply = self._read(job.deadline, job)
        if reply is None:  # over the budget or the client left: the compile stops with its process
            self.kill()
            if self.lane.pool.closed:
                return job.future.set_exception(CompileBusy("the server is shutting down"))
            if job.abandoned.is_set():
                return job.future.set_exception(InvalidConstraint(so.param, f"{so.param}: the client left"))
            return job.future.set_exception(self.lane.pool.over_budget(job))
        if reply.get("ok"):
            return job.future.set_result(reply.get("seconds", 0.0))
        job.future.set_exception(InvalidConstraint(reply.get("param", so.param), reply.get("error", ""),
                                                   reply.get("keyword"), reply.get("pointer")))


class _Lane:
    def __init__(self, pool: CompilePool, name: str, workers: int):
        self.pool = pool
        self.jobs: collections.deque[_Job] = collections.deque()
        self.cv = threading.Condition()
        self.name, self.workers = name, workers
        self.slots: list[_Slot] = []  # started with the lane's first job

    def submit(self, job: _Job) -> None:
        with self.cv:
            if len(self.jobs) >= self.pool.limits.max_waiting_compiles:
                raise CompileBusy("the grammar compile queue is full; retry later")
            if not self.slots:
                self.slots = [_Slot(self, f"{self.name}-{i}") for i in range(self.workers)]
            job.cold = not any(s.ready for s in self.slots)
            self.jobs.append(job)
            self.cv.notify()

    def warmed(self) -> None:
        """A worker is up: the budget of the jobs that waited for one starts now (start-up is not theirs)."""
        with self.cv:
            now = time.monotonic()
            for job in self.jobs:
                if job.cold:
                    job.deadline, job.cold = now + self.pool.limits.compile_timeout_s, False

    def take(self, slot: _Slot) -> _Job | None:
        """The next job still wanted and within its budget (the others end here), or None once closed."""
        with self.cv:
            while True:
                while not self.jobs and not self.pool.closed:
                    self.cv.wait(0.5)
                if self.pool.closed:
                    return None
                job = self.jobs.popleft()
                if job.cold:
                    job.deadline, job.cold = time.monotonic() + self.pool.limits.compile_timeout_s, False
                if job.abandoned.is_set():
                    job.future.cancel()
                elif time.monotonic() >= job.deadline:
                    job.future.set_exception(self.pool.over_budget(job))
                else:
                    job.future.set_running_or_notify_cancel()
                    return job


class CompilePool:
    """Proves constraints compile within budget in killable worker processes (see the module docstring), and
    compiles them in-process on a bounded thread pool. Thread-safe; `close` kills every worker."""

    def __init__(self, limits: CompileLimits | None = None):
        self.limits = limits or CompileLimits()
        self.closed = False
        self.small = _Lane(self, "compile-small", 1)
        self.large = _Lane(self, "compile", self.limits.compile_workers)
        self.threads = ThreadPoolExecutor(self.limits.compile_workers + 1, thread_name_prefix="grammar-compile")
        self._in_process: dict[int, float] = {}  # id -> start of each in-process compile (for `stalled`)

    def over_budget(self, job: _Job) -> InvalidConstraint:
        p = job.so.param
        return InvalidConstraint(p, f"{p}: compiling the constraint did not finish within this server's budget "
                                 f"of {self.limits.compile_timeout_s:g} s ([preparation] compile_timeout_s); "
                                 "simplify the constraint")

    def prove(self, info: tuple[str, str], so: StructuredOutput) -> tuple[Future, threading.Event]:
        """Start proving `so` compiles in budget: (a future of the worker's seconds or InvalidConstraint, the
        event that abandons it: set it when the client leaves and the worker is killed)."""
        check_budget(so, self.limits)
        job = _Job(info, so, time.monotonic() + self.limits.compile_timeout_s)
        lane = self.small if len(so.spec.encode()) <= self.limits.small_constraint_bytes else self.large
        lane.submit(job)
        return job.future, job.abandoned

    def run_compile(self, fn, *args) -> Future:
        """`fn(*args)` on the in-process compile threads (timed for `stalled`)."""
        def timed():
            key = threading.get_ident()
            self._in_process[key] = time.monotonic()
            try:
                return fn(*args)
            finally:
                self._in_process.pop(key, None)
        return self.threads.submit(timed)

    def wait_ready(self, timeout: float) -> bool:
        """Whether every started worker is up within `timeout` s."""
        deadline = time.monotonic() + timeout
        for lane in (self.small, self.large):
            for slot in list(lane.slots):
                while not slot.ready and time.monotonic() < deadline:
                    time.sleep(0.02)
                if not slot.ready:
                    return False
        return True

    def stalled(self, now: float | None = None) -> str | None:
        """Why the pool cannot make progress (a slot thread died, a job ran far past its budget, an in-process
        compile older than `stall_after_s`), or None."""
        now = time.monotonic() if now is None else now
        slack = self.limits.stall_after_s
        for lane in (self.small, self.large):
            for slot in list(lane.slots):
                if not slot.thread.is_alive() and not self.closed:
                    return f"compile worker thread {slot.thread.name} died"
                job = slot.job
                if job is not None and now > job.deadline + slack:
                    return f"a grammar compile has run {now - job.deadline:.0f} s past its budget"
        oldest = min(self._in_process.values(), default=None)
        if oldest is not None and now - oldest > slack:
            return f"an in-process grammar compile has run {now - oldest:.0f} s"
        return None

    def close(self) -> None:
        """Kill every worker; what waits or runs ends with CompileBusy (a 503)."""
        self.closed = True
        for lane in (self.small, self.large):
            with lane.cv:
                while lane.jobs:
                    job = lane.jobs.popleft()
                    if job.future.set_running_or_notify_cancel():
                        job.future.set_exception(CompileBusy("the server is shutting down"))
                lane.cv.notify_all()
            for slot in list(lane.slots):
                slot.kill()
        self.threads.shutdown(wait=False, cancel_futures=True)


def _worker_main() -> None:
    """A compile worker: reads one JSON job a line on stdin, compiles it as the engine would, answers a line."""
    import xgrammar as xgr

    from engines.grammar_check import require_finite_derivation
    from engines.structured import GrammarCompiler

    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')
    out.flush()
    compilers: dict[str, GrammarCompiler] = {}
    for line in sys.stdin.buffer:
        msg = json.loads(line)
        if "info_json" in msg:
            built = json.loads(msg["info_json"])  # GrammarCompiler.worker_info
            compilers[msg["info"]] = GrammarCompiler.from_info(xgr.TokenizerInfo.deserialize_json(built["xgrammar"]),
                                                               built["llguidance"])
        so = StructuredOutput(msg["kind"], msg["spec"], msg["param"])
        t0 = time.perf_counter()
        try:
            require_finite_derivation(so)
            compilers[msg["info"]].compile_uncached(so)
            reply = {"ok": True, "seconds": time.perf_counter() - t0}
        except InvalidConstraint as e:
            reply = {"ok": False, "param": e.param, "error": str(e), "keyword": e.keyword, "pointer": e.pointer}
        except Exception as e:  # never expected: the request is refused, the worker lives
            reply = {"ok": False, "param": so.param, "error": f"{so.param} cannot be compiled: {e}"}
        out.write((json.dumps(reply) + "\n").encode())
        out.flush()
