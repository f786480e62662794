"""The unified token-budget scheduler (vLLM V1 style).

Every step gives each request a number of tokens to compute: a decode is 1 token (+ its
speculative tokens), a prompt is as many as the budget allows (chunked prefill); there are no
prefill/decode phases, only num_computed_tokens catching up with num_tokens. Running requests
go first (their known tokens, then their speculative ones from what is left), then waiting
ones with what is left of the budget. When KV blocks run out, the lowest-priority running
request is preempted (its blocks freed; it later recomputes).

No I/O and no torch here: schedule() returns plain data, update_from_output() folds results in.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.kv_cache.manager import NO_MATCH, KVCacheManager, PrefixMatch
from pdserve.engine.outputs import (
    RemotePrefill,
    RequestUpdate,
    SampledTokens,
    ScheduledChunk,
    SchedulerOutput,
)
from pdserve.engine.request import Request, RequestStatus, TokenLogprobs


class Scheduler:
    """Owns the waiting and running queues and the KV cache manager."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        max_loras: int | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.max_loras = max_loras
        """Most distinct LoRA adapters among admitted requests (None: LoRA off)."""
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.awaiting_kv: dict[str, Request] = {}
        """Admitted requests whose reserved blocks a prefill node is filling."""
        self.num_preemptions = 0
        self._finished_ids: list[str] = []
        self._prefill_room = config.max_num_batched_tokens
        """Prompt tokens this step may still schedule (schedule() sets it)."""

    # -- queues --------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._enqueue(request)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_awaiting_kv(self) -> int:
        return len(self.awaiting_kv)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.awaiting_kv)

    def has_work(self) -> bool:
        """Whether schedule() could compute anything (requests awaiting KV cannot)."""
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step's work: running requests first, then admissions."""
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        preempted: list[str] = []
        remote: list[RemotePrefill] = []
        cap = self.config.max_prefill_tokens_while_decoding
        # Without chunked prefill a prompt must fit one step: a cap could hold it back forever.
        chunked = self.config.enable_chunked_prefill
        decoding = cap is not None and chunked and any(self._is_decode(r) for r in self.running)
        self._prefill_room = cap if decoding else budget
        budget = self._schedule_running(budget, scheduled, preempted)
        if not preempted:
            self._schedule_waiting(budget, scheduled, remote)
        return self._build_output(scheduled, preempted, remote)

    @staticmethod
    def _is_decode(request: Request) -> bool:
        """Whether the request's next step computes one known token (its last sampled one), not
        a prompt chunk (or a preempted request's recompute)."""
        return request.num_tokens - request.num_computed_tokens == 1

    def _take_prefill(self, num_new: int) -> int:
        """num_new prompt tokens cut to what the step's prefill room allows."""
        return num_new if num_new <= 1 else min(num_new, self._prefill_room)

    def _schedule_running(
        self, budget: int, scheduled: dict[str, int], preempted: list[str]
    ) -> int:
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._num_new_tokens(request, budget)
            if not self._is_decode(request):
                num_new = self._take_prefill(num_new)
            if num_new == 0:
                continue
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self._pick_victim()  # never None: request itself is running
                assert victim is not None
                freed = scheduled.get(victim.request_id, 0)
                budget += freed
                if freed > 1:  # a prompt chunk's tokens go back to the prefill room
                    self._prefill_room += freed
                self._preempt(victim, scheduled, preempted)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = num_new
                budget -= num_new
                if not self._is_decode(request):
                    self._prefill_room -= num_new
        return self._schedule_drafts(budget, scheduled)

    def _schedule_drafts(self, budget: int, scheduled: dict[str, int]) -> int:
        """Add speculative tokens to running requests that sample this step, from what their
        known tokens left of the budget: a draft never takes a request's plain step away.
        Drafts that find no budget or no free block are dropped (never a preemption)."""
        for request in self.running:
            if not request.spec_token_ids:
                continue
            num_known = scheduled.get(request.request_id, 0)
            room = self.max_model_len - request.num_computed_tokens - num_known
            num_spec = min(len(request.spec_token_ids), budget, room)
            samples = (
                num_known > 0 and num_known == request.num_tokens - request.num_computed_tokens
            )
            if not samples or num_spec <= 0:
                continue
            if self.kv.allocate_slots(request, num_known, num_lookahead_tokens=num_spec) is None:
                request.spec_token_ids = []
                continue
            scheduled[request.request_id] = num_known + num_spec
            budget -= num_spec
        return budget

    def _schedule_waiting(
        self, budget: int, scheduled: dict[str, int], remote: list[RemotePrefill]
    ) -> None:
        # Remote reservations spend no budget, so they are admitted even when it is used up.
        adapters = self._admitted_adapters()
        while self.waiting and self._num_admitted < self.config.max_num_seqs:
            request = self.waiting[0]
            if min(budget, self._prefill_room) <= 0 and not request.wants_remote_prefill:
                break  # local work needs budget (checked before the prefix-cache lookup counts)
            name = request.lora_name
            if name is not None and name not in adapters:
                assert self.max_loras is not None  # the engine refuses adapters without LoRA
                if len(adapters) >= self.max_loras:
                    break  # its adapter needs a slot: wait until an admitted adapter's end
                adapters.add(name)
            prefix = (
                self.kv.get_computed_blocks(request)
                if request.num_computed_tokens == 0 and request.prompt_logprobs is None
                else NO_MATCH  # prompt logprobs need every prompt position computed
            )
            num_new = request.num_tokens - request.num_computed_tokens - prefix.num_tokens
            if self._goes_remote(request, num_new):
                if not self._reserve_for_remote(request, num_new, prefix, remote):
                    break
                continue
            room = min(budget, self._prefill_room)
            if room <= 0 or (num_new > room and not self.config.enable_chunked_prefill):
                break
            num_new = min(num_new, room)
            if self.kv.allocate_slots(request, num_new, prefix) is None:
                break
            self.waiting.pop(0)
            if request.num_preemptions == 0:
                request.num_cached_tokens = prefix.num_tokens
            request.num_computed_tokens += prefix.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request.request_id] = num_new
            budget -= num_new
            self._prefill_room -= num_new

    def _admitted_adapters(self) -> set[str]:
        """The LoRA adapters of the running batch and of requests awaiting remote KV."""
        admitted = [*self.running, *self.awaiting_kv.values()]
        return {r.lora_name for r in admitted if r.lora_name is not None}

    @property
    def _num_admitted(self) -> int:
        return len(self.running) + len(self.awaiting_kv)

    def _goes_remote(self, request: Request, num_uncached: int) -> bool:
        """Conditional disaggregation: only prompts with enough uncached tokens go remote, and
        (queue-aware) not while the remote backlog is the longer queue."""
        if not request.wants_remote_prefill:
            return False
        request.wants_remote_prefill = False  # offered once; recompute after preemption is local
        if num_uncached < self.config.remote_prefill_min_tokens:
            return False
        threshold = self.config.max_remote_prefill_queue_tokens
        if threshold == 0:
            return True
        remote_backlog = self.remote_prefill_backlog
        if remote_backlog < threshold:
            return True
        return self.local_prefill_backlog + num_uncached > remote_backlog

    # Both backlogs iterate over a snapshot (list() copies without running Python code), so
    # the metrics scrape thread can read them while the engine thread changes the queues.
    @property
    def remote_prefill_backlog(self) -> int:
        """Uncached prompt tokens this node waits for from prefill nodes."""
        awaiting = list(self.awaiting_kv.values())
        return sum(r.num_prompt_tokens - r.num_computed_tokens for r in awaiting)

    @property
    def local_prefill_backlog(self) -> int:
        """Prompt tokens of running requests still to be computed here."""
        return sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in list(self.running))

    def _reserve_for_remote(
        self, request: Request, num_uncached: int, prefix: PrefixMatch, remote: list[RemotePrefill]
    ) -> bool:
        """Reserve blocks for the whole prompt without computing it (no budget used). The
        blocks stay out of the prefix cache until their KV has arrived."""
        if self.kv.allocate_slots(request, num_uncached, prefix, cache=False) is None:
            request.wants_remote_prefill = True  # still to be offered when blocks free up
            return False
        self.waiting.pop(0)
        request.num_cached_tokens = prefix.num_tokens
        request.num_computed_tokens = prefix.num_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.awaiting_kv[request.request_id] = request
        block_ids = self.kv.get_block_ids(request.request_id)
        remote.append(RemotePrefill(request.request_id, block_ids, prefix.num_tokens))
        return True

    def finish_remote_prefill(
        self, request_id: str, first_token: SampledTokens, num_cached_tokens: int
    ) -> RequestUpdate | None:
        """The prompt's KV has arrived and the prefill node sampled the first token: the
        request joins the running batch. None if it was aborted meanwhile."""
        request = self.awaiting_kv.pop(request_id, None)
        if request is None:
            return None
        request.num_computed_tokens = request.num_prompt_tokens
        request.num_cached_tokens = max(request.num_cached_tokens, num_cached_tokens)
        self.kv.cache_blocks(request, request.num_prompt_tokens)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return self._append_tokens(request, first_token)

    def fail_remote_prefill(self, request_id: str) -> None:
        """No prefill node delivered: keep the reserved blocks and prefill locally from the
        locally cached prefix on."""
        request = self.awaiting_kv.pop(request_id, None)
        if request is None:
            return
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        """The request's known tokens (prompt or last sampled) that this step can compute."""
        num_new = request.num_tokens - request.num_computed_tokens
        return max(min(num_new, budget, self.max_model_len - request.num_computed_tokens), 0)

    def _pick_victim(self) -> Request | None:
        """The running request to preempt: the latest arrival (fcfs), or the lowest priority
        then latest arrival (priority)."""
        candidates = [r for r in self.running if r.status is RequestStatus.RUNNING]
        if not candidates:
            return None
        if self.config.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, request: Request, scheduled: dict[str, int], preempted: list[str]) -> None:
        """Free a running request's blocks; it goes back to the waiting queue to recompute."""
        scheduled.pop(request.request_id, None)
        self.kv.free(request)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        preempted.append(request.request_id)
        self._enqueue(request, front=True)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        if self.config.policy == "priority":
            key = (request.priority, request.arrival_time)
            index = next(
                (i for i, r in enumerate(self.waiting) if (r.priority, r.arrival_time) > key),
                len(self.waiting),
            )
            self.waiting.insert(index, request)
        elif front:
            self.waiting.insert(0, request)
        else:
            self.waiting.append(request)

    def _build_output(
        self, scheduled: dict[str, int], preempted: list[str], remote: list[RemotePrefill]
    ) -> SchedulerOutput:
        chunks = []
        for request_id, num_new in scheduled.items():
            request = self.requests[request_id]
            start = request.num_computed_tokens
            known = request.num_tokens - start
            tokens = request.token_slice(start, start + min(num_new, known))
            num_spec = max(num_new - known, 0)
            tokens += request.spec_token_ids[:num_spec]
            chunks.append(
                ScheduledChunk(
                    request_id=request_id,
                    token_ids=tokens,
                    start_pos=start,
                    block_ids=self.kv.get_block_ids(request_id),
                    num_spec_tokens=num_spec,
                    samples=num_new >= known,
                    lora_name=request.lora_name,
                )
            )
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(chunks, sum(scheduled.values()), preempted, finished, remote)

    # -- folding results back --------------------------------------------------------------------

    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, SampledTokens]
    ) -> list[RequestUpdate]:
        """Advance each scheduled request by what was computed; append sampled tokens, stop
        requests that are done and free their blocks."""
        updates = []
        for chunk in output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            result = sampled.get(chunk.request_id)
            num_known = len(chunk.token_ids) - chunk.num_spec_tokens
            if result is None:  # a prompt chunk that did not reach the end
                request.num_computed_tokens += num_known
                continue
            # The last known token and the accepted drafts are now computed; the final sampled
            # token is not (it is the input of the next step).
            num_accepted_drafts = len(result.token_ids) - 1
            request.num_computed_tokens += num_known + num_accepted_drafts
            request.spec_token_ids = []
            updates.append(self._append_tokens(request, result))
            if not request.finished:
                # Rejected drafts' slots: keep no block wholly past the last token's position.
                self.kv.trim(request.request_id, request.num_tokens)
        return updates

    def _append_tokens(self, request: Request, result: SampledTokens) -> RequestUpdate:
        logprobs = result.logprobs or [None] * len(result.token_ids)
        new_ids: list[int] = []
        new_logprobs: list[TokenLogprobs | None] = []
        for token_id, logprob in zip(result.token_ids, logprobs, strict=True):
            request.output_token_ids.append(token_id)
            if logprob is not None:
                request.output_logprobs.append(logprob)
            new_ids.append(token_id)
            new_logprobs.append(logprob)
            status = self._grammar_status(request, token_id) or self._stop_status(request, token_id)
            if status is not None:
                self._finish(request, status)
                break
        prompt_logprobs = None
        if request.prompt_logprobs is not None and not request.prompt_logprobs_reported:
            request.prompt_logprobs_reported = True
            prompt_logprobs = request.prompt_logprobs
        return RequestUpdate(
            request.request_id,
            new_ids,
            new_logprobs,
            request.finished,
            request.status,
            request.num_cached_tokens,
            request.scheduled_s,
            prompt_logprobs,
        )

    @staticmethod
    def _grammar_status(request: Request, token_id: int) -> RequestStatus | None:
        """Advance a constrained request's matcher by token_id: stopped once the grammar is
        complete (its stop token accepted), or if the token breaks it (only reachable when
        every token was masked, e.g. by min_tokens; the output ends valid so far)."""
        grammar = request.grammar
        if grammar is None or request.prefill_only:
            return None
        if not grammar.accept(token_id) or grammar.is_terminated:
            return RequestStatus.FINISHED_STOPPED
        return None

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        if request.prefill_only:
            return RequestStatus.FINISHED_PREFILLED
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id in request.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if (
            request.num_output_tokens >= params.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (e.g. a stop string matched by the detokenizer)."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.awaiting_kv[request.request_id]
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
