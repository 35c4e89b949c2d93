"""Output processing: a sequence's text as tokens arrive (incremental detokenisation, stop strings found across
token boundaries and cut from the text), the `RequestOutput`s a request's consumer receives (the delta since
the previous output, holding back text that could still turn out to be the start of a stop string, and
cumulative views), and their delivery to the consumers' callbacks."""

from __future__ import annotations

import logging

from engines.outputs import CompletionOutput, RequestOutput
from engines.sequence import Request, Sequence

log = logging.getLogger("tandem.engine")


def append_text(seq: Sequence, token: int, can_stop: bool) -> str | None:
    """Detokenise `token` onto `seq.text`; returns the stop string the new text completed (the text is cut
    where it starts; it may start in earlier text), if stopping is allowed yet."""
    stops = seq.request.params.stop
    before = len(seq.text)
    seq.text += seq.detokenizer.step(token)
    if not (stops and can_stop):
        return None
    start = max(0, before - max(len(s) for s in stops) + 1)
    best, which = -1, None
    for s in stops:
        i = seq.text.find(s, start)
        if i != -1 and (best == -1 or i < best):
            best, which = i, s
    if which is not None:
        seq.text = seq.text[:best]
    return which


def flush_text(seq: Sequence) -> None:
    """The sequence ended by length: the detokeniser's held-back bytes become text."""
    if seq.detokenizer is not None and hasattr(seq.detokenizer, "finish"):
        seq.text += seq.detokenizer.finish()


class OutputProcessor:
    """Builds one engine's outputs; `tokenizer` (None for token-id-only engines) names the logprobs' tokens."""

    def __init__(self, model_name: str, tokenizer: object | None):
        self.model_name = model_name
        self.tokenizer = tokenizer

    def build(self, req: Request, final: bool) -> RequestOutput:
        """The request's output now; advances each sequence's sent marks (what the deltas start from). Only the
        deltas are copied: the cumulative fields are views (`CompletionOutput.of`)."""
        outs = []
        params = req.params
        for seq in req.seqs:
            text_end = len(seq.text)
            if params.stop and not seq.finished:  # hold back what could be the start of a stop string
                text_end = max(seq.sent_text, text_end - max(len(s) for s in params.stop) + 1)
            end = seq.num_tokens
            lps = seq.logprobs
            new_lps = None
            if lps is not None:
                new_lps = lps[seq.sent_logprobs:]
                if self.tokenizer is not None:
                    for pos in new_lps:
                        for t, lp in pos.items():
                            lp.decoded_token = self.tokenizer.token_text(t)
            outs.append(CompletionOutput.of(
                seq.index, seq.token_ids, seq.prompt_len, end, lps, seq.text, text_end,
                cumulative_logprob=seq.cumulative_logprob if lps is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                delta_text=seq.text[seq.sent_text:text_end],
                delta_token_ids=seq.token_ids[seq.prompt_len + seq.sent_tokens:end], delta_logprobs=new_lps))
            seq.sent_tokens = end - seq.prompt_len
            seq.sent_text = text_end
            seq.sent_logprobs = len(lps) if lps is not None else 0
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished=final,
                             error=req.error, metrics=req.metrics, model=self.model_name,
                             embedding=req.seqs[0].embedding if req.seqs else None)

    def deliver(self, outs: list[tuple[Request, RequestOutput]]) -> None:
        """A step's outputs: those for an asyncio consumer (an `emit` with `loop` and `put`, as AsyncEngine
        makes) handed to each event loop in one `call_soon_threadsafe` (one wake-up per step, not one per
        request), the rest delivered one by one. A consumer that went away never takes the engine down."""
        by_loop: dict[int, tuple[object, list]] = {}
        for req, out in outs:
            loop = getattr(req.emit, "loop", None)
            if loop is None:
                try:
                    req.emit(out)
                except Exception:
                    log.exception("engine %s: delivering output of %s failed", self.model_name, req.request_id)
            else:
                by_loop.setdefault(id(loop), (loop, []))[1].append((req.emit.put, out))
        for loop, items in by_loop.values():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                pass


def _put_all(items: list) -> None:
    for put, out in items:
        put(out)
