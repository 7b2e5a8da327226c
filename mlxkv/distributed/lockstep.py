"""Every rank runs the same engine core in lockstep; rank 0 alone talks to the world.

The design (docs/distributed.md): each rank runs the same deterministic
scheduler, block pool and tier policy on its own shard, and rank 0's step
plan (step_plan.py) carries the only inputs that could differ: new requests,
cancels and aborts from rank 0's clients, rank 0's idle time and its clock's
choices for the step. Tier hit lengths are agreed inside the lookup (the
shortest of all ranks'), tier reads happen inside the step, and
restore-or-recompute is pinned to restore (engine/core.py's lockstep
build). A rank that is lost ends every open request with an error.

`LockstepCore` has `EngineCore`'s surface (add, step, abort, has_work,
idle, close, ...), so the Python API and the engine thread drive it
unchanged on rank 0; the other ranks call `follow()`, which serves rank 0's
plans until rank 0 closes. With `check`, every rank digests each step's
plan, block tables and sampled tokens and the set stops on a difference.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time

import mlx.core as mx

from mlxkv.distributed.channel import PlanChannel, PlanMismatch, RankLost
from mlxkv.distributed.identity import cluster_fingerprint
from mlxkv.distributed.rank_report import REPORT_INTERVAL_S, rank_report, read_reports
from mlxkv.distributed.sharding import ShardSpec
from mlxkv.distributed.step_plan import CLOSE, IDLE, STEP, NewRequest, StepPlan
from mlxkv.engine.records import GenerationChunk, RequestFailed
from mlxkv.engine.request import Request, RequestState
from mlxkv.engine.sampling import MAX_SEED, Sampler
from mlxkv.errors import first_line

log = logging.getLogger(__name__)


class RankLink:
    """The agreements a core's build and lookups need (engine/core.py's Lockstep)."""

    def __init__(self, channel: PlanChannel, spec: ShardSpec):
        self.channel, self.spec = channel, spec

    def identity(self, fingerprint: bytes) -> tuple[bytes, bytes]:
        block = cluster_fingerprint(fingerprint, self.spec, self.channel)
        return block, hashlib.sha256(block + self.spec.tag.encode()).digest()

    def agree(self, n: int) -> list[int]:
        return [int.from_bytes(b, "little") for b in self.channel.gather(n.to_bytes(8, "little"))]


class LockstepCore:
    """One rank's engine core, stepped in lockstep with the others'."""

    def __init__(self, core, channel: PlanChannel, spec: ShardSpec, check: bool = False,
                 on_lost=lambda message: None):
        """`on_lost(message)`: called once, on the stepping thread, when a rank is lost."""
        self.core, self.channel, self.spec, self.check, self.on_lost = core, channel, spec, check, on_lost
        self.lost: str | None = None  # why the set ended, once a rank was lost
        self.steps = 0
        self.step_seconds = 0.0  # in the core's steps (the model's own collectives included)
        self._live: dict[int, Request] = {}  # requests every rank holds, by id
        self._new: list[Request] = []  # rank 0's, not sent yet
        self._stops: dict[int, object] = {}  # rank 0's requests' own should_stop, until it says stop
        self._cancelled: set[int] = set()  # ids every rank treats as cancelled
        self._aborts: list[int] = []  # rank 0's, not sent yet
        self._tokens: list[tuple[int, int]] = []  # (request id, token) handed out this step
        self._next_report = 0.0  # rank 0's clock: when its next plan asks every rank for a report

    def __getattr__(self, name):  # the rest of EngineCore's surface: state, stats, hashes
        return getattr(self.core, name)

    # -- rank 0: EngineCore's surface ----------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request for the next plan; one this set cannot serve ends at once with why
        (its first record: the callers' threads go on, as for any failed request)."""
        refused = self.lost or ("grammars and images are not served by a distributed set yet (docs/distributed.md)"
                                if request.grammar is not None or request.image_spans else None)
        if refused is not None:
            request.sink(RequestFailed(refused))
            return
        sampler = request.sampler
        if not sampler.greedy and sampler.seed is None:  # every rank must draw the same token
            request.sampler = Sampler(sampler.temperature, sampler.top_p, sampler.min_p, sampler.top_k,
                                      secrets.randbelow(MAX_SEED))
        self._stops[request.request_id] = request.should_stop
        self._watch(request)
        self._new.append(request)

    def step(self) -> list[Request]:
        plan = StepPlan(STEP, new=[_describe(r) for r in self._new], cancel=self._poll_cancels(),
                        abort=self._aborts, decisions=self.core.decisions(), report=self._report_due())
        added, self._new, self._aborts = self._new, [], []
        if self.lost is not None:
            return self._end_all(self.lost, added)
        try:
            plan = self._exchange(plan)
        except RankLost as e:
            return self._end_all(str(e), added)
        self._apply(plan, added)
        try:
            return self._run(plan)
        except (RankLost, PlanMismatch) as e:  # the set cannot go on: nothing may hang on it
            return self._end_all(str(e), [])

    def abort(self, request: Request) -> None:
        if request in self._new:  # never sent: no rank holds it
            self._new.remove(request)
            self._stops.pop(request.request_id, None)
        elif request.request_id in self._live and request.state != RequestState.FINISHED:
            self._aborts.append(request.request_id)

    @property
    def has_work(self) -> bool:
        return self.lost is None and bool(self._new or self._aborts or self.core.has_work)

    def idle(self, seconds: float) -> None:
        if self.lost is not None:
            return
        try:
            plan = self._exchange(StepPlan(IDLE, idle_s=seconds, report=self._report_due()))
        except RankLost as e:
            self._end_all(str(e), [])
            return
        self._idle(plan)

    def close(self) -> None:
        if self.lost is None and self.channel.cluster.leader:
            try:
                self._exchange(StepPlan(CLOSE))
            except RankLost as e:
                self._end_all(str(e), [])
        self.core.close()

    # -- every other rank ------------------------------------------------------

    def follow(self) -> None:
        """Serve rank 0's plans until it closes; RankLost when rank 0 (or another) is gone."""
        while True:
            plan = self._exchange(None)
            if plan.op == CLOSE:
                self.core.close()
                return
            if plan.op == IDLE:
                self._idle(plan)
                continue
            self._apply(plan, [self._build(r) for r in plan.new])
            self._run(plan)

    # -- both -------------------------------------------------------------------

    def _exchange(self, plan: StepPlan | None) -> StepPlan:
        """Rank 0's plan (None on the others) as every rank decodes it (rank 0 too: all apply
        the same bytes)."""
        self._drain()
        return StepPlan.decode(self.channel.exchange(None if plan is None else plan.encode()))

    def _drain(self) -> None:
        """Wait for the step still in flight (engine/loop.py pipelines them) before the plan's
        collective, which would queue behind it on the same stream anyway: the wait is the
        step's time, and the plan's is then the collective and the wait for a slower rank."""
        began = time.perf_counter()
        try:
            mx.synchronize()
        except RuntimeError as e:  # one of the model's collectives lost its peer
            raise RankLost(f"{self.channel.cluster.describe()}: a peer was lost ({first_line(e)})") from None
        self.step_seconds += time.perf_counter() - began

    def _idle(self, plan: StepPlan) -> None:
        self.core.idle(plan.idle_s)
        self._report_if_asked(plan)

    def _report_due(self) -> bool:
        """Rank 0: whether this plan asks every rank for its report (at most once an interval)."""
        now = time.monotonic()
        if now < self._next_report:
            return False
        self._next_report = now + REPORT_INTERVAL_S
        return True

    def _report_if_asked(self, plan: StepPlan) -> None:
        """Every rank, after the plan's step or pause: its report rides on the next exchange."""
        if plan.report:
            ch = self.channel
            self.channel.attach(rank_report(ch.cluster.rank, self.core, {
                "steps": self.steps, "step_s": round(self.step_seconds, 6), "plan_s": round(ch.seconds, 6),
                "plan_wait_s": round(ch.wait_seconds, 6)}))

    def _apply(self, plan: StepPlan, added: list[Request]) -> None:
        self._cancelled.update(plan.cancel)
        for request_id in plan.abort:
            request = self._live.pop(request_id, None)
            if request is not None:
                self.core.abort(request)
        for request in added:
            self._live[request.request_id] = request
            self.core.add(request)
        self.core.follow(plan.decisions)

    def stats(self) -> dict:
        """The core's, and the set's: this rank, its split, the plan channel's cost (`plan_s`, of
        which `plan_wait_s` waiting for a slower rank) and every rank's last report (`per_rank`)."""
        ch = self.channel
        return {**self.core.stats(), "distributed": {
            "rank": ch.cluster.rank, "ranks": ch.cluster.size, "split": self.spec.kind, "shard": self.spec.tag,
            "steps": self.steps, "step_s": round(self.step_seconds, 6), "plan_collectives": ch.collectives,
            "plan_exchanges": ch.exchanges, "plan_bytes": ch.bytes_moved, "plan_s": round(ch.seconds, 6),
            "plan_wait_s": round(ch.wait_seconds, 6), "check": self.check, "lost": self.lost,
            "per_rank": read_reports(ch.reports)}}

    def _run(self, plan: StepPlan) -> list[Request]:
        self._tokens = []
        began = time.perf_counter()
        finished = self.core.step() if self.core.has_work else []
        self.step_seconds += time.perf_counter() - began
        for request in finished:
            self._live.pop(request.request_id, None)
            self._stops.pop(request.request_id, None)
            self._cancelled.discard(request.request_id)
        self.steps += 1
        if self.core.step_failure is not None:
            # A step that failed on one rank (a model collective that lost its peer, say) leaves
            # the ranks out of step, and a ring that lost a peer can hang the next collective
            # rather than fail it: the set stops here, with no collective more.
            raise RankLost(f"{self.channel.cluster.describe()}: a step failed ({self.core.step_failure})")
        self._report_if_asked(plan)
        if self.check:
            self._agree(plan)
        return finished

    def _agree(self, plan: StepPlan) -> None:
        """Stop the set (PlanMismatch) unless every rank holds the same plan, tables and tokens."""
        # Cached tokens in all, not by tier: one rank may read from its SSD tier what another
        # reads from Redis (its SSD tier lost or new), with the same tables after.
        tables = [(sum(cached.values()), [b.block_id if b is not None else None for b in table])
                  for cached, table in self.core.running_tables()]
        state = repr((plan.encode(), tables, self._tokens, self.core.block_pool.num_free))
        self.channel.agree(f"step {self.steps}", state.encode())

    def _watch(self, request: Request) -> None:
        """Every rank's request: cancelled when the plan says so, its tokens noted for the digest."""
        sink, rid = request.sink, request.request_id

        def put(record) -> None:
            if isinstance(record, GenerationChunk) and record.token is not None:
                self._tokens.append((rid, record.token))
            sink(record)

        request.sink = put
        request.should_stop = lambda: rid in self._cancelled

    def _poll_cancels(self) -> list[int]:
        """Rank 0's clients that asked to stop since the last step (asked once each)."""
        stopped = [rid for rid, stop in self._stops.items() if stop is not None and stop()]
        for rid in stopped:
            del self._stops[rid]
        return stopped

    def _build(self, new: NewRequest) -> Request:
        temperature, top_p, min_p, top_k, seed = new.sampling
        request = Request(new.request_id, new.prompt, new.max_tokens, Sampler(temperature, top_p, min_p, top_k, seed),
                          bytes.fromhex(new.root) if new.root else None, lambda record: None,
                          self.core.tokenizer.detokenizer, speculative=new.speculative)
        self._watch(request)
        return request

    def _end_all(self, message: str, unsent: list[Request]) -> list[Request]:
        """A rank is gone: every open request ends with `message`; nothing more is stepped."""
        first = self.lost is None
        self.lost = message
        log.error("%s: ending %d open requests", message, len(self._live) + len(unsent))
        failed = self.core.fail_all(message)
        for request in unsent:
            request.sink(RequestFailed(message))
        self._live.clear()
        if first:
            self.on_lost(message)
        return failed + unsent


def _describe(request: Request) -> NewRequest:
    s = request.sampler
    return NewRequest(request.request_id, list(request.prompt), request.max_tokens,
                      (s.temperature, s.top_p, s.min_p, s.top_k, s.seed),
                      request.hash_root.hex() if request.hash_root is not None else None, request.speculative)
